"""Lifetime analysis for offloading: when each buffer is active, when it is idle, in ops and seconds.

Follows TERAIO's profiler (arXiv 2506.06472, §3.2): every operator marks the
buffers it reads and writes *active*; kernel times turn op indices into seconds; an
*inactive interval* is the time between two active ones. Buffers that outlive the
step (parameters, optimizer states) are periodic: their last use in one iteration
and their first use in the next bound an interval that wraps around the step end.

Op times come from a roofline of a GPU profile, as PyTorch's `RuntimeEstimator` in
roofline mode does (an op takes max(FLOPs / peak FLOP/s, bytes moved / HBM
bandwidth)), with the autocast dtype of the trace's setup honoured (`memplan.hardware.roofline`),
or from op times measured on real tensors (`measured_op_durations_s`).

Assumptions: the trace holds one training iteration (the steady state repeats it);
device memory during an op is its event-level peak (live bytes before the op and
after each of its events).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from memplan.errors import UserError
from memplan.trace.model import ALLOC, Trace


def measured_op_durations_s(trace: Trace, durations_s: np.ndarray | list[float] | None = None) -> np.ndarray:
    """Measured op durations, checked against the trace's op count. With no
    `durations_s`, the ones the recorder measured around each op when `trace` was captured
    on real tensors (`meta["op_wall_s"]`: each kernel's wall time, autograd's bookkeeping
    excluded)."""
    if durations_s is None:
        durations_s = trace.meta.get("op_wall_s")
        if durations_s is None:
            raise UserError("this trace has no measured op times: capture the step on real tensors "
                            "(capture_model(..., fake=False)) to measure them, or give durations_s")
    out = np.asarray(durations_s, dtype=np.float64)
    if out.shape != (trace.num_ops,):
        raise UserError(f"{out.shape[0] if out.ndim else 0} measured op times for a trace of {trace.num_ops} ops")
    if (out < 0).any() or not np.isfinite(out).all():
        raise UserError("measured op times must be finite and >= 0")
    return out


def op_of_events(trace: Trace, events: np.ndarray) -> np.ndarray:
    """The op during which each event happened (events before the first op map to -1)."""
    return np.searchsorted(trace.ops["first_event"], events, side="right") - 1


def op_peak_bytes(trace: Trace) -> np.ndarray:
    """Device bytes during each op: the most live at any point of it (before or after its events)."""
    n = trace.num_ops
    kind = trace.events["kind"]
    nbytes = trace.buffers["nbytes"][trace.events["buffer"]]
    live = np.cumsum(np.where(kind == ALLOC, nbytes, -nbytes), dtype=np.int64)
    first = trace.ops["first_event"].astype(np.int64)
    live_before = np.where(first > 0, live[np.maximum(first - 1, 0)], 0)
    peak = live_before.copy()
    has_events = np.diff(np.append(first, trace.num_events)) > 0
    if has_events.any():
        starts = first[has_events]
        peak[has_events] = np.maximum(peak[has_events], np.maximum.reduceat(live, starts)[: starts.size])
    return peak[:n]


@dataclass(frozen=True)
class Lifetimes:
    """Active and inactive intervals of every buffer of one trace, in ops and seconds.

    Inactive intervals are columns of equal length: `inactive_buffer[k]` is idle
    strictly between ops `inactive_after_op[k]` and `inactive_before_op[k]`. An index
    >= num_ops is in the next iteration (the interval wraps). `inactive_returns[k]` is
    False when the buffer is freed without another use (it may leave and never come
    back): at op `inactive_before_op[k]`, or, when its free ends the op it falls in
    (nothing is allocated after it there), at op `inactive_before_op[k] - 1`, which is
    then idle too.
    """

    num_ops: int
    op_durations_s: np.ndarray
    op_start_s: np.ndarray  # length num_ops + 1; the last entry is the step time
    op_bytes: np.ndarray  # device bytes during each op, nothing offloaded
    live_first_op: np.ndarray  # per buffer; -1: live before the first op
    live_last_op: np.ndarray  # per buffer; num_ops: live after the last op
    use_ptr: np.ndarray  # CSR: use_ops[use_ptr[b]:use_ptr[b+1]] are the ops using b, ascending
    use_ops: np.ndarray
    inactive_buffer: np.ndarray
    inactive_after_op: np.ndarray
    inactive_before_op: np.ndarray
    inactive_returns: np.ndarray

    @property
    def step_s(self) -> float:
        return float(self.op_start_s[-1])

    def time_of_op(self, op: int | np.ndarray) -> np.ndarray:
        """Start time of a (possibly next-iteration) op index, in seconds."""
        op = np.asarray(op)
        return (op // self.num_ops) * self.step_s + self.op_start_s[op % self.num_ops]

    def active_intervals(self, buffer: int) -> list[tuple[int, int]]:
        """Runs of consecutive ops using `buffer`, as inclusive (first_op, last_op)."""
        ops = self.use_ops[self.use_ptr[buffer] : self.use_ptr[buffer + 1]]
        if ops.size == 0:
            return []
        breaks = np.flatnonzero(np.diff(ops) > 1)
        firsts = np.concatenate([ops[:1], ops[breaks + 1]])
        lasts = np.concatenate([ops[breaks], ops[-1:]])
        return list(zip(firsts.tolist(), lasts.tolist()))

    def active_intervals_s(self, buffer: int) -> list[tuple[float, float]]:
        return [
            (float(self.op_start_s[a]), float(self.op_start_s[b + 1])) for a, b in self.active_intervals(buffer)
        ]

    def inactive_intervals(self, buffer: int) -> list[tuple[int, int]]:
        """(after_op, before_op) pairs of `buffer`: idle strictly between the two."""
        mask = self.inactive_buffer == buffer
        return list(zip(self.inactive_after_op[mask].tolist(), self.inactive_before_op[mask].tolist()))

    def inactive_intervals_s(self, buffer: int) -> list[tuple[float, float]]:
        """The same intervals in seconds: from the end of after_op to the start of before_op."""
        return [
            (float(self.time_of_op(a + 1)), float(self.time_of_op(b))) for a, b in self.inactive_intervals(buffer)
        ]


def _trailing_frees(trace: Trace, free_op: np.ndarray) -> np.ndarray:
    """Per buffer: freed within the trace, and no allocation follows its free in the op it falls in."""
    kind = trace.events["kind"]
    free_event = trace.buffers["free_event"].astype(np.int64)
    # index of the last ALLOC event at or before each event (-1: none)
    last_alloc = np.maximum.accumulate(np.where(kind == ALLOC, np.arange(kind.size), -1))
    n = trace.num_ops
    op_end = np.append(trace.ops["first_event"].astype(np.int64)[1:], trace.num_events)  # one past each op's last event
    freed = (free_event >= 0) & (free_op >= 0) & (free_op < n)
    end = op_end[np.clip(free_op, 0, n - 1)] - 1  # the op's last event
    trailing = np.zeros(free_event.shape, bool)
    idx = np.flatnonzero(freed)
    trailing[idx] = last_alloc[end[idx]] < free_event[idx]
    return trailing


def analyse_lifetimes(trace: Trace, op_durations_s: np.ndarray) -> Lifetimes:
    """Lifetimes of every buffer of `trace`, with op `op_durations_s` (roofline or measured)."""
    n = trace.num_ops
    durations = np.asarray(op_durations_s, dtype=np.float64)
    if durations.shape != (n,):
        raise UserError(f"{durations.size} op durations for a trace of {n} ops")
    if n == 0:
        raise UserError("the trace has no ops: offloading needs the ops that use each buffer")
    start = np.concatenate([[0.0], np.cumsum(durations)])

    nb = trace.num_buffers
    live_first = op_of_events(trace, trace.buffers["alloc_event"])
    free_event = trace.buffers["free_event"]
    live_last = np.where(free_event < 0, n, op_of_events(trace, np.maximum(free_event, 0)))

    # CSR of uses per buffer, from the op-major input/output CSR.
    ins, outs = trace.csr["op_inputs"], trace.csr["op_outputs"]
    in_op = np.repeat(np.arange(n), np.diff(trace.csr["op_inputs_ptr"]))
    out_op = np.repeat(np.arange(n), np.diff(trace.csr["op_outputs_ptr"]))
    pairs = np.unique(np.stack([np.concatenate([ins, outs]), np.concatenate([in_op, out_op])], axis=1), axis=0)
    use_buffer, use_ops = pairs[:, 0], pairs[:, 1]
    use_ptr = np.concatenate([[0], np.cumsum(np.bincount(use_buffer, minlength=nb))]).astype(np.int64)

    # Gaps between consecutive uses of the same buffer.
    same = use_buffer[1:] == use_buffer[:-1]
    gap = same & (use_ops[1:] - use_ops[:-1] > 1)
    buf = [use_buffer[1:][gap]]
    after = [use_ops[:-1][gap]]
    before = [use_ops[1:][gap]]
    returns = [np.ones(int(gap.sum()), bool)]

    has_use = np.diff(use_ptr) > 0
    first_use = np.where(has_use, use_ops[np.minimum(use_ptr[:-1], max(use_ops.size - 1, 0))], -1)
    last_use = np.where(has_use, use_ops[np.maximum(use_ptr[1:] - 1, 0)], -1)
    # Persistent buffers (live before the first op and after the last): wrap to the next iteration.
    persistent = has_use & (live_first < 0) & (live_last >= n)
    wrap = persistent & (first_use + n - last_use > 1)
    buf.append(np.flatnonzero(wrap))
    after.append(last_use[wrap])
    before.append(first_use[wrap] + n)
    returns.append(np.ones(int(wrap.sum()), bool))
    # Freed some ops after the last use: the tail can leave and never come back. A free that
    # ends its op (nothing is allocated after it there, e.g. gradients dropped after the last
    # optimizer kernel) leaves that op idle too: away through it, the op's peak is exactly
    # nbytes lower, since the buffer is counted at every point of the op before its free and
    # the points after it only free more.
    trailing = _trailing_frees(trace, live_last)
    end = np.where(trailing, live_last + 1, live_last)
    tail = has_use & (live_last < n) & (end - last_use > 1)
    buf.append(np.flatnonzero(tail))
    after.append(last_use[tail])
    before.append(end[tail])
    returns.append(np.zeros(int(tail.sum()), bool))

    return Lifetimes(
        num_ops=n,
        op_durations_s=durations,
        op_start_s=start,
        op_bytes=op_peak_bytes(trace),
        live_first_op=live_first.astype(np.int64),
        live_last_op=live_last.astype(np.int64),
        use_ptr=use_ptr,
        use_ops=use_ops.astype(np.int64),
        inactive_buffer=np.concatenate(buf).astype(np.int64),
        inactive_after_op=np.concatenate(after).astype(np.int64),
        inactive_before_op=np.concatenate(before).astype(np.int64),
        inactive_returns=np.concatenate(returns),
    )


def idle_bytes_per_op(trace: Trace, lt: Lifetimes) -> np.ndarray:
    """Bytes idle during each op: the buffers inside one of their inactive intervals there
    (strictly between `inactive_after_op` and `inactive_before_op`, wrapping past the step end)."""
    n = lt.num_ops
    nbytes = trace.buffers["nbytes"][lt.inactive_buffer].astype(np.int64)
    delta = np.zeros(2 * n + 1, np.int64)  # two iterations: an interval wraps at most once
    np.add.at(delta, lt.inactive_after_op + 1, nbytes)
    np.add.at(delta, np.minimum(lt.inactive_before_op, 2 * n), -nbytes)
    idle = np.cumsum(delta[:-1])
    return idle[:n] + idle[n:]


def resident_floor_bytes(trace: Trace) -> int:
    """The least device memory any offload plan of `trace` reaches: at each op, its bytes
    less the ones idle there (the planner moves only idle buffers), at the busiest op."""
    lt = analyse_lifetimes(trace, np.zeros(trace.num_ops))  # which bytes are idle does not depend on time
    return int((lt.op_bytes - idle_bytes_per_op(trace, lt)).max(initial=0))
