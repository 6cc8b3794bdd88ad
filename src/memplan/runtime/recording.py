"""Allocator-level recordings of a training step, and the periodic plan made from one.

STAlloc (arXiv 2507.16274; public code infinigence/STAlloc) makes its plan from the
allocation requests its runtime allocator itself sees, not from a framework-level
trace: that sequence, kernel scratch included, is exactly what the planned run will
ask for again. `record_step` installs the C++ allocator in recording mode for a few
iterations of the step and turns the log into a `Trace` (one buffer per request,
`iteration` set from the step boundaries, `meta["iteration_first_event"]`).

`plan_steady_state` plans the last recorded iteration as the period of all later
ones (STAlloc replays iteration 1's plan for every later iteration):
- a request freed within the iteration lives `[alloc, free)` on the iteration's own
  event axis;
- a request still live at the end that the previous iteration's same-index,
  same-size request shows to be freed early in the next iteration (before its own
  next instance is made) wraps around: it lives `[alloc, period) ∪ [0, free')`, so
  the next iteration's requests are planned around it; one freed later than that
  (`self.last_loss = loss`: two instances live at once) is long-lived;
- a request never freed (state created once, a loss or metric the loop keeps) is
  marked long-lived (offset `LONG_LIVED`): the runtime serves it from the fallback
  allocator, as STAlloc hands never-freed tensors to its fallback allocator, and never
  from the dynamic space, whose ranges are free only during their window;
- requests made inside an intra-op parallel region (`at::in_parallel_region()`:
  per-thread scratch of a kernel) interleave differently from run to run, so each
  lives, in the plan, over the whole run of consecutive parallel-region events it
  belongs to: they get distinct offsets whatever the order of their allocs and frees
  (a deviation from STAlloc, whose CUDA kernels allocate from one host thread);
- offsets come from greedy-by-size best fit (`memplan.layout.greedy_by_size`, which
  takes multi-piece lifetimes) and pass `memplan.layout.check_offsets`, which shares
  no code with it, before the plan is returned.
Dynamic reusable space: the iteration's requests are cut into windows of
`window_requests`; each window gets the arena ranges no planned buffer touches
during it, where the runtime places requests that do not match the plan.
Assumes every recorded iteration runs the same code (a training loop's steady state).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from memplan.layout.greedy import greedy_by_size
from memplan.layout.plan import (
    LONG_LIVED,
    AddressPlan,
    DynamicWindow,
    IterationPlan,
    requests_by_group,
    trace_fingerprint,
)
from memplan.layout.validate import check_offsets
from memplan.runtime.build import cpu_extension
from memplan.trace.model import ALLOC, Trace, from_events

CPU_ALIGNMENT_BYTES = 64  # c10's gAlignment: what the default CPU allocator returns


def record_step(step_fn: Callable[[], object], iterations: int) -> Trace:
    """Run `step_fn` `iterations` times under the recording allocator; the requests it saw.

    What `step_fn` returns is held until the recording ends, so its tensors are never
    freed in the recording and are planned as long-lived: a training loop keeps what
    its step returns (`loss = step()` holds it into the next iteration,
    `losses.append(step())` for good), which the recording cannot see otherwise.
    """
    recording = AllocatorRecording()
    returned = []
    recording.start()
    try:
        for _ in range(iterations):
            returned.append(step_fn())
            recording.next_iteration()
    finally:
        trace = recording.stop()
    del returned  # freed after the recorder is uninstalled: not in the log
    return trace


class AllocatorRecording:
    """The recording allocator installed around a loop the caller drives: `start()`,
    `next_iteration()` at each iteration's end, `stop()` -> the Trace (`record_step`'s;
    `memplan.watch` records a live job's iterations with it). Frees after `stop()` are not
    logged: what is still live then is never freed in the trace."""

    def __init__(self) -> None:
        self._session = cpu_extension().new_recorder()

    def start(self) -> None:
        self._session.install()

    def next_iteration(self) -> None:
        self._session.next_iteration()

    def stop(self) -> Trace:
        self._session.uninstall()
        kinds, buffers, nbytes, iteration, parallel = (np.asarray(c) for c in self._session.events())
        return trace_from_recording(kinds, buffers, nbytes, iteration, parallel)


def trace_from_recording(
    kinds: np.ndarray,
    buffers: np.ndarray,
    nbytes: np.ndarray,
    iteration: np.ndarray,
    parallel: np.ndarray | None = None,
) -> Trace:
    """A Trace of recorded (kind, buffer, nbytes, iteration) events, buffers numbered 0..

    `parallel[e]` marks events inside an intra-op parallel region; their indices go to
    `meta["parallel_events"]`.
    """
    kinds = np.asarray(kinds, np.int8)
    buffers = np.asarray(buffers, np.int64)
    iteration = np.asarray(iteration, np.int64)
    n = int(buffers.max()) + 1 if buffers.size else 0
    alloc = kinds == ALLOC
    nbytes_per_buffer = np.zeros(n, np.int64)
    nbytes_per_buffer[buffers[alloc]] = np.asarray(nbytes, np.int64)[alloc]
    iterations = int(iteration.max()) + 1 if iteration.size else 0
    first_event = np.searchsorted(iteration, np.arange(iterations + 1)).tolist()
    trace = from_events(
        kinds,
        nbytes_per_buffer,
        buffers,
        meta={
            "source": "memplan.runtime recording",
            "iteration_first_event": first_event,
            "parallel_events": [] if parallel is None else np.flatnonzero(parallel).tolist(),
        },
    )
    trace.buffers["iteration"][buffers[alloc]] = iteration[alloc].astype(np.int32)
    return trace


def plan_steady_state(
    trace: Trace, *, alignment_bytes: int = CPU_ALIGNMENT_BYTES, window_requests: int = 64
) -> AddressPlan:
    """A periodic plan whose only group is the last recorded iteration (see module doc)."""
    start = time.perf_counter()
    by_group = requests_by_group(trace)
    last = max((g for g in by_group if g >= 0), default=None)
    if last is None:
        return AddressPlan(trace_fingerprint(trace, []), 0, alignment_bytes, [], stats={"method": "steady-state greedy"})
    first_event = trace.meta.get("iteration_first_event")
    requests = by_group[last]
    t0 = int(first_event[last]) if first_event else int(trace.buffers["alloc_event"][requests[0]])
    period = trace.num_events - t0
    alloc = trace.buffers["alloc_event"][requests] - t0
    free = trace.buffers["free_event"][requests]
    nbytes = trace.buffers["nbytes"][requests]
    wrap_free = _wrap_free_events(trace, by_group.get(last - 1), requests, t0)
    alloc, free = _widen_parallel(trace, alloc, free, t0)
    # Freed only after its own next instance is made (`self.last_loss = loss`): two
    # instances live at once, which one periodic offset cannot hold: long-lived.
    wrap_free[(free < 0) & (wrap_free > alloc)] = -1

    piece_lower, piece_upper, piece_buffer = [], [], []
    planned = np.zeros(requests.shape[0], bool)
    for i in range(requests.shape[0]):
        if free[i] >= 0:
            piece_lower.append(alloc[i]), piece_upper.append(free[i] - t0), piece_buffer.append(i)
        elif wrap_free[i] >= 0:
            piece_lower.append(alloc[i]), piece_upper.append(period), piece_buffer.append(i)
            if wrap_free[i] > 0:
                piece_lower.append(0), piece_upper.append(wrap_free[i]), piece_buffer.append(i)
        else:
            continue  # never freed: the fallback serves it
        planned[i] = True
    lower = np.asarray(piece_lower, np.int64)
    upper = np.asarray(piece_upper, np.int64)
    owner = np.asarray(piece_buffer, np.int64)
    index = np.flatnonzero(planned)
    remap = np.full(requests.shape[0], -1, np.int64)
    remap[index] = np.arange(index.shape[0])
    placed = greedy_by_size(lower, upper, remap[owner], nbytes[index], alignment_bytes)
    offsets = np.full(requests.shape[0], LONG_LIVED, np.int64)  # the never-freed ones keep it
    offsets[index] = placed
    arena_bytes = check_offsets(lower, upper, nbytes[owner], offsets[owner], alignment=alignment_bytes)
    windows = _dynamic_windows(last, alloc, lower, upper, nbytes[owner], offsets[owner], arena_bytes, window_requests)
    return AddressPlan(
        trace_fingerprint=trace_fingerprint(trace, [last]),
        arena_bytes=int(arena_bytes),
        alignment_bytes=alignment_bytes,
        iterations=[IterationPlan(last, nbytes.astype(np.int64), offsets)],
        lower_bound_bytes=_live_peak(lower, upper, nbytes[owner]),
        dynamic_space=windows,
        stats={
            "method": "steady-state greedy",
            "requests": int(requests.shape[0]),
            "planned": int(index.shape[0]),
            "wrapping": int(np.count_nonzero((free < 0) & (wrap_free >= 0))),
            "long_lived": int(requests.shape[0] - index.shape[0]),
            "plan_s": round(time.perf_counter() - start, 4),
        },
    )


def _widen_parallel(trace: Trace, alloc: np.ndarray, free: np.ndarray, t0: int) -> tuple[np.ndarray, np.ndarray]:
    """Stretch the requests allocated or freed in a run of consecutive parallel-region
    events over the whole run. `alloc` is local to the iteration, `free` absolute (-1: live)."""
    events = np.asarray(trace.meta.get("parallel_events", []), np.int64)
    events = events[events >= t0] - t0
    if events.shape[0] == 0:
        return alloc, free
    is_start = np.concatenate([[True], np.diff(events) > 1])
    starts = np.flatnonzero(is_start)
    run_start = events[starts]
    run_end = np.append(events[starts[1:] - 1], events[-1]) + 1  # half-open
    run_of = np.full(trace.num_events - t0, -1, np.int64)
    run_of[events] = np.cumsum(is_start) - 1
    alloc, free = alloc.copy(), free.copy()
    run = run_of[alloc]
    hit = run >= 0
    alloc[hit] = run_start[run[hit]]
    run = np.full(free.shape[0], -1, np.int64)
    run[free >= 0] = run_of[free[free >= 0] - t0]
    freed_in_run = run >= 0
    free[freed_in_run] = np.maximum(free[freed_in_run], run_end[run[freed_in_run]] + t0)
    alloc[freed_in_run] = np.minimum(alloc[freed_in_run], run_start[run[freed_in_run]])
    return alloc, free


def _wrap_free_events(trace: Trace, previous: np.ndarray | None, requests: np.ndarray, t0: int) -> np.ndarray:
    """Per request of the last iteration: the local event at which its counterpart of the
    previous iteration was freed inside the last one (-1: no such counterpart)."""
    out = np.full(requests.shape[0], -1, np.int64)
    if previous is None or previous.shape[0] != requests.shape[0]:
        return out
    nbytes = trace.buffers["nbytes"]
    if not np.array_equal(nbytes[previous], nbytes[requests]):
        return out
    free = trace.buffers["free_event"][previous]
    wraps = free >= t0
    out[wraps] = free[wraps] - t0
    return out


def _live_peak(lower: np.ndarray, upper: np.ndarray, nbytes: np.ndarray) -> int:
    if lower.shape[0] == 0:
        return 0
    t = np.concatenate([lower, upper])
    d = np.concatenate([nbytes, -nbytes])
    order = np.lexsort((d, t))
    return int(max(0, np.cumsum(d[order]).max()))


def _dynamic_windows(
    iteration: int,
    alloc: np.ndarray,
    lower: np.ndarray,
    upper: np.ndarray,
    nbytes: np.ndarray,
    offsets: np.ndarray,
    arena_bytes: int,
    window_requests: int,
) -> list[DynamicWindow]:
    """Windows of `window_requests` requests, each with the arena ranges free during it."""
    windows = []
    n = alloc.shape[0]
    for begin in range(0, n, window_requests):
        end = min(n, begin + window_requests)
        # The window spans from its first request to just before the next window's first.
        t_lo = int(alloc[begin])
        t_hi = int(alloc[end]) if end < n else int(upper.max(initial=t_lo + 1))
        t_hi = max(t_hi, t_lo + 1)
        busy = (lower < t_hi) & (upper > t_lo)
        ranges = _free_ranges(offsets[busy], offsets[busy] + nbytes[busy], arena_bytes)
        if ranges:
            windows.append(DynamicWindow(iteration, begin, end, ranges))
    return windows


def _free_ranges(lo: np.ndarray, hi: np.ndarray, arena_bytes: int) -> list[tuple[int, int]]:
    ranges = []
    cursor = 0
    for a, b in sorted(zip(lo.tolist(), hi.tolist(), strict=True)):
        if a > cursor:
            ranges.append((cursor, a))
        cursor = max(cursor, b)
    if cursor < arena_bytes:
        ranges.append((cursor, arena_bytes))
    return ranges
