"""Generated offset problems whose optimum is known by construction.

`tight_instance` cuts a full rectangle (time x bytes) into `n` buffers by random
guillotine cuts, alternately in time and in address, so the pieces tile the rectangle
exactly: every time point has the full height live, the lower bound equals the
height, and the cut itself is an optimal packing. The buffers are then shuffled so a
solver gets no hint from their order. Sizes are multiples of `quantum_bytes` (1024,
as in minimalloc's challenging benchmarks).
"""

from __future__ import annotations

import numpy as np

from memplan.layout.problem import Problem


def tight_instance(
    n: int,
    *,
    seed: int = 0,
    time_span: int = 1000,
    height_quanta: int = 1024,
    quantum_bytes: int = 1024,
) -> tuple[Problem, np.ndarray]:
    """(problem with capacity = optimum, the offsets of the construction)."""
    rng = np.random.default_rng(seed)
    # Rectangles as [t0, t1, y0, y1] in time units and quanta.
    rects = [(0, time_span, 0, height_quanta)]
    while len(rects) < n:
        # Split one of the larger rectangles: pick by area, weighted.
        areas = np.array([(r[1] - r[0]) * (r[3] - r[2]) for r in rects], dtype=np.float64)
        order = np.argsort(-areas)
        pick = int(order[rng.integers(0, max(1, min(len(rects), 4)))])
        t0, t1, y0, y1 = rects[pick]
        can_time = t1 - t0 >= 2
        can_space = y1 - y0 >= 2
        if not (can_time or can_space):
            pick = int(order[0])
            t0, t1, y0, y1 = rects[pick]
            can_time, can_space = t1 - t0 >= 2, y1 - y0 >= 2
            if not (can_time or can_space):
                raise ValueError(f"cannot cut {n} buffers from a {time_span} x {height_quanta} rectangle")
        in_time = can_time and (not can_space or rng.random() < 0.5)
        rects.pop(pick)
        if in_time:
            cut = int(rng.integers(t0 + 1, t1))
            rects += [(t0, cut, y0, y1), (cut, t1, y0, y1)]
        else:
            cut = int(rng.integers(y0 + 1, y1))
            rects += [(t0, t1, y0, cut), (t0, t1, cut, y1)]
    perm = rng.permutation(len(rects))
    rects = [rects[i] for i in perm]
    lower = np.array([r[0] for r in rects], np.int64)
    upper = np.array([r[1] for r in rects], np.int64)
    nbytes = np.array([(r[3] - r[2]) * quantum_bytes for r in rects], np.int64)
    offsets = np.array([r[2] * quantum_bytes for r in rects], np.int64)
    problem = Problem.from_arrays(lower, upper, nbytes, 1, capacity=height_quanta * quantum_bytes)
    return problem, offsets
