"""memplan's order for a whole training step: ROAM's decomposition, solved with CP-SAT.

Follows ROAM (Shu et al., arXiv 2310.19295; public code HuiyaoShu/ROAM):

1. Weight updates early: an optimizer operator runs as soon as its dependencies allow
   (its gradient is final and the backward pass has read the old weight), so
   gradients and optimizer temporaries do not stack up at the end of the step.
   `hoist_updates` applies this to a base order; the best of the hoisted candidates
   (program order, Inductor-style, whole-graph LPMF) is the starting order.
2. Key points: operators whose position is the same in every topological order
   (#ancestors + #descendants + 1 == #operators). Memory between two key points does
   not depend on the order elsewhere, so the step splits into independent segments.
3. Segments longer than the node limit are cut into windows of the current order,
   laid out as nested pairs around the loss (window k before the loss with its mirror
   k after it, the pair nearest the loss first). With the order outside a window
   fixed, any topological order of the window's operators keeps the whole order valid,
   and the step's peak is the maximum over windows; so each window's order is solved
   on its own, exactly, with OR-Tools CP-SAT: operator positions (all different,
   dependencies as precedences), each storage an interval from its creation to its
   last use, and one cumulative constraint whose capacity is the window's peak,
   minimised. Storages alive across the whole window are a constant under it. A mirrored
   pair decomposes into its two windows exactly (nothing crosses between them once the
   middle is fixed), so pairs are solved as two subproblems, in parallel.
4. Stitch: each window's solved order replaces its slice if it lowers the window's
   peak; rounds repeat on the windows at the step's peak, with window boundaries
   shifted by half a window every other round, until the time limit.

Every returned order is checked by `memplan.order.validate` (dependencies, recomputed
peak), which shares no code with this module.
"""

from __future__ import annotations

import heapq
import logging
import math
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from memplan.errors import UserError
from memplan.order.baselines import inductor_order, program_order, topological_sort_lpmf
from memplan.order.graph import INTERMEDIATE, StepGraph
from memplan.order.memory import last_uses, memory_timeline, peak_of_order
from memplan.order.validate import OrderBug, validate_order
from memplan.trace.model import PHASE

log = logging.getLogger(__name__)

DEFAULT_NODE_LIMIT = 100
DEFAULT_WINDOW_TIME_LIMIT_S = 10.0


@dataclass
class OrderResult:
    """memplan's order and the figures the CLI reports."""

    order: list[int]
    baseline_peak_bytes: int
    inductor_peak_bytes: int
    optimized_peak_bytes: int
    lower_bound_bytes: int | None
    num_nodes: int
    elapsed_s: float
    verified: bool = False
    stats: dict[str, object] = field(default_factory=dict)


def lower_bound_bytes(graph: StepGraph, max_ops: int = 30000) -> int:
    """No order goes below this. While operator k runs, in every topological order, its
    new storages are alive, and so is every storage made by an ancestor of k and used by
    a descendant of k (or by k). The bound is persistent bytes plus the most such bytes
    over all k. Falls back to k's own working set for graphs over `max_ops` operators."""
    n = graph.num_ops
    nbytes = graph.storage_nbytes
    if n == 0:
        return graph.persistent_bytes
    if n > max_ops:
        need = max(sum(nbytes[s] for s in graph.uses[v] if graph.storage_kind[s] == INTERMEDIATE) for v in range(n))
        return graph.persistent_bytes + need
    ancestors = [0] * n  # inclusive: v itself too
    for v in range(n):
        acc = 1 << v
        for u in graph.preds[v]:
            acc |= ancestors[u]
        ancestors[v] = acc
    succs = graph.succs()
    descendants = [0] * n
    for v in range(n - 1, -1, -1):
        acc = 1 << v
        for w in succs[v]:
            acc |= descendants[w]
        descendants[v] = acc
    users: dict[int, list[int]] = {}
    creator: dict[int, int] = {}
    for v in range(n):
        for s in graph.creates[v]:
            creator[s] = v
    for v in range(n):
        for s in graph.uses[v]:
            if s in creator and creator[s] != v:
                users.setdefault(s, []).append(v)
    nwords = (n + 7) // 8
    live = np.zeros(n, dtype=np.int64)
    for s, c in creator.items():
        if nbytes[s] == 0:
            continue
        alive = 1 << c
        if s in graph.live_out:
            alive |= descendants[c]
        elif s in users:
            reach = 0
            for u in users[s]:
                reach |= ancestors[u]
            alive |= descendants[c] & reach
        bits = np.unpackbits(np.frombuffer(alive.to_bytes(nwords, "little"), dtype=np.uint8), bitorder="little")[:n]
        live += bits.astype(np.int64) * nbytes[s]
    return graph.persistent_bytes + int(live.max())


def hoist_updates(graph: StepGraph, base: Sequence[int]) -> list[int]:
    """`base` with every optimizer operator moved as early as its dependencies allow."""
    rank = {v: r for r, v in enumerate(base)}
    succs = graph.succs()
    indegree = [len(p) for p in graph.preds]
    optimizer = PHASE["optimizer"]
    heap: list[tuple[int, int, int]] = []
    for v in range(graph.num_ops):
        if indegree[v] == 0:
            heapq.heappush(heap, (0 if graph.phase[v] == optimizer else 1, rank[v], v))
    order: list[int] = []
    while heap:
        _urgent, _r, v = heapq.heappop(heap)
        order.append(v)
        for w in succs[v]:
            indegree[w] -= 1
            if indegree[w] == 0:
                heapq.heappush(heap, (0 if graph.phase[w] == optimizer else 1, rank[w], w))
    if len(order) != graph.num_ops:
        raise RuntimeError("hoist_updates: the dependency graph has a cycle")
    return order


def key_points(graph: StepGraph, ignore_sources: bool = True) -> list[int]:
    """Operators at the same position in every topological order (ROAM's key points):
    #ancestors + #descendants + 1 == #operators.

    With `ignore_sources`, only operators connected to the loss (its ancestors and
    descendants) are counted: the others (a constant `arange`, profiler markers, an
    optimizer step counter) float anywhere and would leave no key point at all. The
    points are then fixed relative to every connected operator, which is what window
    boundaries need.
    """
    n = graph.num_ops
    counted = [True] * n
    seed = next((v for v in range(n) if graph.phase[v] == PHASE["backward"]), None)
    if ignore_sources and seed is not None:
        connected = {seed}
        stack = [seed]
        while stack:
            for u in graph.preds[stack.pop()]:
                if u not in connected:
                    connected.add(u)
                    stack.append(u)
        succs0 = graph.succs()
        down = {seed}
        stack = [seed]
        while stack:
            for w in succs0[stack.pop()]:
                if w not in down:
                    down.add(w)
                    stack.append(w)
        connected |= down
        counted = [v in connected for v in range(n)]
    bit = [(1 << v) if counted[v] else 0 for v in range(n)]
    ancestors = [0] * n
    for v in range(n):  # program order is topological
        acc = 0
        for u in graph.preds[v]:
            acc |= ancestors[u] | bit[u]
        ancestors[v] = acc
    succs = graph.succs()
    descendants = [0] * n
    for v in range(n - 1, -1, -1):
        acc = 0
        for w in succs[v]:
            acc |= descendants[w] | bit[w]
        descendants[v] = acc
    total = sum(counted)
    return [v for v in range(n)
            if counted[v] and ancestors[v].bit_count() + descendants[v].bit_count() + 1 == total]


def _loss_position(graph: StepGraph, order: Sequence[int]) -> int:
    for p, v in enumerate(order):
        if graph.phase[v] == PHASE["backward"]:
            return p
    return len(order) // 2


def windows(graph: StepGraph, order: Sequence[int], node_limit: int, keys: set[int], shift: int = 0) -> list[tuple[int, int]]:
    """Slices [a, b) of `order`, cut at key points and at most `node_limit` long, laid out
    as nested pairs around the loss, nearest pair first."""
    n = len(order)
    center = _loss_position(graph, order)
    cuts = {0, n}
    cuts.update(p for p, v in enumerate(order) if v in keys)
    cuts.update(p + 1 for p, v in enumerate(order) if v in keys)
    # boundaries every node_limit positions outward from the loss (+ shift)
    p = center + shift
    while p < n:
        cuts.add(p)
        p += node_limit
    p = center + shift - node_limit
    while p > 0:
        cuts.add(p)
        p -= node_limit
    bounds = sorted(c for c in cuts if 0 <= c <= n)
    slices = [(a, b) for a, b in zip(bounds, bounds[1:]) if b - a > 1]
    return sorted(slices, key=lambda ab: abs((ab[0] + ab[1]) / 2 - center))


def _solve_window(
    graph: StepGraph, order: Sequence[int], a: int, b: int, last: np.ndarray, time_limit_s: float
) -> tuple[list[int] | None, int, int]:
    """CP-SAT order of order[a:b] minimising its transient peak; returns (order or None,
    solved peak, current peak) in bytes above the window's constant part."""
    from ortools.sat.python import cp_model

    nodes = list(order[a:b])
    n = len(nodes)
    local = {v: i for i, v in enumerate(nodes)}
    creator, users = _window_storages(graph, nodes)
    sizes = [graph.storage_nbytes[s] for s in users]
    unit = math.gcd(*sizes) if sizes else 1
    model = cp_model.CpModel()
    pos = [model.new_int_var(0, n - 1, f"p{i}") for i in range(n)]
    model.add_all_different(pos)
    for v in nodes:
        for u in graph.preds[v]:
            if u in local:
                model.add(pos[local[u]] < pos[local[v]])
    intervals, demands, current_rows = _storage_intervals(
        graph, model, pos, local, creator, users, last, b, n, unit
    )
    current = np.zeros(n, dtype=np.int64)
    for lo, hi, nb in current_rows:
        current[lo:hi + 1] += nb
    current_peak = int(current.max()) if n else 0
    if not intervals:
        return None, current_peak, current_peak
    capacity = model.new_int_var(0, int(sum(demands)), "peak")
    model.add_cumulative(intervals, demands, capacity)
    model.minimize(capacity)
    for i in range(n):
        model.add_hint(pos[i], i)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.05, time_limit_s)
    solver.parameters.num_workers = 1
    status = solver.solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None, current_peak, current_peak
    solved_peak = int(solver.value(capacity)) * unit
    new = sorted(nodes, key=lambda v: solver.value(pos[local[v]]))
    return new, solved_peak, current_peak


def _window_storages(graph: StepGraph, nodes: list[int]) -> tuple[dict[int, int], dict[int, list[int]]]:
    """The window's creator of each storage it creates, and the users in the window of
    each non-empty intermediate storage it touches (no users: created, never used)."""
    nbytes = graph.storage_nbytes
    creator: dict[int, int] = {}
    for v in nodes:
        for s in graph.creates[v]:
            creator[s] = v
    users: dict[int, list[int]] = {}
    for v in nodes:
        for s in graph.uses[v]:
            if graph.storage_kind[s] == INTERMEDIATE and nbytes[s] > 0:
                users.setdefault(s, []).append(v)
    for s in creator:
        if nbytes[s] > 0:
            users.setdefault(s, [])
    return creator, users


def _storage_intervals(
    graph: StepGraph,
    model: Any,
    pos: list[Any],
    local: dict[int, int],
    creator: dict[int, int],
    users: dict[int, list[int]],
    last: np.ndarray,
    b: int,
    n: int,
    unit: int,
) -> tuple[list[Any], list[int], list[tuple[int, int, int]]]:
    """One CP-SAT interval per storage of the window, from its creator (or the window's
    start) to its last use (or the window's end if used after it), with its demand in
    `unit`s; and the same rows (start, end, bytes) in the current order. Storages alive
    across the whole window are a constant under it and left out."""
    nbytes = graph.storage_nbytes
    intervals, demands = [], []
    current_rows = []
    for s, us in users.items():
        used_after = last[s] >= b
        if s in creator:
            start = pos[local[creator[s]]]
            cur_start = local[creator[s]]
        else:
            if used_after:
                continue  # alive across the whole window: a constant
            start = 0
            cur_start = 0
        if used_after:
            end = n - 1
            cur_end = n - 1
        else:
            ends = [pos[local[u]] for u in us]
            if s in creator:
                ends.append(start)
            if len(ends) == 1:
                end = ends[0]
            else:
                end = model.new_int_var(0, n - 1, f"e{s}")
                model.add_max_equality(end, ends)
            cur_end = max([local[u] for u in us] + ([cur_start] if s in creator else []))
        if isinstance(start, int) and isinstance(end, int):
            size: object = end - start + 1
        else:
            size = model.new_int_var(1, n, f"z{s}")
            model.add(size == end - start + 1)
        intervals.append(model.new_interval_var(start, size, end + 1, f"i{s}"))
        demands.append(nbytes[s] // unit)
        current_rows.append((cur_start, cur_end, nbytes[s]))
    return intervals, demands, current_rows


@dataclass
class _Search:
    """The optimiser's state: the best order so far, its peak and the run's figures."""

    order: list[int]
    peak_bytes: int
    stats: dict[str, object]


def optimize_order(
    graph: StepGraph,
    time_limit_s: float = 60.0,
    node_limit: int = DEFAULT_NODE_LIMIT,
    window_time_limit_s: float = DEFAULT_WINDOW_TIME_LIMIT_S,
    workers: int = 2,
) -> OrderResult:
    """memplan's order for `graph` (see the module docstring), validated."""
    if not time_limit_s or time_limit_s <= 0:
        raise UserError(f"the time limit must be more than 0 seconds, not {time_limit_s}")
    if node_limit < 2:
        raise UserError(f"the node limit must be at least 2, not {node_limit}")
    start = time.perf_counter()
    deadline = start + time_limit_s
    program = program_order(graph)
    baseline = peak_of_order(graph, program).peak_bytes
    inductor, inductor_peaks = inductor_order(graph)
    inductor_peak = peak_of_order(graph, inductor).peak_bytes
    search = _starting_search(graph, program, inductor, inductor_peaks, deadline)
    keys = set(key_points(graph)) if graph.num_ops <= 40000 else set()
    search.stats.update({"key_points": len(keys), "windows_solved": 0, "windows_improved": 0, "rounds": 0})
    rounds_without_gain = 0
    round_index = 0
    while time.perf_counter() < deadline - 0.1 and rounds_without_gain < 2:
        shift = (node_limit // 2) if round_index % 2 else 0
        round_index += 1
        gained = _search_round(graph, search, keys, node_limit, shift, deadline, window_time_limit_s, workers)
        if gained is None:
            break
        rounds_without_gain = 0 if gained else rounds_without_gain + 1
    search.stats["rounds"] = round_index
    result_peak = validate_order(graph.gm, [graph.ops[v].name for v in search.order])
    if result_peak != search.peak_bytes:
        raise OrderBug(f"reorder: the validator's peak {result_peak} differs from the solver's {search.peak_bytes}")
    return OrderResult(
        order=search.order,
        baseline_peak_bytes=baseline,
        inductor_peak_bytes=inductor_peak,
        optimized_peak_bytes=search.peak_bytes,
        lower_bound_bytes=lower_bound_bytes(graph),
        num_nodes=graph.num_ops,
        elapsed_s=round(time.perf_counter() - start, 3),
        verified=True,
        stats=search.stats,
    )


def _starting_search(
    graph: StepGraph, program: list[int], inductor: list[int], inductor_peaks: dict[str, int], deadline: float
) -> _Search:
    """The lowest-peak candidate (module docstring, step 1): program order,
    Inductor-style and, time allowing, whole-graph LPMF, each with and without early
    weight updates; ties go to the first name alphabetically."""
    candidates = {
        "program": program,
        "inductor": inductor,
        "program+early-updates": hoist_updates(graph, program),
        "inductor+early-updates": hoist_updates(graph, inductor),
    }
    if time.perf_counter() < deadline:
        lpmf = topological_sort_lpmf(graph)
        candidates["lpmf"] = lpmf
        candidates["lpmf+early-updates"] = hoist_updates(graph, lpmf)
    peaks = {name: peak_of_order(graph, o).peak_bytes for name, o in candidates.items()}
    start_name = min(peaks, key=lambda k: (peaks[k], k))
    log.info("reorder: start from %s (%d bytes); candidates %s", start_name, peaks[start_name], peaks)
    stats: dict[str, object] = {"start": start_name, "candidate_peaks": peaks, "inductor_peaks": inductor_peaks}
    return _Search(list(candidates[start_name]), peaks[start_name], stats)


def _search_round(
    graph: StepGraph, search: _Search, keys: set[int], node_limit: int, shift: int, deadline: float,
    window_time_limit_s: float, workers: int,
) -> bool | None:
    """One round (module docstring, steps 3-4): solve the windows at the step's peak in
    parallel, stitch the improved ones, keep the result if it lowers the peak. Returns
    whether it did, or None when no window reaches the peak."""
    order = search.order
    timeline = memory_timeline(graph, order)
    transient_peak = int(timeline.max()) if len(timeline) else 0
    last = last_uses(graph, order)
    slices = [(a, b) for a, b in windows(graph, order, node_limit, keys, shift)
              if int(timeline[a:b].max()) >= transient_peak]
    if not slices:
        return None
    remaining = deadline - time.perf_counter()
    per_window = min(window_time_limit_s, max(0.05, remaining * workers / max(1, len(slices))))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(_solve_window, graph, order, a, b, last, per_window) for a, b in slices]
        results = [f.result() for f in futures]
    search.stats["windows_solved"] = int(search.stats["windows_solved"]) + len(slices)  # type: ignore[arg-type]
    trial = list(order)
    improved = 0
    for (a, b), (new, solved, current) in zip(slices, results):
        if new is not None and solved < current:
            trial[a:b] = new
            improved += 1
    trial_peak = peak_of_order(graph, trial).peak_bytes
    if improved and trial_peak < search.peak_bytes:
        search.order, search.peak_bytes = trial, trial_peak
        search.stats["windows_improved"] = int(search.stats["windows_improved"]) + improved  # type: ignore[arg-type]
        return True
    return False
