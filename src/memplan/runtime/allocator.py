"""`memplan.planned_allocator`: run a real training step's CPU allocations from a plan.

STWeaver/STAlloc's runtime (arXiv 2507.16274; public code infinigence/STAlloc): the
n-th allocation request of an iteration is matched to the n-th entry of the plan
(size checked) and served at the planned offset inside one arena; a request that does
not match is placed best-fit into the plan's dynamic reusable space, else it goes to
the default allocator and is counted. The matching lives in C++ (`csrc/`), installed
as PyTorch's CPU allocator for the duration of the `with` block:

    with memplan.planned_allocator(plan) as pa:
        for batch in batches:
            train_step(batch)
            pa.next_iteration()

or, planning in one call from the step itself (record, plan, return the manager):

    pa = memplan.planned_allocator.from_step(train_step, warmup=2)
    with pa: ...

Assumptions: one planned allocator is installed at a time; iteration boundaries are
marked by the caller; the plan's offsets are aligned to at least 64 bytes (what the
default CPU allocator guarantees, and what vectorized kernels may rely on). Tensors
allocated before the block keep their own deleter; arena tensors that outlive the
block keep the arena alive until the last of them is freed. On CUDA the same core sits
behind `torch.cuda.memory.CUDAPluggableAllocator` (`memplan.runtime.cuda`).
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType
from typing import Any

import numpy as np

from memplan.errors import UserError
from memplan.layout.plan import PROLOGUE, AddressPlan
from memplan.runtime.build import cpu_extension
from memplan.runtime.recording import CPU_ALIGNMENT_BYTES, plan_steady_state, record_step
from memplan.trace.model import Trace

# Why a request went to the default allocator (`pa.stats["fallback_reasons"]`), in the
# order of kFallbackReasonNames in csrc/planned_core.h:
FALLBACK_REASONS = (
    "unplanned_size",  # the n-th request's size differs from the plan's, no dynamic room
    "outlived_iteration",  # the plan marks it long-lived: the recording never saw it freed
    "beyond_plan",  # more requests in the iteration than the plan has, no dynamic room
    "conflict",  # its planned bytes were still held by a tensor kept longer than planned
    "dynamic_no_room",  # a dynamic plan entry the dynamic space had no room for
    "no_plan",  # an iteration the plan has no entries for
)


class PlannedAllocator:
    """A context manager that serves CPU allocations from `plan` (see the module doc).

    `first_iteration`: the plan iteration the block starts in; by default the prologue
    (-1) when the plan has one, else 0. `pa.stats` is a dict: `requests`, `served`,
    `fallbacks`, `arena_bytes`, `peak_bytes` (arena held plus fallback bytes live, at
    most), `fallback_reasons` (fallbacks per reason, summing to `fallbacks`: see
    `FALLBACK_REASONS`), and the detail (`served_planned`, `served_dynamic`,
    `size_mismatches`, `conflicts`, `beyond_plan`, `unplanned`, `long_lived`,
    `peak_live_bytes`, `iterations`: counts per iteration, `conflict_log`: the first
    conflicts with the request that still held the bytes).
    """

    def __init__(self, plan: AddressPlan, *, first_iteration: int | None = None, trace: Trace | None = None) -> None:
        if not isinstance(plan, AddressPlan):
            raise UserError(
                f"planned_allocator takes a memplan AddressPlan (memplan.layout.load_address_plan), "
                f"not {type(plan).__name__}"
            )
        _check_cpu_alignment(plan)
        self.plan = plan
        self.trace = trace  # the recording the plan was made from (from_step), else None
        if first_iteration is None:
            first_iteration = PROLOGUE if PROLOGUE in plan.groups else 0
        self.first_iteration = int(first_iteration)
        self._session: Any = None
        self._last_stats: dict[str, Any] = {}

    @classmethod
    def from_step(
        cls,
        step_fn: Callable[[], object],
        warmup: int = 2,
        *,
        planner: Callable[[Trace], AddressPlan] | None = None,
    ) -> PlannedAllocator:
        """Run `step_fn` `warmup` times while recording its allocator requests, plan the
        last recorded iteration as the period of all later ones, and return the manager.

        The recorded runs are real training steps (they update the model). `planner`
        (trace -> AddressPlan) replaces the default `plan_steady_state`; its plan's last group
        must be the steady-state iteration.
        """
        if not isinstance(warmup, int) or warmup < 1:
            raise UserError(f"warmup must be a whole number >= 1, not {warmup!r}")
        trace = record_step(step_fn, warmup)
        plan = (planner or plan_steady_state)(trace)
        return cls(plan, first_iteration=plan.periodic_iteration + 1, trace=trace)

    # -- the context -------------------------------------------------------------------
    def __enter__(self) -> PlannedAllocator:
        if self._session is not None and self._session.stats()["installed"]:
            raise UserError("this planned allocator is already in use; a `with` block cannot be nested in itself")
        ext = cpu_extension()
        groups = self.plan.iterations
        windows = [(w.iteration, w.begin_request, w.end_request, list(w.ranges)) for w in self.plan.dynamic_space]
        session = ext.new_planned(
            [g.iteration for g in groups],
            [np.asarray(g.nbytes, np.int64).tolist() for g in groups],
            [np.asarray(g.offset, np.int64).tolist() for g in groups],
            windows,
            int(self.plan.arena_bytes),
            int(self.plan.alignment_bytes),
            self.first_iteration,
        )
        try:
            session.install()
        except RuntimeError as exc:
            raise UserError(f"cannot install the planned allocator: {_first_line(exc)}") from None
        self._session = session
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._session is not None:
            self._session.uninstall()
        return None

    def next_iteration(self) -> None:
        """Mark the end of an iteration: the next request is request 0 of the next one."""
        if self._session is None:
            raise UserError("next_iteration() is called inside `with memplan.planned_allocator(plan) as pa:`")
        self._session.next_iteration()

    @property
    def stats(self) -> dict[str, Any]:
        if self._session is None:
            return {
                "requests": 0, "served": 0, "fallbacks": 0, "arena_bytes": int(self.plan.arena_bytes),
                "peak_bytes": 0, "fallback_reasons": dict.fromkeys(FALLBACK_REASONS, 0),
            }  # fmt: skip
        return dict(self._session.stats())

    @property
    def arena_released(self) -> bool:
        """True once the arena's memory is given back (after exit and the last arena free)."""
        return self._session is None or not self._session.stats()["arena_held"]

    def owns(self, tensor: Any) -> bool:
        """Whether `tensor`'s storage lies in this allocator's arena (held now)."""
        if self._session is None or self.arena_released:
            return False
        base = int(self._session.arena_address)
        ptr = int(tensor.untyped_storage().data_ptr())
        return base <= ptr < base + int(self.plan.arena_bytes)


def _check_cpu_alignment(plan: AddressPlan) -> None:
    offsets = [g.offset[g.offset >= 0] for g in plan.iterations]
    misaligned = any(bool(np.any(o % CPU_ALIGNMENT_BYTES)) for o in offsets)
    if misaligned or plan.alignment_bytes % CPU_ALIGNMENT_BYTES:
        raise UserError(
            f"this plan aligns offsets to {plan.alignment_bytes} bytes; the CPU planned allocator needs "
            f"multiples of {CPU_ALIGNMENT_BYTES} (plan with alignment_bytes={CPU_ALIGNMENT_BYTES} or more)"
        )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


planned_allocator = PlannedAllocator
