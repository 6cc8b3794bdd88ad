"""Put this folder first on PYTHONPATH and a Python started with it finds none of memplan's
optional packages (bitsandbytes, torchao, litgpt, ortools, import-linter), as on a GPU
machine's own Python that has none of them: `importlib.util.find_spec` answers None and an
import raises `ModuleNotFoundError`, exactly as when they are not installed.

Python imports `sitecustomize` at start-up from the first folder of `sys.path` that has one
(the `site` module's documentation); the path finder is replaced by one that skips these names.
"""

import importlib.machinery
import sys

HIDDEN = frozenset({"bitsandbytes", "torchao", "litgpt", "ortools", "importlinter"})


class _PathFinderWithoutOptionalPackages(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, fullname, path=None, target=None):  # noqa: ANN001, ANN206 - PathFinder's signature
        if fullname.partition(".")[0] in HIDDEN:
            return None
        return super().find_spec(fullname, path, target)


sys.meta_path[:] = [_PathFinderWithoutOptionalPackages if finder is importlib.machinery.PathFinder else finder
                    for finder in sys.meta_path]
