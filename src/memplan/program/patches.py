"""Attributes replaced for the duration of one program run, and put back after it.

`Patches.set(owner, "name", value)` replaces `owner.name` and remembers the original;
`restore()` puts every original back in reverse order, also after the program raised.
`Patches.everywhere(original, value)` replaces a function in every loaded module that
bound it by name (`from safetensors import safe_open` makes `transformers.modeling_utils
.safe_open` a second reference that patching `safetensors.safe_open` alone would miss).
"""

from __future__ import annotations

import sys
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

    def restore(self) -> None:
        """Put every original back: the replaced attributes, and the bindings of a replaced
        function that modules imported during the run made of the replacement."""
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
