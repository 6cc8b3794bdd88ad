"""The offset problem's decision form as an OR-Tools CP-SAT model: the exact portfolio's
third engine.

Each buffer is a rectangle: its lifetime `[lower, upper)` is fixed, its offset is a
variable in `[0, capacity - nbytes]` (a multiple of its alignment), and
`AddNoOverlap2D` forbids two rectangles to share a byte at a time. CP-SAT proves
infeasibility or finds a packing with clause learning: it remembers why a branch
failed, where the two compiled depth-first searches of `csrc/offset_search.cpp` redo
the same failure under every unrelated choice. Neither kind dominates: on tight
guillotine cuts of 350-450 buffers each solves instances the other cannot in seconds
(BENCHMARKS.md, `layout_exact`), so `exact.solve_exact` runs all three at once and
keeps the first definite answer.

Coordinates are divided by a common unit: the greatest common divisor of the sizes,
reduced by every alignment that does not divide it. That loses no packing: in a
gravity-normalised packing every offset is 0, the top of another buffer, or such a
top rounded up to an alignment, all of them multiples of that unit.
"""

from __future__ import annotations

import math
import threading

import numpy as np

FOUND, NOT_FOUND, TIMEOUT = 0, 1, 3


class Decision:
    """One decision problem; `solve` may be stopped from another thread by `stop`."""

    def __init__(
        self, lower: np.ndarray, upper: np.ndarray, nbytes: np.ndarray, align: np.ndarray, capacity: int
    ) -> None:
        from ortools.sat.python import cp_model

        sizes = [int(v) for v in nbytes]
        aligns = [int(v) for v in align]
        self.unit = unit = common_unit(sizes, aligns)
        cap = int(capacity) // unit
        model = cp_model.CpModel()
        self._starts = []
        xs, ys = [], []
        self.trivially_infeasible = any(s > int(capacity) for s in sizes)
        for lo, hi, size, a in zip(lower.tolist(), upper.tolist(), sizes, aligns):
            step = max(1, a // unit)  # offsets are multiples of the alignment
            slots = max(0, (cap - size // unit) // step)
            k = model.new_int_var(0, slots, "")
            start = k * step
            self._starts.append(start)
            xs.append(model.new_fixed_size_interval_var(int(lo), int(hi) - int(lo), ""))
            ys.append(model.new_fixed_size_interval_var(start, size // unit, ""))
        model.add_no_overlap_2d(xs, ys)
        self._model = model
        self._solver = cp_model.CpSolver()
        self._solver.parameters.num_workers = 1
        self._stopped = threading.Event()
        self.offsets: np.ndarray | None = None
        self.branches = 0

    def solve(self, time_limit_s: float) -> int:
        """FOUND (`offsets` set), NOT_FOUND (proven) or TIMEOUT (also when stopped)."""
        from ortools.sat.python import cp_model

        if self.trivially_infeasible:
            return NOT_FOUND
        if self._stopped.is_set() or time_limit_s <= 0:
            return TIMEOUT
        self._solver.parameters.max_time_in_seconds = float(time_limit_s)
        status = self._solver.solve(self._model)
        self.branches = int(self._solver.num_branches)
        if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            self.offsets = np.array([self._solver.value(s) for s in self._starts], np.int64) * self.unit
            return FOUND
        if status == cp_model.INFEASIBLE:
            return NOT_FOUND
        return TIMEOUT

    def stop(self) -> None:
        """Ask a running `solve` (in another thread) to give up; before it starts, it
        will not start. Call until the solving thread has ended: a stop that lands
        between the check and the solver's start is lost."""
        self._stopped.set()
        self._solver.stop_search()


def common_unit(sizes: list[int], aligns: list[int]) -> int:
    """The largest unit every offset of a gravity-normalised packing is a multiple of:
    the sizes' greatest common divisor, reduced by every alignment that does not
    divide it (an alignment that does is met by any multiple of the unit)."""
    unit = math.gcd(*sizes) or 1
    changed = True
    while changed:
        changed = False
        for a in set(aligns):
            reduced = math.gcd(unit, a) if unit % a else unit
            changed = changed or reduced != unit
            unit = reduced
    return unit


def available() -> bool:
    """True when OR-Tools can be imported (it is a dependency; a user's own
    environment may lack it)."""
    try:
        import ortools.sat.python.cp_model  # noqa: F401
    except ImportError:
        return False
    return True
