"""Small offset problems shared by the exact-search tests (not a test module)."""

import numpy as np
from hypothesis import strategies as st

# docs/sources.md §4: minimalloc's README example, optimum 12 (offsets 8, 8, 4, 4, 0).
README_EXAMPLE = [(0, 3, 4, 1), (3, 9, 4, 1), (0, 9, 4, 1), (9, 21, 4, 1), (0, 21, 4, 1)]


def problems(max_size: int = 16) -> st.SearchStrategy:
    """Random buffers (lower, upper, size, alignment) over 30 time steps."""
    return st.lists(
        st.tuples(st.integers(0, 20), st.integers(1, 10), st.integers(1, 32), st.sampled_from([1, 1, 2, 8])),
        min_size=1,
        max_size=max_size,
    ).map(lambda rows: [(lo, lo + length, size, a) for lo, length, size, a in rows])


def columns(buffers):
    return tuple(np.array(c, dtype=np.int64) for c in zip(*buffers))


def at_live_peak_plus(buffers, slack):
    """(lower, upper, nbytes, align, capacity): the live peak plus slack // 4."""
    lower, upper, nbytes, align = columns(buffers)
    live = max(int(nbytes[(lower <= t) & (t < upper)].sum()) for t in range(int(upper.max())))
    return lower, upper, nbytes, align, live + slack // 4
