"""Compiling the planned allocator's C++ core, once, with `torch.utils.cpp_extension`.

The sources live in `csrc/` beside this file: `planned_core.h` (device-neutral plan
matching, shared by both glues), `planned_allocator.cpp` (the CPU glue: a
`c10::Allocator` installed with `c10::SetCPUAllocator`) and
`planned_allocator_cuda.cpp` (the CUDA glue behind
`torch.cuda.memory.CUDAPluggableAllocator`, compiled only when CUDA is present).
`cpp_extension.load` JIT-compiles with ninja and caches the build under
`TORCH_EXTENSIONS_DIR` (default `~/.cache/torch_extensions`), keyed by the sources'
hash, so only the first use after a change pays the compile (about a minute here).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from functools import cache
from pathlib import Path
from types import ModuleType

from memplan.errors import UserError

CSRC = Path(__file__).resolve().parent / "csrc"
CPU_EXTENSION = "memplan_planned_allocator"
CUDA_EXTENSION = "memplan_planned_allocator_cuda"


def _cflags() -> list[str]:
    # cpp_extension rebuilds when the sources or flags change, not the headers: the
    # header's hash in a flag makes a change to the shared core rebuild both glues.
    digest = hashlib.sha256((CSRC / "planned_core.h").read_bytes()).hexdigest()[:16]
    return ["-O2", "-std=c++17", f"-DMEMPLAN_CORE_SHA={digest}"]


def missing_build_tools() -> list[str]:
    """What the JIT build needs and this machine lacks (empty: it can build)."""
    from torch.utils.cpp_extension import is_ninja_available

    missing = []
    compiler = os.environ.get("CXX", "c++")
    if not (shutil.which(compiler) or shutil.which("g++") or shutil.which("clang++")):
        missing.append(f"a C++ compiler (looked for {compiler}, g++, clang++: install g++ or set CXX)")
    if not is_ninja_available():
        missing.append("ninja (pip install ninja)")
    return missing


def _check_build_tools() -> None:
    missing = missing_build_tools()
    if missing:
        raise UserError(
            "memplan's planned allocator compiles a small C++ extension on first use and needs "
            + " and ".join(missing)
        )


@cache
def cpu_extension() -> ModuleType:
    """The compiled CPU allocator (Session, new_planned, new_recorder, ...)."""
    _check_build_tools()
    from torch.utils.cpp_extension import load

    try:
        return load(
            name=CPU_EXTENSION,
            sources=[str(CSRC / "planned_allocator.cpp")],
            extra_include_paths=[str(CSRC)],
            extra_cflags=_cflags(),
            verbose=False,
        )
    except (RuntimeError, OSError) as exc:
        raise UserError(f"could not compile memplan's planned allocator: {str(exc).strip().splitlines()[-1]}") from exc


@cache
def cuda_extension() -> str:
    """Path of the compiled CUDA allocator library, for CUDAPluggableAllocator."""
    import torch

    if not torch.cuda.is_available():
        raise UserError("the CUDA planned allocator needs a CUDA device; this machine has none")
    _check_build_tools()
    from torch.utils.cpp_extension import load

    module = load(
        name=CUDA_EXTENSION,
        sources=[str(CSRC / "planned_allocator_cuda.cpp")],
        extra_include_paths=[str(CSRC)],
        extra_cflags=_cflags(),
        with_cuda=True,
        is_python_module=False,
        verbose=False,
    )
    del module
    build_dir = Path(torch.utils.cpp_extension._get_build_directory(CUDA_EXTENSION, verbose=False))
    return str(build_dir / f"{CUDA_EXTENSION}.so")
