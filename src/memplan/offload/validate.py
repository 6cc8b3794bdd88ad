"""Independent validator of offload plans: shares no code with the planner or the lifetime analysis.

It re-derives, straight from the trace's events and op CSR, (1) which ops use each
offloaded buffer and (2) the device bytes during each op, then checks that

- no buffer is used by an op while it is away (strictly between `after_op` and its
  `use_op`, wrapping into the next iteration where the index says so), and that it is
  live over the whole away window;
- a buffer that never comes back is away until the op that frees it, or through it when
  that free ends the op (nothing allocated after it there: the op's peak then drops by
  exactly its bytes);
- the away windows of one buffer never overlap, and every transfer's op indices are ordered
  `after_op < done_op < return_op <= use_op`;
- device memory (bytes during each op, minus the buffers away over it) stays within the
  budget at every op, when the plan says it is feasible.

Follows the minimalloc practice (google/minimalloc): a plan is returned only after a
check written separately from the code that made it. It checks the planner's own plans, so a
broken rule is memplan's mistake (`OffloadPlanBug`, exit 3); a plan file a user gives is checked
by `plan_file.load_offload_plan` (its shape) and the runtime (names and saved storages against
the live step), which raise `UserError`s.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from memplan.errors import MemplanBug
from memplan.trace.model import Trace


class OffloadPlanBug(MemplanBug):
    """An offload plan of memplan's planner that breaks one of the rules above."""


def _uses_of(trace: Trace, buffer: int) -> np.ndarray:
    uses: set[int] = set()
    for ptr_name, data_name in (("op_inputs_ptr", "op_inputs"), ("op_outputs_ptr", "op_outputs")):
        positions = np.flatnonzero(trace.csr[data_name] == buffer)
        ptr = trace.csr[ptr_name]
        for pos in positions.tolist():
            uses.add(int(np.searchsorted(ptr, pos, side="right") - 1))
    return np.asarray(sorted(uses), dtype=np.int64)


def _op_bytes(trace: Trace) -> np.ndarray:
    """Most bytes live at any point of each op, by walking the events once."""
    n = trace.num_ops
    first = trace.ops["first_event"].tolist() + [trace.num_events]
    out = np.zeros(n, dtype=np.int64)
    nbytes = trace.buffers["nbytes"]
    kinds = trace.events["kind"].tolist()
    bufs = trace.events["buffer"].tolist()
    live = 0
    e = 0
    while e < first[0]:
        live += int(nbytes[bufs[e]]) if kinds[e] == 0 else -int(nbytes[bufs[e]])
        e += 1
    for i in range(n):
        best = live
        while e < first[i + 1]:
            live += int(nbytes[bufs[e]]) if kinds[e] == 0 else -int(nbytes[bufs[e]])
            best = max(best, live)
            e += 1
        out[i] = best
    return out


def _op_of_event(trace: Trace, event: int) -> int:
    first = trace.ops["first_event"]
    return int(np.searchsorted(first, event, side="right") - 1)


def _free_ends_op(trace: Trace, free_event: int, op: int) -> bool:
    """No allocation follows event `free_event` within op `op`."""
    first = trace.ops["first_event"]
    stop = int(first[op + 1]) if op + 1 < trace.num_ops else trace.num_events
    return not bool((trace.events["kind"][free_event + 1 : stop] == 0).any())


def validate_plan(trace: Trace, plan: Any) -> None:
    """Raise `OffloadPlanBug` naming the first broken rule of `plan` on `trace`."""
    n = trace.num_ops
    if plan.num_ops != n:
        raise OffloadPlanBug(f"plan is for {plan.num_ops} ops, the trace has {n}")
    saved = np.zeros(n, dtype=np.int64)
    windows: dict[int, list[tuple[int, int]]] = {}
    uses_cache: dict[int, np.ndarray] = {}
    for t in plan.transfers:
        b = t.buffer
        if not 0 <= b < trace.num_buffers or int(trace.buffers["nbytes"][b]) != t.nbytes:
            raise OffloadPlanBug(f"transfer of buffer {b}: not a buffer of this trace with {t.nbytes} bytes")
        end = t.use_op if t.use_op is not None else t.return_op
        if not (0 <= t.after_op < n and t.after_op < t.done_op < t.return_op <= end < 2 * n):
            raise OffloadPlanBug(
                f"buffer {b}: op indices out of order (after {t.after_op}, done {t.done_op}, "
                f"return {t.return_op}, use {t.use_op})"
            )
        if b not in uses_cache:
            uses_cache[b] = _uses_of(trace, b)
        uses = uses_cache[b]
        both = np.concatenate([uses, uses + n])
        used = both[(both > t.after_op) & (both < end)]
        if used.size:
            raise OffloadPlanBug(f"buffer {b} is used by op {int(used[0]) % n} while away (after op {t.after_op})")
        if t.use_op is not None and (t.use_op % n) not in set(uses.tolist()):
            raise OffloadPlanBug(f"buffer {b} is brought back for op {t.use_op}, which does not use it")
        # live over the whole window
        alloc_op = _op_of_event(trace, int(trace.buffers["alloc_event"][b]))
        free_event = int(trace.buffers["free_event"][b])
        free_op = n if free_event < 0 else _op_of_event(trace, free_event)
        # the last op the buffer is held for: a buffer that never comes back may stay away
        # through the op that frees it when that free ends the op (no allocation after it there)
        held_to = end
        if t.use_op is None and free_op < n and end == free_op + 1 and _free_ends_op(trace, free_event, free_op):
            held_to = free_op
        if held_to >= n and (alloc_op >= 0 or free_op < n):
            raise OffloadPlanBug(f"buffer {b} does not outlive the step but its window wraps into the next one")
        if held_to < n and not (alloc_op <= t.after_op and held_to <= free_op):
            raise OffloadPlanBug(f"buffer {b} is not live from op {t.after_op} to op {end}")
        if t.use_op is None and held_to != free_op:
            raise OffloadPlanBug(f"buffer {b} never comes back but is not freed at op {end}")
        for x, y in windows.get(b, []):
            for shift in (-n, 0, n):
                if t.after_op < y + shift and x + shift < end:
                    raise OffloadPlanBug(f"buffer {b} has two overlapping away windows")
        windows.setdefault(b, []).append((t.after_op, end))
        saved += np.bincount(np.arange(t.done_op, t.return_op) % n, minlength=n) * t.nbytes
    if plan.feasible:
        device = _op_bytes(trace) - saved
        over = np.flatnonzero(device > plan.budget_bytes)
        if over.size:
            i = int(over[0])
            raise OffloadPlanBug(
                f"device memory at op {i} is {int(device[i])} bytes, over the budget of {plan.budget_bytes}"
            )

