"""`memplan.pack`: offsets for a set of buffers, minimal height or within a capacity.

The flow, each step logged in the solution's `stats`:
1. the lower bound: the most bytes live at one time (no packing can be lower);
2. greedy-by-size best fit (`memplan.layout.greedy`) gives a first packing;
3. if that is not already at the lower bound (or within the capacity), the exact
   search (`memplan.layout.exact`) is asked about capacities: first the lower bound
   itself, then a bisection between the proven lower bound and the best height found;
4. every returned packing passes the independent validator (`memplan.layout.validate`).

At the time limit it returns the best packing found with the best proven lower
bound. When the problem has minimalloc "gaps" the solvers ignore them (a valid but
possibly looser packing), so an exhausted search then proves nothing.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from memplan.errors import UserError
from memplan.layout.exact import FOUND, NOT_FOUND, solve_exact
from memplan.layout.greedy import greedy_offsets
from memplan.layout.problem import Problem, Solution
from memplan.layout.validate import check_offsets

log = logging.getLogger(__name__)


def as_problem(buffers: Any, capacity: int | None = None) -> Problem:
    """Accept a Problem, or rows of (lower, upper, nbytes[, alignment])."""
    if isinstance(buffers, Problem):
        return buffers.check()
    rows = [tuple(int(v) for v in row) for row in buffers]
    for i, row in enumerate(rows):
        if len(row) not in (3, 4):
            raise UserError(f"buffer {i}: expected (lower, upper, nbytes[, alignment]), got {len(row)} values")
    if not rows:
        return Problem.from_arrays([], [], [], 1, capacity=capacity)
    lower = [r[0] for r in rows]
    upper = [r[1] for r in rows]
    nbytes = [r[2] for r in rows]
    align = [r[3] if len(r) == 4 else 1 for r in rows]
    return Problem.from_arrays(lower, upper, nbytes, align, capacity=capacity)


def pack(
    buffers: Any,
    capacity: int | None = None,
    minimize: bool = True,
    time_limit_s: float = 10.0,
) -> Solution:
    """Place `buffers` (a Problem, or rows of (lower, upper, nbytes[, alignment])).

    - `minimize=True`: the least height found (at most `capacity` if given); status
      "optimal" when it meets a proven lower bound.
    - `minimize=False` with a capacity: any packing within it ("feasible"), or
      "infeasible" when none exists, or "unknown" at the time limit.
    """
    start = time.monotonic()
    deadline = start + max(0.0, float(time_limit_s))
    problem = as_problem(buffers, capacity)
    if capacity is None:
        capacity = problem.capacity
    if capacity is not None and capacity < 0:
        raise UserError(f"capacity {capacity} must be >= 0")
    if not minimize and capacity is None:
        raise UserError("deciding feasibility needs a capacity; give one, or ask to minimize")
    if problem.num_buffers == 0:
        return Solution(np.zeros(0, np.int64), 0, 0, "optimal", time.monotonic() - start, "empty")

    search = _PackSearch(problem, deadline)
    if minimize:
        status_name = _minimize(search, capacity)
    else:
        assert capacity is not None
        status_name = _decide(search, capacity)

    elapsed = time.monotonic() - start
    proven_lb, stats = search.proven_lb, search.stats
    if status_name in ("infeasible", "unknown"):
        log.info("pack: %s at capacity %s after %.3f s", status_name, capacity, elapsed)
        return Solution(None, None, proven_lb, status_name, elapsed, search.method, stats)
    height = check_offsets(
        problem.lower, problem.upper, problem.nbytes, search.best, alignment=problem.alignment,
        capacity=capacity, ids=problem.ids,
    )  # fmt: skip
    log.info(
        "pack: height %d (lower bound %d, %s) by %s in %.3f s", height, proven_lb, status_name, search.method, elapsed
    )
    return Solution(search.best, height, min(proven_lb, height), status_name, elapsed, search.method, stats)


class _PackSearch:
    """The best packing found so far (greedy first) and the best proven lower bound."""

    def __init__(self, problem: Problem, deadline: float) -> None:
        self.problem = problem
        self.deadline = deadline
        self.has_gaps = problem.gaps is not None and any(problem.gaps)
        self.lower_bound = problem.live_lower_bound()
        self.stats: dict[str, Any] = {"nodes": 0, "backtracks": 0, "exact_calls": 0}
        self.best = greedy_offsets(problem.lower, problem.upper, problem.nbytes, problem.alignment)
        self.best_height = int((self.best + problem.nbytes).max())
        self.stats["greedy_height"] = self.best_height
        self.method = "greedy"
        self.proven_lb = self.lower_bound

    def attempt(self, cap: int, until: float | None = None) -> int:
        """One exact search at capacity `cap` (until `until`, at most the deadline)."""
        p, stats = self.problem, self.stats
        until = self.deadline if until is None else until
        stats["exact_calls"] += 1
        status, found, counts = solve_exact(
            p.lower, p.upper, p.nbytes, p.alignment, cap, deadline=min(until, self.deadline)
        )
        stats["nodes"] += counts["nodes"]
        stats["backtracks"] += counts["backtracks"]
        stats["engine"] = counts["engine"]
        if status == FOUND:
            assert found is not None
            height = int((found + p.nbytes).max())
            if height < self.best_height:
                self.best, self.best_height, self.method = found, height, "exact"
        elif status == NOT_FOUND and not self.has_gaps:
            self.proven_lb = max(self.proven_lb, cap + 1)
        return status


def _minimize(search: _PackSearch, capacity: int | None) -> str:
    """Lower the height by exact searches at decreasing capacities; the status name."""
    deadline = search.deadline
    best_height = search.best_height
    ceiling = best_height - 1 if capacity is None else min(best_height - 1, capacity)
    # Binary search between what is proven infeasible and what is found. The lower
    # bound goes first with most of the time (on tight instances it is the answer);
    # a capacity whose search runs out of its share of time is left behind, and
    # the search goes on above it with half of what remains.
    floor = search.proven_lb  # the least capacity still worth trying
    target = search.proven_lb
    share = 0.8
    while floor <= ceiling and time.monotonic() < deadline:
        until = time.monotonic() + share * (deadline - time.monotonic())
        share = 0.5
        status = search.attempt(target, until)
        if status == FOUND:
            ceiling = search.best_height - 1
        elif status == NOT_FOUND and not search.has_gaps:
            floor = max(floor, search.proven_lb)
        elif status == NOT_FOUND:
            break  # with gaps the search is not complete: it proves nothing
        else:
            floor = target + 1  # out of its time: try above it
        target = (floor + ceiling) // 2
    status_name = "optimal" if search.best_height <= search.proven_lb else "feasible"
    if capacity is not None and search.best_height > capacity:
        status_name = "infeasible" if search.proven_lb > capacity else "unknown"
    return status_name


def _decide(search: _PackSearch, capacity: int) -> str:
    """Whether any packing fits `capacity`: the status name."""
    if search.best_height <= capacity:
        return "feasible"
    if search.lower_bound > capacity:
        return "infeasible"
    status = search.attempt(capacity)
    if status == FOUND:
        return "feasible"
    if status == NOT_FOUND and not search.has_gaps:
        return "infeasible"
    return "unknown"
