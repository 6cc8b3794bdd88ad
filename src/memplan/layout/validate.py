"""An independent check of offset assignments: shares no code with the solvers.

Like minimalloc's validator (google/minimalloc, src/validator.cc), it re-derives
everything from the raw columns: every offset is a non-negative multiple of its
buffer's alignment, fits under the capacity, and no two buffers whose half-open
lifetimes `[lower, upper)` intersect share a byte. The overlap test is a sweep over
time that keeps the address intervals of the live buffers in a sorted list, so a
100,000-buffer plan checks in well under a second; the solvers instead reason about
offsets with cross-sections and gap lists, so a bug in one is not repeated in the other.

`check_offsets` checks memplan's own output, so a fault is a `LayoutBug`;
`check_given_offsets` checks offsets a user supplied (a solution column of a CSV
problem), where the same fault is bad input, a `UserError`.
"""

from __future__ import annotations

import bisect

import numpy as np

from memplan.errors import MemplanBug, UserError


class LayoutBug(MemplanBug):
    """An offset assignment of memplan's own that breaks a rule: a solver bug."""


def check_offsets(
    lower: np.ndarray,
    upper: np.ndarray,
    nbytes: np.ndarray,
    offsets: np.ndarray,
    *,
    alignment: np.ndarray | None = None,
    capacity: int | None = None,
    ids: list[str] | None = None,
) -> int:
    """Return the height of a valid assignment; raise LayoutBug naming the first fault."""
    lower = np.asarray(lower, dtype=np.int64)
    upper = np.asarray(upper, dtype=np.int64)
    nbytes = np.asarray(nbytes, dtype=np.int64)
    offsets = np.asarray(offsets, dtype=np.int64)
    n = lower.shape[0]

    def name(i: int) -> str:
        return repr(ids[i]) if ids is not None else str(i)

    if offsets.shape != (n,):
        raise LayoutBug(f"{offsets.shape[0]} offsets for {n} buffers")
    if n == 0:
        return 0
    neg = np.flatnonzero(offsets < 0)
    if neg.size:
        raise LayoutBug(f"buffer {name(int(neg[0]))} has negative offset {int(offsets[neg[0]])}")
    if alignment is not None:
        align = np.broadcast_to(np.asarray(alignment, dtype=np.int64), (n,))
        bad = np.flatnonzero(offsets % align != 0)
        if bad.size:
            i = int(bad[0])
            raise LayoutBug(f"buffer {name(i)} offset {int(offsets[i])} breaks its alignment {int(align[i])}")
    tops = offsets + nbytes
    height = int(tops.max())
    if capacity is not None and height > capacity:
        i = int(np.argmax(tops))
        raise LayoutBug(f"buffer {name(i)} ends at {int(tops[i])}, above the capacity {capacity}")

    # Sweep: at each time, first remove the buffers that end, then insert those that start.
    # Live address intervals are disjoint, so sorted by start their ends are sorted too.
    order_in = np.lexsort((np.arange(n), lower))
    order_out = np.lexsort((np.arange(n), upper))
    starts: list[int] = []  # sorted address starts of the live buffers
    owner: list[int] = []
    j_out = 0
    up = upper.tolist()
    lo = lower.tolist()
    off = offsets.tolist()
    top = tops.tolist()
    out_list = order_out.tolist()
    for i in order_in.tolist():
        t = lo[i]
        while j_out < n and up[out_list[j_out]] <= t:
            k = out_list[j_out]
            j_out += 1
            pos = bisect.bisect_left(starts, off[k])
            while owner[pos] != k:  # equal starts can only occur for zero-size buffers
                pos += 1
            del starts[pos]
            del owner[pos]
        pos = bisect.bisect_right(starts, off[i])
        if pos > 0 and top[owner[pos - 1]] > off[i]:
            k = owner[pos - 1]
            raise LayoutBug(
                f"buffers {name(k)} [{off[k]}, {top[k]}) and {name(i)} [{off[i]}, {top[i]}) "
                f"overlap in memory while both are live at time {t}"
            )
        if pos < len(starts) and starts[pos] < top[i]:
            k = owner[pos]
            raise LayoutBug(
                f"buffers {name(i)} [{off[i]}, {top[i]}) and {name(k)} [{off[k]}, {top[k]}) "
                f"overlap in memory while both are live at time {t}"
            )
        starts.insert(pos, off[i])
        owner.insert(pos, i)
    return height


def check_given_offsets(
    lower: np.ndarray,
    upper: np.ndarray,
    nbytes: np.ndarray,
    offsets: np.ndarray,
    *,
    source: str,
    alignment: np.ndarray | None = None,
    capacity: int | None = None,
    ids: list[str] | None = None,
) -> int:
    """`check_offsets` on offsets from the user's `source`: a fault is a UserError naming it."""
    try:
        return check_offsets(lower, upper, nbytes, offsets, alignment=alignment, capacity=capacity, ids=ids)
    except LayoutBug as exc:
        raise UserError(f"{source}: the given offsets are not a valid packing: {exc}") from None
