"""The offset problem (dynamic storage allocation) and its solution, as the solvers take them.

A problem is a set of buffers, each with a half-open lifetime `[lower, upper)` on an
integer time axis, a size in bytes and an alignment; a solution gives each buffer an
offset so that buffers alive at the same time never overlap in address space. The
decision form asks for every `offset + nbytes <= capacity`; the optimisation form for
the smallest height `max(offset + nbytes)`. This is minimalloc's model (Moffitt,
ASPLOS 2023; google/minimalloc), whose CSV format `memplan.layout.minimalloc_csv` reads.

Assumptions, checked by `Problem.check`:
- ids are unique strings; `lower < upper`; `nbytes > 0`;
- `alignment` is a power of two (offsets must be multiples of it);
- an offset `hint` (and a given `offset`) is a multiple of the buffer's alignment.

minimalloc's `gaps` (time windows in which a buffer is inactive, or uses only a window
of its bytes) are kept and written back, and the lower bound honours them; the solvers
treat a buffer as live over its whole lifetime, which is always valid but may miss a
tighter packing that a gap allows (then `pack` reports the result as not proven optimal).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from memplan.errors import UserError


@dataclass(frozen=True)
class Gap:
    """A time window `[lower, upper)` of one buffer in which it uses only bytes
    `[window_lower, window_upper)` of itself (an empty window: it is inactive)."""

    lower: int
    upper: int
    window_lower: int = 0
    window_upper: int = 0


@dataclass
class Problem:
    """Buffers to place: columnar, one entry per buffer, in input order."""

    ids: list[str]
    lower: np.ndarray
    upper: np.ndarray
    nbytes: np.ndarray
    alignment: np.ndarray
    hint: np.ndarray | None = None  # -1: no hint
    gaps: list[tuple[Gap, ...]] | None = None
    capacity: int | None = None
    extra_columns: dict[str, list[str]] = field(default_factory=dict)

    @property
    def num_buffers(self) -> int:
        return len(self.ids)

    @classmethod
    def from_arrays(
        cls,
        lower: np.ndarray | list[int],
        upper: np.ndarray | list[int],
        nbytes: np.ndarray | list[int],
        alignment: np.ndarray | list[int] | int = 1,
        *,
        ids: list[str] | None = None,
        capacity: int | None = None,
    ) -> Problem:
        """A checked problem from plain columns (ids default to "0", "1", ...)."""
        lower = np.asarray(lower, dtype=np.int64)
        n = lower.shape[0]
        align = np.asarray(alignment, dtype=np.int64)
        if align.ndim == 0:
            align = np.full(n, int(align), np.int64)
        problem = cls(
            ids=[str(i) for i in range(n)] if ids is None else list(ids),
            lower=lower,
            upper=np.asarray(upper, dtype=np.int64),
            nbytes=np.asarray(nbytes, dtype=np.int64),
            alignment=align,
            capacity=capacity,
        )
        problem.check()
        return problem

    def check(self) -> Problem:
        """Raise UserError naming the first bad buffer; return self if all is well."""
        n = len(self.ids)
        for name in ("lower", "upper", "nbytes", "alignment"):
            if getattr(self, name).shape != (n,):
                raise UserError(f"problem column {name} has {getattr(self, name).shape[0]} entries for {n} buffers")
        seen: dict[str, int] = {}
        for i, ident in enumerate(self.ids):
            if ident in seen:
                raise UserError(f"buffer {ident!r} (entry {i}) repeats the id of entry {seen[ident]}; ids must be unique")
            seen[ident] = i
        bad = np.flatnonzero(self.upper <= self.lower)
        if bad.size:
            i = int(bad[0])
            raise UserError(
                f"buffer {self.ids[i]!r}: upper {int(self.upper[i])} <= lower {int(self.lower[i])}; "
                "a lifetime [lower, upper) must be non-empty"
            )
        bad = np.flatnonzero(self.nbytes <= 0)
        if bad.size:
            i = int(bad[0])
            raise UserError(f"buffer {self.ids[i]!r}: size {int(self.nbytes[i])} must be positive")
        a = self.alignment
        bad = np.flatnonzero((a <= 0) | ((a & (a - 1)) != 0))
        if bad.size:
            i = int(bad[0])
            raise UserError(f"buffer {self.ids[i]!r}: alignment {int(a[i])} must be a power of two (1, 2, 4, ...)")
        if self.hint is not None:
            bad = np.flatnonzero((self.hint >= 0) & (self.hint % a != 0))
            if bad.size:
                i = int(bad[0])
                raise UserError(
                    f"buffer {self.ids[i]!r}: hint {int(self.hint[i])} is not a multiple of its alignment {int(a[i])}"
                )
        if self.capacity is not None and self.capacity < 0:
            raise UserError(f"capacity {self.capacity} must be >= 0")
        return self

    def live_lower_bound(self) -> int:
        """Max over time of the bytes in use (gaps honoured): no packing can be lower."""
        n = self.num_buffers
        if n == 0:
            return 0
        times = [self.lower, self.upper]
        deltas = [self.nbytes, -self.nbytes]
        if self.gaps is not None:
            extra_t: list[int] = []
            extra_d: list[int] = []
            for i, gaps in enumerate(self.gaps):
                size = int(self.nbytes[i])
                for gap in gaps:
                    used = max(0, gap.window_upper - gap.window_lower)
                    extra_t += [gap.lower, gap.upper]
                    extra_d += [used - size, size - used]
            if extra_t:
                times.append(np.asarray(extra_t, np.int64))
                deltas.append(np.asarray(extra_d, np.int64))
        t = np.concatenate(times)
        d = np.concatenate(deltas)
        # At equal times, frees (negative deltas) come first: lifetimes are half-open.
        order = np.lexsort((d, t))
        return int(max(0, np.cumsum(d[order]).max()))


@dataclass
class Solution:
    """Offsets for every buffer of a problem, and what is known about them.

    `status` is "optimal" (height proven minimal), "feasible" (a valid packing, not
    proven minimal, or within capacity when only feasibility was asked),
    "infeasible" (proven: no packing fits the capacity) or "unknown" (the time limit
    ran out before a packing within the capacity was found or ruled out).
    """

    offsets: np.ndarray | None
    height: int | None
    lower_bound: int
    status: str
    elapsed_s: float = 0.0
    method: str = ""
    stats: dict[str, int | float | str] = field(default_factory=dict)

    @property
    def optimal(self) -> bool:
        return self.status == "optimal"

    @property
    def feasible(self) -> bool | None:
        if self.status in ("optimal", "feasible"):
            return True
        if self.status == "infeasible":
            return False
        return None
