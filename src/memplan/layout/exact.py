"""Exact offset search: does a packing within a capacity exist? Find one, or prove none.

Follows minimalloc's recipe (Moffitt, "MiniMalloc: A Lightweight Memory Allocator for
Hardware-Accelerated Machine Learning", ASPLOS 2023; google/minimalloc) with a
skyline branching rule that suits an interpreted language:

- **Canonical placements.** Only gravity-normalised packings are searched: every
  buffer rests on offset 0 or on the top of another buffer. Each section (a maximal
  time interval with a constant live set) has a *skyline*: below it everything is
  placed or proven empty. The search takes the lowest, then leftmost, section that
  still has unplaced buffers, and branches on what sits there: one of the unplaced
  buffers that *start* in that section and whose whole lifetime is at that level
  (any other buffer could not be there), or nothing, in which case the section's
  skyline rises to the next level at which a buffer could rest. Every normalised
  packing is reached this way, so an exhausted search proves infeasibility.
- **Cross-section inference.** A section's unplaced bytes must fit between its skyline
  and the capacity, and above the lowest level any of its unplaced buffers can rest
  at; and, a staircase, for every level L the bytes of the buffers that cannot rest
  below L must fit between L and the capacity. A move that breaks either in any
  section it touched is pruned.
- **Dominance.** Identical candidates (same lifetime, size and alignment) are tried once;
  waste is only tried after every buffer that could fill the spot.
- **Decomposition.** Time points where no buffer is live split the problem into
  parts solved one after another (a failure in one part does not re-search another).
- **Orderings tried in turn.** Candidate orders (widest first, largest first, largest
  area first) run round-robin under a node budget that doubles, as minimalloc does
  with its pre-orderings, so one unlucky order does not stall the search.

The same search is compiled from `csrc/offset_search.cpp` (`memplan.layout.native`),
node for node when given one order (given several, it adds Luby restarts with random
orders after them: `RANDOM_RESTARTS`). The same file holds a
second complete search with minimalloc's own branching (buffers at their lowest
viable offset, in offset order), and `solve_exact` runs the two compiled searches
side by side on two threads when it can build them, the second going on with the
skyline search on the time-reversed problem, and with OR-Tools CP-SAT
(`memplan.layout.cpsat`) on a third where there are three cores or more (this module
otherwise; this module is the reference of the skyline search).

It answers a decision question; `memplan.layout.pack` turns it into minimisation.
Assumes a checked problem: `lower < upper`, `nbytes > 0`, power-of-two alignments.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

import numpy as np

from memplan.layout import cpsat, native

FOUND, NOT_FOUND, ABORTED, TIMEOUT = 0, 1, 2, 3

# Candidate orders, each a tuple of keys taken largest first:
# W: sections spanned, Z: size, A: area (bytes x time).
HEURISTICS = ("WZ", "ZW", "AZ")
_DONE = np.iinfo(np.int64).max


class _Search:
    """Skyline depth-first search over one decision problem."""

    def __init__(
        self,
        lower: np.ndarray,
        upper: np.ndarray,
        nbytes: np.ndarray,
        align: np.ndarray,
        capacity: int,
        deadline: float,
        max_nodes: int = 1 << 62,
    ) -> None:
        self.max_nodes = max_nodes
        self.n = n = int(lower.shape[0])
        self.size = nbytes.tolist()
        self.size_array = np.asarray(nbytes, np.int64)
        self.align = align.tolist()
        self.capacity = capacity
        self.deadline = deadline
        points = np.unique(np.concatenate([lower, upper]))
        s_lo = np.searchsorted(points, lower)
        s_hi = np.searchsorted(points, upper)
        self.s_lo, self.s_hi = s_lo.tolist(), s_hi.tolist()
        self.num_sections = num_sections = max(int(points.shape[0]) - 1, 0)
        diff = np.zeros(num_sections + 1, np.int64)
        np.add.at(diff, s_lo, nbytes)
        np.add.at(diff, s_hi, -nbytes)
        self.total = np.cumsum(diff)[:num_sections]  # unplaced bytes per section
        self.skyline = np.zeros(num_sections, np.int64)
        self.starting: list[list[int]] = [[] for _ in range(num_sections)]
        for b in range(n):
            self.starting[self.s_lo[b]].append(b)
        self.width = (s_hi - s_lo).tolist()
        # cuts[k]: unplaced buffers live on both sides of the boundary after section k.
        cut_diff = np.zeros(num_sections + 1, np.int64)
        wide = s_hi - s_lo >= 2
        np.add.at(cut_diff, s_lo[wide], 1)
        np.add.at(cut_diff, s_hi[wide] - 1, -1)
        self.cuts = np.cumsum(cut_diff)[:num_sections].tolist()
        # members[s, b]: buffer b is live in section s; rest[b]: the lowest offset b could
        # take now (the highest skyline over its lifetime), _DONE once placed.
        sections = np.arange(num_sections)
        self.members = (sections[:, None] >= s_lo[None, :]) & (sections[:, None] < s_hi[None, :])
        self.rest = np.zeros(n, np.int64)
        self.overlaps = [np.flatnonzero((lower < upper[b]) & (upper > lower[b])) for b in range(n)]
        self.covering = [np.flatnonzero(self.members[k]) for k in range(num_sections)]
        self.placed = [False] * n
        self.offset = np.full(n, -1, np.int64)
        self.nodes = 0
        self.backtracks = 0
        self.node_limit = 1 << 62
        self.key: list[tuple[int, ...]] = [()] * n

    def static_partitions(self) -> list[tuple[int, int]]:
        """Runs of sections that no buffer's lifetime crosses out of (cut count zero)."""
        parts = []
        start = 0
        for k in range(self.num_sections):
            if k == self.num_sections - 1 or self.cuts[k] == 0:
                if int(self.total[start : k + 1].max()) > 0:
                    parts.append((start, k + 1))
                start = k + 1
        return parts

    def solve(self, heuristics: tuple[str, ...] = HEURISTICS) -> int:
        """FOUND (self.offset holds offsets), NOT_FOUND (proven) or TIMEOUT."""
        if self.n and (max(self.size) > self.capacity or int(self.total.max()) > self.capacity):
            return NOT_FOUND
        for s_start, s_end in self.static_partitions():
            status = self._solve_part(s_start, s_end, heuristics)
            if status != FOUND:
                return status
        return FOUND

    def _solve_part(self, s_start: int, s_end: int, heuristics: tuple[str, ...]) -> int:
        budget = max(self.n, 64)
        while True:
            for heuristic in heuristics:
                by_letter = {
                    "W": self.width,
                    "Z": self.size,
                    "A": [self.size[b] * self.width[b] for b in range(self.n)],
                }
                self.key = [tuple(-by_letter[c][b] for c in heuristic) + (b,) for b in range(self.n)]
                self.node_limit = self.nodes + budget if len(heuristics) > 1 else 1 << 62
                status = self._search(s_start, s_end)
                if status != ABORTED:
                    return status
            budget *= 2

    def _search(self, s_start: int, s_end: int) -> int:
        self.nodes += 1
        if self.nodes > self.node_limit:
            return ABORTED
        if self.nodes > self.max_nodes:
            return TIMEOUT
        if (self.nodes & 255) == 0 and time.monotonic() > self.deadline:
            return TIMEOUT
        total = self.total[s_start:s_end]
        sky = self.skyline[s_start:s_end]
        open_rows = total > 0
        if not open_rows.any():
            return FOUND  # every buffer of this part is placed
        capacity = self.capacity
        lowest = int(np.where(open_rows, sky, _DONE).min())
        tight = np.flatnonzero(open_rows & (sky == lowest) & (sky + total == capacity))
        if tight.shape[0]:
            # A lowest section with no slack must be filled exactly from its skyline up:
            # some buffer sits right there, with its whole lifetime at that level. Branch
            # on the section with the fewest such buffers (fail first).
            levels = sky[tight]
            fits = self.members[s_start + tight] & (self.rest[None, :] == levels[:, None])
            counts = fits.sum(axis=1)
            row = int(np.argmin(counts))
            h = int(levels[row])
            candidates = [b for b in np.flatnonzero(fits[row]).tolist() if h % self.align[b] == 0]
            status = self._branch(candidates, h, s_start, s_end)
            if status == NOT_FOUND:
                self.backtracks += 1
            return status
        # Otherwise the lowest, leftmost open section: a buffer starting there sits at
        # its skyline, or nothing does.
        level = np.where(open_rows, sky, _DONE)
        s = int(np.argmin(level))
        h = int(level[s])
        s += s_start
        skyline, size, s_hi = self.skyline, self.size, self.s_hi
        candidates = []
        for b in self.starting[s]:
            if self.placed[b] or h % self.align[b] or h + size[b] > capacity:
                continue
            if int(skyline[s : s_hi[b]].max()) != h:
                continue
            candidates.append(b)
        status = self._branch(candidates, h, s_start, s_end)
        if status != NOT_FOUND:
            return status
        # Nothing sits at (s, h): raise the section to the next level a buffer could rest at.
        rise = self._next_level(s, h)
        if rise is not None and rise + int(self.total[s]) <= capacity:
            skyline[s] = rise
            cov = self.covering[s]
            saved_rest = self.rest[cov]
            self.rest[cov] = np.maximum(saved_rest, rise)
            if self._floors_fit(cov):
                status = self._search(s_start, s_end)
            self.rest[cov] = saved_rest
            skyline[s] = h
        if status == NOT_FOUND:
            self.backtracks += 1
        return status

    def _branch(self, candidates: list[int], h: int, s_start: int, s_end: int) -> int:
        """Try each candidate at offset h (identical ones once); NOT_FOUND if none works."""
        skyline, size, capacity = self.skyline, self.size, self.capacity
        candidates.sort(key=self.key.__getitem__)
        tried: set[tuple[int, int, int, int]] = set()
        for b in candidates:
            lo, hi = self.s_lo[b], self.s_hi[b]
            signature = (lo, hi, size[b], self.align[b])
            if signature in tried:
                continue  # an interchangeable buffer (alignment included) was tried here already
            tried.add(signature)
            top = h + size[b]
            if top > capacity:
                continue
            saved = skyline[lo:hi].copy()
            skyline[lo:hi] = top
            self.total[lo:hi] -= size[b]
            self.placed[b] = True
            self.offset[b] = h
            ov = self.overlaps[b]
            saved_rest = self.rest[ov]
            self.rest[ov] = np.maximum(saved_rest, top)
            self.rest[b] = _DONE
            status = NOT_FOUND
            if not bool((skyline[lo:hi] + self.total[lo:hi] > capacity).any()) and self._floors_fit(ov):
                status = self._place_rest(s_start, s_end, lo, hi)
            self.rest[ov] = saved_rest
            self.placed[b] = False
            self.total[lo:hi] += size[b]
            skyline[lo:hi] = saved
            if status != NOT_FOUND:
                if status != FOUND:
                    self.offset[b] = -1
                return status
            self.offset[b] = -1
        return NOT_FOUND

    def _floors_fit(self, changed: np.ndarray) -> bool:
        """In every section of the buffers whose rest level rose, some unplaced buffer
        must still be able to sit low enough for the section's unplaced bytes to fit,
        and the bytes that can only rest at or above any level must fit above it."""
        a = min(self.s_lo[b] for b in changed.tolist())
        z = max(self.s_hi[b] for b in changed.tolist())
        rest_in = np.where(self.members[a:z], self.rest[None, :], _DONE)
        lowest = rest_in.min(axis=1)
        total = self.total[a:z]
        capacity = self.capacity
        if bool(((total > 0) & (lowest + total > capacity)).any()):
            return False
        # Staircase: for every level L, the unplaced bytes that cannot sit below L must
        # fit in [L, capacity). Only buffers resting above their section's skyline set
        # a level that the check above has not covered.
        raised = (rest_in != _DONE) & (rest_in > self.skyline[a:z, None]) & (total[:, None] > 0)
        size = self.size_array
        for row in np.flatnonzero(raised.any(axis=1)).tolist():
            members = np.flatnonzero(raised[row])
            levels = rest_in[row, members]
            order = np.argsort(levels, kind="stable")
            levels, sizes = levels[order], size[members][order]
            above = np.cumsum(sizes[::-1])[::-1]  # bytes resting at or above each level
            if bool((levels + above > capacity).any()):
                return False
        return True

    def _place_rest(self, s_start: int, s_end: int, lo: int, hi: int) -> int:
        """Search on after a buffer over sections [lo, hi) was placed, splitting the range
        where no unplaced buffer crosses a boundary any more: the parts are independent."""
        cuts = self.cuts
        splits = []
        for k in range(lo, hi - 1):
            cuts[k] -= 1
            if cuts[k] == 0:
                splits.append(k + 1)
        try:
            if not splits:
                return self._search(s_start, s_end)
            bounds = [s_start, *splits, s_end]
            for k in range(len(bounds) - 1):
                a, b = bounds[k], bounds[k + 1]
                if a < b and int(self.total[a:b].max()) > 0:
                    status = self._search(a, b)
                    if status != FOUND:
                        return status
            return FOUND
        finally:
            for k in range(lo, hi - 1):
                cuts[k] += 1

    def _next_level(self, s: int, h: int) -> int | None:
        """Lowest offset above h at which an unplaced buffer live in section s could rest."""
        best = None
        skyline = self.skyline
        for b in self._unplaced_in(s):
            lo, hi = self.s_lo[b], self.s_hi[b]
            others = np.concatenate([skyline[lo:s], skyline[s + 1 : hi]])
            level = int(others.max()) if others.shape[0] else 0
            a = self.align[b]
            if level <= h and h % a:
                # It cannot sit at h for its alignment: it floats at the next aligned offset.
                level = h + 1
            elif level <= h:
                # It would rest on an unplaced buffer of another section: at least that high.
                sizes = [self.size[o] for o in self._unplaced_beside(b, s)]
                if not sizes:
                    continue
                level = h + min(sizes)
            level = -(-level // a) * a
            if best is None or level < best:
                best = level
        return best

    def _unplaced_in(self, s: int) -> list[int]:
        out = []
        for t in range(s, -1, -1):
            for b in self.starting[t]:
                if not self.placed[b] and self.s_hi[b] > s:
                    out.append(b)
        return out

    def _unplaced_beside(self, b: int, s: int) -> list[int]:
        """Unplaced buffers other than b live in b's sections other than s, and not in s."""
        lo, hi = self.s_lo[b], self.s_hi[b]
        out = []
        for t in range(0, hi):
            for o in self.starting[t]:
                if o == b or self.placed[o]:
                    continue
                o_lo, o_hi = self.s_lo[o], self.s_hi[o]
                if o_hi > lo and o_lo < hi and not (o_lo <= s < o_hi):
                    out.append(o)
        return out


# What the compiled engine adds after the static orders: "*", Luby restarts (run r
# stops after 2n x luby(r) nodes) with a fresh random candidate order each run. On
# tight packings one order's run time is heavy-tailed (a few hundred nodes, or more
# than a hundred thousand), which many short runs exploit; the budgets keep growing,
# so an infeasible capacity is still proven. The Python reference keeps the doubling
# round robin over its static orders.
RANDOM_RESTARTS = ("*",)

# Pre-orders of the offset-order search (minimalloc's defaults): keys taken largest
# first — W lifetime width, A area (bytes x width), T the largest unplaced total of
# the buffer's sections.
OFFSET_ORDER_HEURISTICS = ("WAT", "TAW", "TWA")

# CP-SAT joins the portfolio, on a third thread, only where it has a core of its own:
# on fewer cores it only slows the two compiled threads (docs/layout.md has the
# measurements on tight guillotine cuts).
CPSAT_MIN_CORES = 3


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


# Besides the skyline search, the offset-order search's time: this share of the
# attempt's limit, at least OFFSET_ORDER_MIN_S.
OFFSET_ORDER_SHARE = 0.2
OFFSET_ORDER_MIN_S = 0.5

ENGINES = ("auto", "portfolio", "native", "offset-order", "python")
# The compiled portfolio's answering engine, by its index + 1 (-1: none answered).
PORTFOLIO_ENGINES = ("", "skyline", "offset-order", "skyline (time-reversed)")


def _portfolio_with_cpsat(
    ext: Any,
    args: tuple[Any, ...],
    time_limit: float,
    skyline_orders: list[str],
    mirrored: bool,
    lower: np.ndarray,
    upper: np.ndarray,
    nbytes: np.ndarray,
    align: np.ndarray,
    capacity: int,
) -> tuple[int, np.ndarray | None, dict[str, int | str]]:
    """The two compiled searches (two threads, in C++) and CP-SAT (a third) at once;
    the first definite answer stops the others. `args`: the compiled searches' problem
    arguments, ending with `time_limit`; `mirrored`: the offset-order search's thread goes
    on with the skyline search on the time-reversed problem."""
    model = cpsat.Decision(lower, upper, nbytes, align, capacity)
    token = ext.StopToken()
    done: list[tuple[str, int]] = []  # (engine, status) in the order they answered
    lock = threading.Lock()

    def run_cpsat() -> None:
        status = model.solve(time_limit)
        with lock:
            done.append(("cp-sat", status))
        if status in (FOUND, NOT_FOUND):
            token.set()

    worker = threading.Thread(target=run_cpsat, name="memplan-cpsat", daemon=True)
    worker.start()
    # The offset-order search answers minimalloc-like problems in a fraction of a
    # second or rarely at all: past its share it stops, and its thread runs the
    # skyline search on the time-reversed problem.
    offset_order_limit = max(OFFSET_ORDER_MIN_S, OFFSET_ORDER_SHARE * time_limit)
    status, offsets, nodes, backtracks, which = ext.solve_portfolio(
        *args, skyline_orders, list(OFFSET_ORDER_HEURISTICS), 1 << 62, token, offset_order_limit, mirrored
    )
    with lock:
        done.append((PORTFOLIO_ENGINES[which + 1], status))
    while worker.is_alive():
        model.stop()
        worker.join(0.01)
    stats: dict[str, int | str] = {"nodes": nodes, "backtracks": backtracks, "cpsat_branches": model.branches}
    for engine, answer in done:
        if engine and answer in (FOUND, NOT_FOUND):
            stats["engine"] = f"portfolio: {engine}"
            if answer == NOT_FOUND:
                return NOT_FOUND, None, stats
            found = model.offsets if engine == "cp-sat" else np.asarray(offsets, dtype=np.int64)
            return FOUND, found, stats
    stats["engine"] = "portfolio"
    return TIMEOUT, None, stats


def solve_exact(
    lower: np.ndarray,
    upper: np.ndarray,
    nbytes: np.ndarray,
    alignment: np.ndarray,
    capacity: int,
    *,
    deadline: float,
    heuristics: tuple[str, ...] = HEURISTICS,
    engine: str = "auto",
    max_nodes: int | None = None,
) -> tuple[int, np.ndarray | None, dict[str, int | str]]:
    """(FOUND | NOT_FOUND | TIMEOUT, offsets or None, search counts) for one capacity.

    `engine`:
    - "python": this module's skyline search, the reference;
    - "native": the same skyline search compiled from `csrc/offset_search.cpp`, node
      for node when given one order; given several, it runs them and then Luby
      restarts with random orders (`RANDOM_RESTARTS`);
    - "offset-order": the compiled offset-order search (minimalloc's branching: each
      buffer at its lowest viable offset, in non-decreasing offset order);
    - "portfolio": both compiled searches at once, one thread each, and CP-SAT
      (`memplan.layout.cpsat`) on a third when OR-Tools is installed, at least
      `CPSAT_MIN_CORES` cores are usable and no `max_nodes` is given; the first
      definite answer wins (the offset-order search is
      the strongest on minimalloc's challenging benchmarks, the skyline search and
      CP-SAT each solve tight guillotine cuts the others cannot). Given several orders,
      the offset-order search's thread, once past its share of the time, runs the
      skyline search on the time-reversed problem (same packings; the search's
      canonical form is directional, so the two directions stall on different
      instances);
    - "auto": the portfolio when the extension can be built, else "python".

    `max_nodes`: a budget of search nodes besides the deadline; past it the search
    stops with TIMEOUT at the same node in the python and native engines, whatever
    the machine's speed.
    """
    n = int(np.asarray(nbytes).shape[0])
    lower = np.asarray(lower, dtype=np.int64)
    upper = np.asarray(upper, dtype=np.int64)
    nbytes = np.asarray(nbytes, dtype=np.int64)
    align = np.broadcast_to(np.asarray(alignment, dtype=np.int64), (n,))
    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r}: expected one of {', '.join(ENGINES)}")
    node_cap = (1 << 62) if max_nodes is None else int(max_nodes)
    if engine == "auto":
        engine = "portfolio" if native.available() else "python"
    if engine != "python":
        return _solve_compiled(lower, upper, nbytes, align, int(capacity), deadline, heuristics, engine, max_nodes,
                               node_cap)
    search = _Search(lower, upper, nbytes, align, int(capacity), deadline, node_cap)
    old_limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old_limit, 20 * n + 1000))
    try:
        status = search.solve(heuristics)
    finally:
        sys.setrecursionlimit(old_limit)
    stats: dict[str, int | str] = {"nodes": search.nodes, "backtracks": search.backtracks, "engine": "python"}
    if status == FOUND:
        return FOUND, search.offset.copy(), stats
    return status, None, stats


def _solve_compiled(
    lower: np.ndarray,
    upper: np.ndarray,
    nbytes: np.ndarray,
    align: np.ndarray,
    capacity: int,
    deadline: float,
    heuristics: tuple[str, ...],
    engine: str,
    max_nodes: int | None,
    node_cap: int,
) -> tuple[int, np.ndarray | None, dict[str, int | str]]:
    """`solve_exact` with a compiled engine: "native", "offset-order" or "portfolio"."""
    skyline_orders = list(heuristics) + (list(RANDOM_RESTARTS) if len(heuristics) > 1 else [])
    mirrored = len(heuristics) > 1  # the full portfolio: restarts, and the time-reversed run
    time_left = max(0.0, deadline - time.monotonic())
    args = (lower.tolist(), upper.tolist(), nbytes.tolist(), align.tolist(), capacity, time_left)
    ext = native.extension()
    name = engine
    if engine == "native":
        status, offsets, nodes, backtracks = ext.solve(*args, skyline_orders, node_cap)
    elif engine == "offset-order":
        status, offsets, nodes, backtracks = ext.solve_offset_order(*args, list(OFFSET_ORDER_HEURISTICS), node_cap)
    elif max_nodes is None and cpsat.available() and usable_cores() >= CPSAT_MIN_CORES:
        return _portfolio_with_cpsat(ext, args, time_left, skyline_orders, mirrored, lower, upper, nbytes, align,
                                     capacity)
    else:
        offset_order_limit = max(OFFSET_ORDER_MIN_S, OFFSET_ORDER_SHARE * time_left) if mirrored else time_left
        status, offsets, nodes, backtracks, which = ext.solve_portfolio(
            *args, skyline_orders, list(OFFSET_ORDER_HEURISTICS), node_cap, None, offset_order_limit, mirrored
        )
        name = "portfolio" + (f": {PORTFOLIO_ENGINES[which + 1]}" if which >= 0 else "")
    stats: dict[str, int | str] = {"nodes": nodes, "backtracks": backtracks, "engine": name}
    if status == FOUND:
        return FOUND, np.asarray(offsets, dtype=np.int64), stats
    return status, None, stats
