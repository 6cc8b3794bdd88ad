"""Attributes replaced for the duration of one program run, and put back after it.

`Patches.set(owner, "name", value)` replaces `owner.name` and remembers the original;
`restore()` puts every original back in reverse order, also after the program raised.
`Patches.everywhere(original, value)` replaces a function in every loaded module that
bound it by name (`from safetensors import safe_open` makes `transformers.modeling_utils
.safe_open` a second reference that patching `safetensors.safe_open` alone would miss).
`Patches.on_import(package, apply)` calls `apply(module)` for every module of a package
(the package and its submodules) already loaded, and for each the program imports later,
right after its code has run (a finder first on `sys.meta_path` wraps the module's loader):
a library the program may or may not import is patched only when it does.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from importlib.abc import Loader, MetaPathFinder
from types import ModuleType
from typing import Any

_MISSING = object()


def in_package(name: str, package: str) -> bool:
    """Whether module `name` is `package` or one of its submodules."""
    return name == package or name.startswith(package + ".")


class _ImportWatch(MetaPathFinder):
    """Calls `apply(module)` after each module of `package` is executed (module docstring)."""

    def __init__(self, package: str, apply: Callable[[ModuleType], None]) -> None:
        self.package = package
        self.apply = apply
        self._finding: set[str] = set()

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if not in_package(fullname, self.package) or fullname in self._finding:
            return None
        import importlib.util

        self._finding.add(fullname)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._finding.discard(fullname)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        spec.loader = _ThenApply(loader, self.apply)
        return spec


class _ThenApply(Loader):
    """A module's loader that calls `apply(module)` after running the module; its other
    methods (source, resources) are the loader's own."""

    def __init__(self, loader: Any, apply: Callable[[ModuleType], None]) -> None:
        self._loader = loader
        self._apply = apply

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._apply(module)


class Patches:
    """Replaced attributes, restorable (module docstring)."""

    def __init__(self) -> None:
        self._undo: list[tuple[Any, str, Any]] = []
        self._swept: list[tuple[Any, Any, tuple[str, ...]]] = []  # (original, replacement, prefixes)
        self._watches: list[_ImportWatch] = []
        self._on_restore: list[Callable[[], None]] = []

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

    def on_import(self, package: str, apply: Callable[[ModuleType], None]) -> None:
        """`apply(module)` for each module of `package`, loaded now or later (module docstring)."""
        for name, module in sorted(sys.modules.items()):
            if module is not None and in_package(name, package):
                apply(module)
        watch = _ImportWatch(package, apply)
        sys.meta_path.insert(0, watch)
        self._watches.append(watch)

    def on_restore(self, callback: Callable[[], None]) -> None:
        """`callback()` first when the run's changes are put back."""
        self._on_restore.append(callback)

    def restore(self) -> None:
        """Put every original back: the replaced attributes, and the bindings of a replaced
        function that modules imported during the run made of the replacement; no import is
        watched any more."""
        while self._on_restore:
            self._on_restore.pop()()
        while self._watches:
            watch = self._watches.pop()
            if watch in sys.meta_path:
                sys.meta_path.remove(watch)
        while self._swept:
            original, value, prefixes = self._swept.pop()
            self._rebind(value, original, prefixes, remember=False)
        while self._undo:
            owner, name, original = self._undo.pop()
            if original is _MISSING:
                try:
                    delattr(owner, name)
                except AttributeError:
                    pass
            else:
                setattr(owner, name, original)

