"""Compiling the planned allocator's C++ core, once, with `torch.utils.cpp_extension`.

The sources live in `csrc/` beside this file: `planned_core.h` (device-neutral plan
matching, shared by both glues), `planned_allocator.cpp` (the CPU glue: a
`c10::Allocator` installed with `c10::SetCPUAllocator`) and
`planned_allocator_cuda.cpp` (the CUDA glue behind
`torch.cuda.memory.CUDAPluggableAllocator`, compiled only when CUDA is present).
`memplan.native.build_extension` compiles them (once; cached by torch).
"""

from __future__ import annotations

import hashlib
import os
from functools import cache
from pathlib import Path
from types import ModuleType

from memplan.errors import UserError
from memplan.native import build_extension, extension_path

CSRC = Path(__file__).resolve().parent / "csrc"
CPU_EXTENSION = "memplan_planned_allocator"
CUDA_EXTENSION = "memplan_planned_allocator_cuda"
PURPOSE = "memplan's planned allocator"


def _core_flag() -> str:
    # cpp_extension rebuilds when the sources or flags change, not the headers: the
    # header's hash in a flag makes a change to the shared core rebuild both glues.
    digest = hashlib.sha256((CSRC / "planned_core.h").read_bytes()).hexdigest()[:16]
    return f"-DMEMPLAN_CORE_SHA={digest}"


@cache
def cpu_extension() -> ModuleType:
    """The compiled CPU allocator (Session, new_planned, new_recorder, ...)."""
    module = build_extension(CPU_EXTENSION, [CSRC / "planned_allocator.cpp"], purpose=PURPOSE,
                             include_paths=[CSRC], extra_cflags=[_core_flag()])
    assert module is not None
    return module


@cache
def cuda_extension() -> str:
    """Path of the compiled CUDA allocator library, for CUDAPluggableAllocator.

    Building must not initialise CUDA: the allocator can be swapped only before that.
    With CUDA on and TORCH_CUDA_ARCH_LIST unset, torch/utils/cpp_extension.py's
    `_get_cuda_arch_flags` asks every device for its capability
    (`torch.cuda.get_device_capability`, which runs CUDA's lazy initialisation), even
    for a build with no .cu file. The glue is plain C++ (no kernel), so the arch list
    only fills the ninja file: it is set for the build when the caller has not set it.
    """
    import torch

    if not torch.cuda.is_available():
        raise UserError("the CUDA planned allocator needs a CUDA device; none is visible to PyTorch")
    unset = "TORCH_CUDA_ARCH_LIST" not in os.environ
    if unset:
        os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0"
    try:
        build_extension(CUDA_EXTENSION, [CSRC / "planned_allocator_cuda.cpp"], purpose=PURPOSE,
                        include_paths=[CSRC], extra_cflags=[_core_flag()], with_cuda=True)
    finally:
        if unset:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
    return str(extension_path(CUDA_EXTENSION))
