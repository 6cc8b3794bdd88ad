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
from memplan.trace.model import ALLOC, CATEGORY, FREE, PHASE, Trace, from_events


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


def training_trace(
    *,
    iterations: int = 3,
    microbatches: int = 2,
    layers: int = 4,
    hidden_bytes: int = 1 << 20,
    weight_bytes: int = 4 << 20,
    dynamic: bool = False,
    seed: int = 0,
) -> Trace:
    """A synthetic training step: weights, then per iteration forward (saved activations
    and short temporaries per layer and micro-batch), backward (frees activations in
    reverse, gradients on the first micro-batch, live until the next iteration starts),
    and an optimizer step (states created in iteration 0, kept). With `dynamic`, one
    activation per layer changes size between iterations (MoE-like routing)."""
    rng = np.random.default_rng(seed)
    kinds: list[int] = []
    events: list[int] = []
    sizes: list[int] = []
    meta: list[tuple[int, int, int, int]] = []  # category, phase, iteration, microbatch
    live_grads: list[int] = []

    def alloc(nbytes: int, category: str, phase: str, it: int, mb: int) -> int:
        sizes.append(int(nbytes))
        meta.append((CATEGORY[category], PHASE[phase], it, mb))
        kinds.append(ALLOC)
        events.append(len(sizes) - 1)
        return len(sizes) - 1

    def free(buf: int) -> None:
        kinds.append(FREE)
        events.append(buf)

    weights = [alloc(weight_bytes, "parameter", "other", -1, 0) for _ in range(layers)]
    states: list[int] = []
    for it in range(iterations):
        for g in live_grads:
            free(g)
        live_grads = []
        for mb in range(microbatches):
            saved: list[list[int]] = []
            for _layer in range(layers):
                acts = []
                for mult in (1, 4, 1):
                    acts.append(alloc(hidden_bytes * mult, "activation", "forward", it, mb))
                    tmp = alloc(hidden_bytes * 2, "temporary", "forward", it, mb)
                    free(tmp)
                if dynamic:
                    routed = int(hidden_bytes * (1 + (rng.random() if it else 0.5)))
                    acts.append(alloc(routed // 512 * 512, "activation", "forward", it, mb))
                saved.append(acts)
            for layer in reversed(range(layers)):
                tmp = alloc(hidden_bytes * 4, "temporary", "backward", it, mb)
                if mb == 0:
                    live_grads.append(alloc(weight_bytes, "gradient", "backward", it, mb))
                free(tmp)
                for a in reversed(saved[layer]):
                    free(a)
        if it == 0:
            states = [alloc(weight_bytes, "optimizer_state", "optimizer", it, 0) for _ in range(2 * layers)]
        for _ in range(layers):
            tmp = alloc(weight_bytes, "temporary", "optimizer", it, 0)
            free(tmp)
    del states, weights
    trace = from_events(np.array(kinds), np.array(sizes), np.array(events))
    cols = np.array(meta, dtype=np.int64).reshape(-1, 4)
    trace.buffers["category"] = cols[:, 0].astype(np.int8)
    trace.buffers["phase"] = cols[:, 1].astype(np.int8)
    trace.buffers["iteration"] = cols[:, 2].astype(np.int32)
    trace.buffers["microbatch"] = cols[:, 3].astype(np.int32)
    return trace
