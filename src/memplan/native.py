"""The one loader of memplan's C++ extensions: `torch.utils.cpp_extension.load`, once per process.

`cpp_extension.load` JIT-compiles with ninja and caches the build under
`TORCH_EXTENSIONS_DIR` (default `~/.cache/torch_extensions`), keyed by the sources'
hash and the flags, so only the first use after a change pays the compile. The
planned allocator (`memplan.runtime.build`) and the exact offset search
(`memplan.layout.native`) both build through `build_extension`.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from memplan.errors import UserError

CFLAGS = ("-O2", "-std=c++17")


def missing_build_tools() -> list[str]:
    """The tools the JIT build needs that are missing (empty: it can build)."""
    from torch.utils.cpp_extension import is_ninja_available

    missing = []
    compiler = os.environ.get("CXX", "c++")
    if not (shutil.which(compiler) or shutil.which("g++") or shutil.which("clang++")):
        missing.append(f"a C++ compiler (looked for {compiler}, g++, clang++: install g++ or set CXX)")
    if not is_ninja_available():
        missing.append("ninja (pip install ninja)")
    return missing


def build_extension(name: str, sources: Sequence[Path], *, purpose: str,
                    include_paths: Sequence[Path] = (), extra_cflags: Sequence[str] = (),
                    with_cuda: bool = False) -> ModuleType | None:
    """Compile (or load the cached build of) extension `name` from `sources`.

    `purpose` names it in errors ("memplan's planned allocator"). With `with_cuda` the
    build is a plain shared library for `CUDAPluggableAllocator` and None is returned
    (its path is `extension_path(name)`). Raises UserError when tools are missing or
    the compile fails, with the compiler's last line.
    """
    missing = missing_build_tools()
    if missing:
        raise UserError(f"{purpose} compiles a small C++ extension on first use and needs " + " and ".join(missing))
    from torch.utils.cpp_extension import load

    try:
        module = load(
            name=name,
            sources=[str(s) for s in sources],
            extra_include_paths=[str(p) for p in include_paths],
            extra_cflags=[*CFLAGS, *extra_cflags],
            with_cuda=with_cuda or None,
            is_python_module=not with_cuda,
            verbose=False,
        )
    except (RuntimeError, OSError) as exc:
        raise UserError(f"could not compile {purpose}: {str(exc).strip().splitlines()[-1]}") from exc
    return None if with_cuda else module


def extension_path(name: str) -> Path:
    """Where the shared library of a plain (non-Python) extension `name` was built."""
    from torch.utils import cpp_extension

    return Path(cpp_extension._get_build_directory(name, verbose=False)) / f"{name}.so"
