"""The planned allocator on CUDA: the same C++ core behind `CUDAPluggableAllocator`.

STAlloc (arXiv 2507.16274) runs its plans through a PyTorch pluggable CUDA allocator;
so does this. PyTorch lets the CUDA allocator be changed only before the first CUDA
allocation and never back, so `install_cuda_allocator()` swaps it once for the whole
process (outside a plan it is plain cudaMalloc/cudaFree, without caching), and
`CudaPlannedAllocator(plan)` turns the plan on for a `with` block. Imported only by
callers that have CUDA: nothing here is compiled or loaded on a CPU-only machine.
"""

from __future__ import annotations

import ctypes
from functools import cache
from types import TracebackType
from typing import Any

import numpy as np

from memplan.errors import UserError
from memplan.layout.plan import PROLOGUE, AddressPlan
from memplan.runtime.allocator import FALLBACK_REASONS
from memplan.runtime.build import cuda_extension

# memplan_cuda_stats's values, in its order (csrc/planned_allocator_cuda.cpp); the names
# are those of the CPU allocator's `pa.stats`.
STAT_NAMES = (
    "served", "fallbacks", "arena_bytes", "arena_held", "arena_live_bytes", "conflicts", "size_mismatches",
    "requests", "served_planned", "served_dynamic", "beyond_plan", "unplanned", "long_lived", "demoted",
    "fallback_bytes",
)  # fmt: skip
TOO_LATE = (
    "memplan's CUDA allocator must be set before the first CUDA allocation and CUDA is already in use "
    "in this process: call memplan.runtime.cuda.install_cuda_allocator() before any tensor goes to the GPU"
)
_installed: list[bool] = []  # [True] once this process's CUDA allocator is memplan's


@cache
def _library() -> ctypes.CDLL:
    return ctypes.CDLL(cuda_extension())


def install_cuda_allocator() -> None:
    """Make memplan's allocator PyTorch's CUDA allocator, once per process.

    `torch.cuda.memory.change_current_allocator` refuses once PyTorch's own CUDA
    allocator is initialised (at CUDA's lazy initialisation: the first CUDA tensor), so
    this must run first; later it raises a one-line UserError. A second call is a no-op.
    """
    import torch

    if _installed:
        return
    if torch.cuda.is_initialized():
        raise UserError(TOO_LATE)
    allocator = torch.cuda.memory.CUDAPluggableAllocator(cuda_extension(), "memplan_cuda_malloc", "memplan_cuda_free")
    try:
        torch.cuda.memory.change_current_allocator(allocator)
    except RuntimeError:
        raise UserError(TOO_LATE) from None
    _installed.append(True)


def _int64s(values: Any) -> Any:
    array = np.ascontiguousarray(values, dtype=np.int64)
    return array, array.ctypes.data_as(ctypes.POINTER(ctypes.c_int64))


class CudaPlannedAllocator:
    """`with CudaPlannedAllocator(plan) as pa:` serves CUDA allocations from the plan."""

    def __init__(self, plan: AddressPlan, *, first_iteration: int | None = None) -> None:
        self.plan = plan
        self.first_iteration = (PROLOGUE if PROLOGUE in plan.groups else 0) if first_iteration is None else first_iteration

    def __enter__(self) -> CudaPlannedAllocator:
        install_cuda_allocator()  # a no-op once installed; a one-line UserError when too late
        p = self.plan
        keep = [
            _int64s([g.iteration for g in p.iterations]),
            _int64s([g.num_requests for g in p.iterations]),
            _int64s(np.concatenate([g.nbytes for g in p.iterations] or [np.zeros(0)])),
            _int64s(np.concatenate([g.offset for g in p.iterations] or [np.zeros(0)])),
            _int64s([w.iteration for w in p.dynamic_space]),
            _int64s([w.begin_request for w in p.dynamic_space]),
            _int64s([w.end_request for w in p.dynamic_space]),
            _int64s([len(w.ranges) for w in p.dynamic_space]),
            _int64s([x for w in p.dynamic_space for r in w.ranges for x in r]),
        ]
        ptr = [k[1] for k in keep]
        code = _library().memplan_cuda_begin(
            ctypes.c_int64(len(p.iterations)), ptr[0], ptr[1], ptr[2], ptr[3],
            ctypes.c_int64(len(p.dynamic_space)), ptr[4], ptr[5], ptr[6], ptr[7], ptr[8],
            ctypes.c_int64(p.arena_bytes), ctypes.c_int64(p.alignment_bytes), ctypes.c_int64(self.first_iteration),
        )  # fmt: skip
        if code == 1:
            raise UserError("another CUDA plan (or its arena) is still active")
        if code == 2:
            raise UserError(f"cannot allocate the {p.arena_bytes}-byte arena on the GPU")
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        _library().memplan_cuda_end()
        return None

    def next_iteration(self) -> None:
        _library().memplan_cuda_next_iteration()

    @property
    def stats(self) -> dict[str, Any]:
        """The CPU allocator's `pa.stats` keys that the CUDA glue counts, and `fallback_reasons`."""
        out = (ctypes.c_int64 * len(STAT_NAMES))()
        _library().memplan_cuda_stats(out)
        stats: dict[str, Any] = dict(zip(STAT_NAMES, (int(v) for v in out), strict=True))
        reasons = (ctypes.c_int64 * len(FALLBACK_REASONS))()
        _library().memplan_cuda_fallback_reasons(reasons)
        stats["fallback_reasons"] = dict(zip(FALLBACK_REASONS, (int(v) for v in reasons), strict=True))
        return stats
