"""Exact offset search: does a packing within a capacity exist? Find one, or prove none.

The method is minimalloc's (Moffitt, "MiniMalloc: A Lightweight Memory Allocator for
Hardware-Accelerated Machine Learning", ASPLOS 2023; google/minimalloc), reimplemented:

- **Canonical placements.** Every buffer is placed at its *minimum offset*: the top of
  the highest placed buffer it overlaps in time (rounded up to its alignment). Buffers
  are placed in non-decreasing (offset, pre-order rank); every packing can be pushed
  down into such a canonical one, so searching these alone is complete.
- **Cross-section inference.** A section is a maximal time interval with a constant
  live set. Each keeps a floor (the lowest offset still usable by its unplaced buffers)
  and the bytes of its unplaced buffers; `max(floor, current offset) + bytes >
  capacity` prunes the branch.
- **Dominance.** No buffer is placed at or above the lowest top any unplaced buffer
  could reach: that would leave a gap the lower buffer fills better.
- **Decomposition.** Time points where no buffer is live split the problem
  statically; during search, a section boundary that no unplaced buffer crosses
  splits the rest into independent sub-problems, solved one after the other.
- **Orderings tried in turn.** Static pre-orders (by width in sections, area and
  largest section total) are tried round-robin under a node budget that doubles,
  so one unlucky order does not stall the search.

It answers a decision question; `memplan.layout.pack` turns it into minimisation.
Assumes a checked problem: `lower < upper`, `nbytes > 0`, power-of-two alignments.
"""

from __future__ import annotations

import sys
import time

import numpy as np

FOUND, NOT_FOUND, ABORTED, TIMEOUT = 0, 1, 2, 3

# Pre-order heuristics, as in minimalloc: each letter a key, largest first.
# W: sections spanned, A: area (bytes x time), T: largest section total, Z: size.
HEURISTICS = ("WAT", "TAW", "TWA", "AWT")


_UNPLACED = np.iinfo(np.int64).max // 4


class _Search:
    """Depth-first search state; numpy columns so each node costs O(sections x buffers) in C."""

    def __init__(
        self,
        lower: np.ndarray,
        upper: np.ndarray,
        nbytes: np.ndarray,
        align: np.ndarray,
        capacity: int,
        deadline: float,
    ) -> None:
        self.n = n = int(lower.shape[0])
        self.size = nbytes.astype(np.int64)
        self.size_list = self.size.tolist()
        self.align = align.astype(np.int64)
        self.capacity = capacity
        self.deadline = deadline
        points = np.unique(np.concatenate([lower, upper]))
        self.s_lo = np.searchsorted(points, lower).astype(np.int64)
        self.s_hi = np.searchsorted(points, upper).astype(np.int64)
        self.s_lo_list = self.s_lo.tolist()
        self.s_hi_list = self.s_hi.tolist()
        self.num_sections = num_sections = max(int(points.shape[0]) - 1, 0)
        sections = np.arange(num_sections)
        # members[s, b]: buffer b is live in section s.
        self.members = (sections[:, None] >= self.s_lo[None, :]) & (sections[:, None] < self.s_hi[None, :])
        self.total = (self.members * self.size[None, :]).sum(axis=1).astype(np.int64)
        self.floor = np.zeros(num_sections, np.int64)
        self.overlaps = []
        for b in range(n):
            mask = (lower < upper[b]) & (upper > lower[b])
            mask[b] = False
            self.overlaps.append(np.flatnonzero(mask))
        # cuts[k]: buffers crossing the boundary between section k and k+1.
        diff = np.zeros(num_sections + 1, np.int64)
        wide = self.s_hi - self.s_lo >= 2
        np.add.at(diff, self.s_lo[wide], 1)
        np.add.at(diff, self.s_hi[wide] - 1, -1)
        self.cuts = np.cumsum(diff)[:num_sections].tolist()
        self.placed = np.zeros(n, bool)
        self.offset = np.full(n, -1, np.int64)
        self.solution = np.full(n, -1, np.int64)
        self.min_off = np.zeros(n, np.int64)
        self.pre = np.zeros(n, np.int64)
        self.nodes = 0
        self.backtracks = 0
        self.node_limit = 1 << 62
        self.heuristic = HEURISTICS[0]

    def static_partitions(self) -> list[tuple[np.ndarray, int, int]]:
        """Runs of sections with a non-empty live set, and the buffers in each."""
        parts = []
        live = self.members.any(axis=1).tolist()
        s = 0
        while s < self.num_sections:
            if not live[s]:
                s += 1
                continue
            start = s
            while s < self.num_sections and live[s]:
                s += 1
            cols = np.flatnonzero((self.s_lo < s) & (self.s_hi > start))
            parts.append((cols, start, s))
        return parts

    def solve(self, heuristics: tuple[str, ...] = HEURISTICS) -> int:
        """FOUND (self.solution holds offsets), NOT_FOUND (proven) or TIMEOUT."""
        if self.n and (int(self.size.max()) > self.capacity or int(self.total.max()) > self.capacity):
            return NOT_FOUND
        parts = self.static_partitions()
        budget = max(self.n, 1)
        while True:
            budget *= 2
            for heuristic in heuristics:
                self.heuristic = heuristic
                self.node_limit = self.nodes + budget if len(heuristics) > 1 else 1 << 62
                status = FOUND
                for cols, s_start, s_end in parts:
                    status = self._sub_solve(cols, s_start, s_end)
                    if status != FOUND:
                        break
                if status in (FOUND, NOT_FOUND, TIMEOUT):
                    return status

    def _sub_solve(self, cols: np.ndarray, s_start: int, s_end: int) -> int:
        """Rank the partition's buffers by the current heuristic, then search it."""
        sub = self.members[s_start:s_end][:, cols]
        width = (self.s_hi - self.s_lo)[cols]
        area = self.size[cols] * width
        totals = np.where(sub, self.total[s_start:s_end, None], 0).max(axis=0)
        by_letter = {"W": width, "A": area, "T": totals, "Z": self.size[cols]}
        keys = [cols] + [-by_letter[c] for c in reversed(self.heuristic)]
        ranked = np.lexsort(keys)
        self.pre[cols[ranked]] = np.arange(cols.shape[0])
        return self._search(cols, sub, s_start, s_end, -1, -1)

    def _search(self, cols: np.ndarray, sub: np.ndarray, s_start: int, s_end: int, min_offset: int, min_pre: int) -> int:
        self.nodes += 1
        if self.nodes > self.node_limit:
            return ABORTED
        if (self.nodes & 63) == 0 and time.monotonic() > self.deadline:
            return TIMEOUT
        placed, min_off, size = self.placed, self.min_off, self.size
        unplaced = cols[~placed[cols]]
        if unplaced.shape[0] == 0:
            done = self.placed
            self.solution[done] = self.offset[done]
            return FOUND
        offsets = min_off[unplaced]
        ranks = self.pre[unplaced]
        order = np.lexsort((ranks, offsets))
        min_height = int((offsets + size[unplaced]).min())
        capacity = self.capacity
        floor, total = self.floor, self.total
        for k in order.tolist():
            offset = int(offsets[k])
            if offset >= min_height:
                break  # dominance: a lower unplaced buffer would fill this gap better
            rank = int(ranks[k])
            if offset < min_offset or (offset == min_offset and rank < min_pre):
                continue  # not canonical
            b = int(unplaced[k])
            top = offset + self.size_list[b]
            if top > capacity:
                continue
            placed[b] = True
            self.offset[b] = offset
            # Raise the minimum offsets of the unplaced buffers it overlaps.
            ov = self.overlaps[b]
            raised = ov[~placed[ov] & (min_off[ov] < top)]
            old_min = min_off[raised]
            a = self.align[raised]
            min_off[raised] = -(-top // a) * a
            # Sections it spans: floor to its top, its bytes leave the unplaced total.
            lo, hi = self.s_lo_list[b], self.s_hi_list[b]
            old_floor = floor[lo:hi].copy()
            floor[lo:hi] = top
            total[lo:hi] -= self.size_list[b]
            status = NOT_FOUND
            if self._check(cols, sub, s_start, s_end, offset):
                status = self._decompose(cols, sub, s_start, s_end, offset, rank, b)
            floor[lo:hi] = old_floor
            total[lo:hi] += self.size_list[b]
            min_off[raised] = old_min
            placed[b] = False
            self.offset[b] = -1
            if status != NOT_FOUND:
                return status
        self.backtracks += 1
        return NOT_FOUND

    def _check(self, cols: np.ndarray, sub: np.ndarray, s_start: int, s_end: int, offset: int) -> bool:
        """Cross-section inference: every section's unplaced bytes fit above its floor."""
        total = self.total[s_start:s_end]
        # A section's floor is at least the lowest minimum offset of its unplaced buffers.
        waiting = np.where(self.placed[cols], _UNPLACED, self.min_off[cols])
        lowest = np.where(sub, waiting[None, :], _UNPLACED).min(axis=1)
        floor = np.maximum(np.maximum(self.floor[s_start:s_end], lowest), offset)
        return not bool(((total > 0) & (floor + total > self.capacity)).any())

    def _decompose(
        self, cols: np.ndarray, sub: np.ndarray, s_start: int, s_end: int, offset: int, rank: int, b: int
    ) -> int:
        cuts = self.cuts
        cutpoints = [s_start]
        lo, hi = self.s_lo_list[b], self.s_hi_list[b]
        for s in range(lo, hi - 1):
            cuts[s] -= 1
            if cuts[s] == 0:
                cutpoints.append(s + 1)
        try:
            if len(cutpoints) == 1:
                return self._search(cols, sub, s_start, s_end, offset, rank)
            cutpoints.append(s_end)
            solved_any = False
            for k in range(1, len(cutpoints)):
                c_lo, c_hi = cutpoints[k - 1], cutpoints[k]
                if c_lo >= c_hi:
                    continue
                inside = cols[~self.placed[cols] & (self.s_lo[cols] < c_hi) & (self.s_hi[cols] > c_lo)]
                if inside.shape[0] == 0:
                    continue
                status = self._sub_solve(inside, c_lo, c_hi)
                if status != FOUND:
                    return status
                solved_any = True
            if not solved_any:  # nothing left to place: record this leaf
                return self._search(cols, sub, s_start, s_end, offset, rank)
            return FOUND
        finally:
            for s in range(lo, hi - 1):
                cuts[s] += 1


def solve_exact(
    lower: np.ndarray,
    upper: np.ndarray,
    nbytes: np.ndarray,
    alignment: np.ndarray,
    capacity: int,
    *,
    deadline: float,
    heuristics: tuple[str, ...] = HEURISTICS,
) -> tuple[int, np.ndarray | None, dict[str, int]]:
    """(FOUND | NOT_FOUND | TIMEOUT, offsets or None, search counts) for one capacity."""
    n = int(np.asarray(nbytes).shape[0])
    search = _Search(
        np.asarray(lower, dtype=np.int64),
        np.asarray(upper, dtype=np.int64),
        np.asarray(nbytes, dtype=np.int64),
        np.broadcast_to(np.asarray(alignment, dtype=np.int64), (n,)),
        int(capacity),
        deadline,
    )
    old_limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old_limit, 20 * n + 1000))
    try:
        status = search.solve(heuristics)
    finally:
        sys.setrecursionlimit(old_limit)
    stats = {"nodes": search.nodes, "backtracks": search.backtracks}
    if status == FOUND:
        return FOUND, search.solution.copy(), stats
    return status, None, stats
