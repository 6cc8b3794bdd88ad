"""The `planned` allocator: replay a trace against a static plan, STAlloc-style.

STAlloc's runtime (arXiv 2507.16274; infinigence/STAlloc) reserves one arena of the
plan's height, matches the n-th allocation request of an iteration to the n-th entry of
that iteration's plan (sizes must be equal) and serves it at the planned offset.
Iterations beyond the last planned one replay the last planned iteration's entries
(the plan is periodic). A request that is not matched (a different size, no entry, a
dynamic entry, or a planned range that is still occupied because the run deviated
from the plan) is placed best-fit (512-byte aligned) in the plan's dynamic reusable
space for that request, intersected with what is free in the arena now; when nothing
fits it goes to a fallback caching allocator (`memplan.alloc.caching`).

Counting, as `torch.cuda` would see this allocator: the arena is reserved from the
start (one cudaMalloc); allocated bytes are the 512-byte-rounded sizes of the arena's
live buffers plus the fallback's blocks; reserved bytes are the arena plus the
fallback's segments. `extra` counts matched, dynamic and fallback requests.
"""

from __future__ import annotations

import bisect
import os
from typing import Any

import numpy as np

from memplan.alloc.caching import CachingAllocator, OutOfMemory
from memplan.alloc.check import check_replay
from memplan.alloc.conf import AllocConf
from memplan.alloc.result import SimResult, fragmentation_of
from memplan.errors import UserError
from memplan.layout.plan import Plan, load_plan, requests_by_group
from memplan.trace.model import ALLOC, Trace

_ROUND = 512


class _Arena:
    """Live address intervals of the arena, sorted by start (they never overlap)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.starts: list[int] = []
        self.ends: list[int] = []

    def is_free(self, lo: int, hi: int) -> bool:
        if lo < 0 or hi > self.nbytes:
            return False
        pos = bisect.bisect_right(self.starts, lo)
        if pos > 0 and self.ends[pos - 1] > lo:
            return False
        return not (pos < len(self.starts) and self.starts[pos] < hi)

    def take(self, lo: int, hi: int) -> None:
        pos = bisect.bisect_right(self.starts, lo)
        self.starts.insert(pos, lo)
        self.ends.insert(pos, hi)

    def release(self, lo: int) -> None:
        pos = bisect.bisect_left(self.starts, lo)
        del self.starts[pos]
        del self.ends[pos]

    def best_fit(self, ranges: list[tuple[int, int]], nbytes: int) -> int | None:
        """Smallest free gap inside `ranges` that holds `nbytes` (lowest among equals)."""
        best: tuple[int, int] | None = None
        for lo, hi in ranges:
            hi = min(hi, self.nbytes)
            pos = max(bisect.bisect_right(self.starts, lo) - 1, 0)
            cursor = lo
            while cursor < hi:
                while pos < len(self.starts) and self.ends[pos] <= cursor:
                    pos += 1
                gap_end = hi if pos >= len(self.starts) else min(hi, self.starts[pos])
                start = -(-cursor // _ROUND) * _ROUND
                if gap_end - start >= nbytes and (best is None or gap_end - start < best[0]):
                    best = (gap_end - start, start)
                if pos >= len(self.starts):
                    break
                cursor = max(cursor, self.ends[pos])
                pos += 1
        return None if best is None else best[1]


def simulate_planned(
    trace: Trace,
    plan: Plan | str | os.PathLike,
    alloc_conf: str | AllocConf | None = None,
    capacity: int | None = None,
) -> SimResult:
    """Replay `trace` through the plan's arena with a caching fallback (see module doc).

    `plan` is a Plan or the path of a plan file. A plan made for another trace is a
    UserError."""
    if isinstance(plan, (str, os.PathLike)):
        plan = load_plan(plan)
    if not isinstance(plan, Plan):
        raise UserError("the planned allocator needs a memplan Plan (from memplan.plan or 'memplan plan')")
    plan.check_belongs_to(trace)
    conf = alloc_conf if isinstance(alloc_conf, AllocConf) else AllocConf.parse(alloc_conf)
    arena_bytes = int(plan.arena_bytes)
    requested = trace.live_bytes()
    if capacity is not None and arena_bytes > capacity:
        return SimResult(
            allocator="planned",
            peak_reserved_bytes=0,
            requested_bytes=requested[:0],
            allocated_bytes=requested[:0],
            reserved_bytes=requested[:0],
            oom={"event": 0, "request_bytes": arena_bytes, "alloc_bytes": arena_bytes,
                 "allocated_bytes": 0, "reserved_bytes": 0, "capacity_bytes": capacity},
            extra={"arena_bytes": arena_bytes},
        )
    fallback = CachingAllocator(conf, None if capacity is None else capacity - arena_bytes)

    # Per buffer: its group and its request index within the group.
    nbytes = trace.buffers["nbytes"].tolist()
    group_of = [0] * trace.num_buffers
    index_of = [0] * trace.num_buffers
    for g, ids in requests_by_group(trace).items():
        for j, buf in enumerate(ids.tolist()):
            group_of[buf] = g
            index_of[buf] = j
    entries: dict[int, Any] = {}
    windows: dict[int, dict[int, list[tuple[int, int]]]] = {}

    def entry_for(g: int) -> Any:
        if g not in entries:
            entries[g] = plan.for_iteration(g)
            it = entries[g]
            spaces: dict[int, list[tuple[int, int]]] = {}
            if it is not None:
                for w in plan.windows_for(g):
                    spaces.setdefault(w.begin_request, []).extend(w.ranges)
            windows[g] = spaces
        return entries[g]

    arena = _Arena(arena_bytes)
    where: dict[int, tuple[str, int, int]] = {}  # buffer -> (place, offset, slot bytes)
    arena_allocated = 0
    counts = {"matched": 0, "dynamic": 0, "fallback": 0}
    allocated_series: list[int] = []
    reserved_series: list[int] = []
    oom = None
    kinds = trace.events["kind"].tolist()
    event_buffers = trace.events["buffer"].tolist()
    streams = trace.buffers["stream"].tolist()
    try:
        for event, (kind, buf) in enumerate(zip(kinds, event_buffers)):
            size = nbytes[buf]
            if size:
                if kind == ALLOC:
                    slot = -(-size // _ROUND) * _ROUND
                    g, j = group_of[buf], index_of[buf]
                    entry = entry_for(g)
                    placed = None
                    if entry is not None and j < entry.num_requests and int(entry.nbytes[j]) == size:
                        offset = int(entry.offset[j])
                        if offset >= 0 and arena.is_free(offset, offset + slot):
                            placed = ("matched", offset)
                    if placed is None:
                        ranges = windows[g].get(j) if entry is not None else None
                        if ranges:
                            offset = arena.best_fit(ranges, slot)
                            if offset is not None:
                                placed = ("dynamic", offset)
                    if placed is None:
                        block = fallback.malloc(buf, size, streams[buf], event)
                        where[buf] = ("fallback", block.addr, block.size)
                        counts["fallback"] += 1
                    else:
                        arena.take(placed[1], placed[1] + slot)
                        where[buf] = (placed[0], placed[1], slot)
                        arena_allocated += slot
                        counts[placed[0]] += 1
                else:
                    place, offset, slot = where.pop(buf)
                    if place == "fallback":
                        fallback.free(buf)
                    else:
                        arena.release(offset)
                        arena_allocated -= slot
            allocated_series.append(arena_allocated + fallback.allocated_bytes)
            reserved_series.append(arena_bytes + fallback.reserved_bytes)
    except OutOfMemory as exc:
        oom = exc.as_dict()
    allocated = np.asarray(allocated_series, np.int64)
    reserved = np.asarray(reserved_series, np.int64)
    requested = requested[: reserved.shape[0]]
    peak_allocated = int(allocated.max()) if allocated.size else 0
    peak_reserved = int(reserved.max()) if reserved.size else arena_bytes
    result = SimResult(
        allocator="planned",
        peak_requested_bytes=int(requested.max()) if requested.size else 0,
        peak_allocated_bytes=peak_allocated,
        peak_reserved_bytes=peak_reserved,
        fragmentation=fragmentation_of(peak_allocated, peak_reserved),
        segments=1 + fallback.max_segments,
        num_cuda_malloc=1 + fallback.num_cuda_malloc,
        num_cuda_free=fallback.num_cuda_free,
        requested_bytes=requested,
        allocated_bytes=allocated,
        reserved_bytes=reserved,
        peak_event=int(np.argmax(reserved)) if reserved.size else -1,
        oom=oom,
        extra={"arena_bytes": arena_bytes, **{f"{k}_requests": v for k, v in counts.items()}},
    )
    check_replay(trace, result)
    return result
