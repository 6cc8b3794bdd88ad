"""Attributes replaced for the duration of one program run, and put back after it.

`Patches.set(owner, "name", value)` replaces `owner.name` and remembers the original;
`restore()` puts every original back in reverse order, also after the program raised.
`Patches.everywhere(original, value)` replaces a function in every loaded module that
bound it by name (`from safetensors import safe_open` makes `transformers.modeling_utils
.safe_open` a second reference that patching `safetensors.safe_open` alone would miss).
`Patches.when_imported(name, patch)` runs `patch(module)` on a module now if it is loaded,
else right after the program imports it (a finder first on `sys.meta_path` whose loader runs
the module, then the patch): a library the program may never import is not imported for it.
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Callable
from typing import Any

_MISSING = object()


class Patches:
    """Replaced attributes, restorable (module docstring)."""

    def __init__(self) -> None:
        self._undo: list[tuple[Any, str, Any]] = []
        self._swept: list[tuple[Any, Any, tuple[str, ...]]] = []  # (original, replacement, prefixes)

    def set(self, owner: Any, name: str, value: Any) -> Any:
        """Replace `owner.name` by `value`; the original (or None when there was none)."""
        original = owner.__dict__.get(name, _MISSING) if hasattr(owner, "__dict__") else getattr(owner, name, _MISSING)
        self._undo.append((owner, name, original))
        setattr(owner, name, value)
        return None if original is _MISSING else original

    def everywhere(self, original: Any, value: Any, prefixes: tuple[str, ...]) -> int:
        """Replace every module-level binding of `original` in the loaded modules whose name
        starts with one of `prefixes`; the number of bindings replaced."""
        self._swept.append((original, value, prefixes))
        return self._rebind(original, value, prefixes, remember=True)

    def _rebind(self, original: Any, value: Any, prefixes: tuple[str, ...], *, remember: bool) -> int:
        count = 0
        for name, module in list(sys.modules.items()):
            if module is None or not name.startswith(prefixes):
                continue
            namespace = getattr(module, "__dict__", {})
            for attr, bound in list(namespace.items()):
                if bound is original:
                    if remember:
                        self.set(module, attr, value)
                    else:
                        setattr(module, attr, value)
                    count += 1
        return count

    def when_imported(self, name: str, patch: Callable[[Any], None]) -> None:
        """`patch(module)` on the module `name` once it is loaded (module docstring)."""
        if name in sys.modules:
            patch(sys.modules[name])
            return
        finder = _AfterImport(name, patch)
        sys.meta_path.insert(0, finder)
        self._undo.append((_MetaPath(finder), "", _MISSING))

    def restore(self) -> None:
        """Put every original back: the replaced attributes, and the bindings of a replaced
        function that modules imported during the run made of the replacement."""
        while self._swept:
            original, value, prefixes = self._swept.pop()
            self._rebind(value, original, prefixes, remember=False)
        while self._undo:
            owner, name, original = self._undo.pop()
            if isinstance(owner, _MetaPath):
                owner.remove()
            elif original is _MISSING:
                try:
                    delattr(owner, name)
                except AttributeError:
                    pass
            else:
                setattr(owner, name, original)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds the module `name` with the other finders and patches it once its loader ran it."""

    def __init__(self, name: str, patch: Callable[[Any], None]) -> None:
        self.name = name
        self.patch = patch

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != self.name:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _ThenPatch(spec.loader, self.patch)
                return spec
        return None


class _ThenPatch:
    """A module loader that patches the module after running it; the loader's other methods
    (source, resources) are its own."""

    def __init__(self, loader: Any, patch: Callable[[Any], None]) -> None:
        self._loader = loader
        self._patch = patch

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        self._patch(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class _MetaPath:
    """The undo entry of a finder on `sys.meta_path`."""

    def __init__(self, finder: Any) -> None:
        self.finder = finder

    def remove(self) -> None:
        if self.finder in sys.meta_path:
            sys.meta_path.remove(self.finder)
