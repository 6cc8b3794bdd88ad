"""The `planned` allocator: replay a trace against a static plan, STAlloc-style.

STAlloc's runtime (arXiv 2507.16274; infinigence/STAlloc) reserves one arena of the
plan's height, matches the n-th allocation request of an iteration to the n-th entry of
that iteration's plan (sizes must be equal) and serves it at the planned offset.
Iterations beyond the last planned one replay the last planned iteration's entries
(the plan is periodic). A request the plan marks long-lived (offset `LONG_LIVED`: it
outlives its iteration) goes to the fallback directly. A request that is not matched (a different size, no entry, a
dynamic entry, or a planned range that is still occupied because the run deviated
from the plan) is placed best-fit (at a K_MIN_BLOCK_SIZE boundary) in the plan's dynamic reusable
space for that request, intersected with what is free in the arena now; when nothing
fits it goes to a fallback caching allocator (`memplan.alloc.caching`).

Counting, as `torch.cuda` would see this allocator: the arena is reserved from the
start (one cudaMalloc); allocated bytes are the arena's live buffers at their sizes
rounded as the caching allocator rounds without divisions (`memplan.alloc.conf.
round_size_plain`), plus the fallback's blocks; reserved bytes are the arena plus the
fallback's segments. `extra` counts matched, dynamic and fallback requests.
"""

from __future__ import annotations

import bisect
import os
from typing import Any

import numpy as np

from memplan.alloc.caching import CachingAllocator, OutOfMemory
from memplan.alloc.check import check_replay
from memplan.alloc.conf import AllocConf, align_up_to_min_block, round_size_plain
from memplan.alloc.result import AllocReplay, fragmentation_of
from memplan.errors import UserError
from memplan.layout.plan import (
    LONG_LIVED,
    AddressPlan,
    IterationPlan,
    load_address_plan,
    requests_by_group,
)
from memplan.trace.model import ALLOC, Trace


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
                start = align_up_to_min_block(cursor)
                if gap_end - start >= nbytes and (best is None or gap_end - start < best[0]):
                    best = (gap_end - start, start)
                if pos >= len(self.starts):
                    break
                cursor = max(cursor, self.ends[pos])
                pos += 1
        return None if best is None else best[1]


def replay_planned(
    trace: Trace,
    plan: AddressPlan | str | os.PathLike,
    alloc_conf: str | AllocConf | None = None,
    capacity: int | None = None,
) -> AllocReplay:
    """Replay `trace` through the plan's arena with a caching fallback (see module doc).

    `plan` is an AddressPlan or the path of a plan file. A plan made for another trace
    is a UserError."""
    if isinstance(plan, (str, os.PathLike)):
        plan = load_address_plan(plan)
    if not isinstance(plan, AddressPlan):
        raise UserError(
            "the planned allocator needs a memplan AddressPlan (from memplan.plan_addresses or 'memplan plan')"
        )
    plan.check_belongs_to(trace)
    conf = alloc_conf if isinstance(alloc_conf, AllocConf) else AllocConf.parse(alloc_conf)
    arena_bytes = int(plan.arena_bytes)
    requested = trace.live_bytes()
    if capacity is not None and arena_bytes > capacity:
        return AllocReplay(
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
    run = _PlannedRun(trace, plan, fallback)
    run.replay_events()
    result = run.result(requested)
    check_replay(trace, result)
    return result


class _PlannedRun:
    """One planned replay: the arena, the fallback, and where each live buffer went."""

    def __init__(self, trace: Trace, plan: AddressPlan, fallback: CachingAllocator) -> None:
        self.trace = trace
        self.plan = plan
        self.fallback = fallback
        self.arena_bytes = int(plan.arena_bytes)
        self.arena = _Arena(self.arena_bytes)
        # Per buffer: its group and its request index within the group.
        self.group_of = [0] * trace.num_buffers
        self.index_of = [0] * trace.num_buffers
        for g, ids in requests_by_group(trace).items():
            for j, buf in enumerate(ids.tolist()):
                self.group_of[buf] = g
                self.index_of[buf] = j
        self.entries: dict[int, IterationPlan | None] = {}
        self.windows: dict[int, dict[int, list[tuple[int, int]]]] = {}
        self.where: dict[int, tuple[str, int, int]] = {}  # buffer -> (place, offset, slot bytes)
        self.arena_allocated = 0
        self.counts = {"matched": 0, "dynamic": 0, "fallback": 0}
        self.allocated_series: list[int] = []
        self.reserved_series: list[int] = []
        self.oom: dict[str, Any] | None = None

    def entry_for(self, g: int) -> IterationPlan | None:
        """The plan entries serving group `g` (cached with the group's dynamic windows)."""
        if g not in self.entries:
            self.entries[g] = self.plan.for_iteration(g)
            spaces: dict[int, list[tuple[int, int]]] = {}
            if self.entries[g] is not None:
                for w in self.plan.windows_for(g):
                    spaces.setdefault(w.begin_request, []).extend(w.ranges)
            self.windows[g] = spaces
        return self.entries[g]

    def malloc(self, buf: int, size: int, stream: int, event: int) -> None:
        """Serve one request: its planned offset, else the dynamic space, else the fallback."""
        slot = round_size_plain(size)
        g, j = self.group_of[buf], self.index_of[buf]
        entry = self.entry_for(g)
        arena = self.arena
        placed = None
        long_lived = False
        if entry is not None and j < entry.num_requests and int(entry.nbytes[j]) == size:
            offset = int(entry.offset[j])
            long_lived = offset == LONG_LIVED
            if offset >= 0 and arena.is_free(offset, offset + slot):
                placed = ("matched", offset)
        if placed is None and not long_lived:
            ranges = self.windows[g].get(j) if entry is not None else None
            if ranges:
                found = arena.best_fit(ranges, slot)
                if found is not None:
                    placed = ("dynamic", found)
        if placed is None:
            block = self.fallback.malloc(buf, size, stream, event)
            self.where[buf] = ("fallback", block.addr, block.size)
            self.counts["fallback"] += 1
        else:
            arena.take(placed[1], placed[1] + slot)
            self.where[buf] = (placed[0], placed[1], slot)
            self.arena_allocated += slot
            self.counts[placed[0]] += 1

    def free(self, buf: int) -> None:
        place, offset, slot = self.where.pop(buf)
        if place == "fallback":
            self.fallback.free(buf)
        else:
            self.arena.release(offset)
            self.arena_allocated -= slot

    def replay_events(self) -> None:
        """Every event in order, recording the series; stops at the fallback's out-of-memory."""
        trace, fallback = self.trace, self.fallback
        nbytes = trace.buffers["nbytes"].tolist()
        streams = trace.buffers["stream"].tolist()
        kinds = trace.events["kind"].tolist()
        event_buffers = trace.events["buffer"].tolist()
        try:
            for event, (kind, buf) in enumerate(zip(kinds, event_buffers)):
                size = nbytes[buf]
                if size:
                    if kind == ALLOC:
                        self.malloc(buf, size, streams[buf], event)
                    else:
                        self.free(buf)
                self.allocated_series.append(self.arena_allocated + fallback.allocated_bytes)
                self.reserved_series.append(self.arena_bytes + fallback.reserved_bytes)
        except OutOfMemory as exc:
            self.oom = exc.as_dict()

    def result(self, requested: np.ndarray) -> AllocReplay:
        """The replay's statistics, from the recorded series and the fallback's counts."""
        fallback, arena_bytes = self.fallback, self.arena_bytes
        allocated = np.asarray(self.allocated_series, np.int64)
        reserved = np.asarray(self.reserved_series, np.int64)
        requested = requested[: reserved.shape[0]]
        peak_allocated = int(allocated.max()) if allocated.size else 0
        peak_reserved = int(reserved.max()) if reserved.size else arena_bytes
        return AllocReplay(
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
            oom=self.oom,
            extra={"arena_bytes": arena_bytes, **{f"{k}_requests": v for k, v in self.counts.items()}},
        )
