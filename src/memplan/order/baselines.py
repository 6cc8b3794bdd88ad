"""Baseline orders: what eager PyTorch runs, and PyTorch Inductor's peak-memory sorts.

- `program_order`: the traced order, which is what eager PyTorch executes;
- `topological_sort_lpmf`, `topological_sort_bfs`, `topological_sort_dfs`: the three
  topological sorts of `torch/_inductor/memory.py` (`reorder_for_peak_memory`, PyTorch
  2.6+), re-implemented on memplan's graph with Inductor's selection rules:
  LPMF ("least peak memory first", after the Simulink buffer paper Inductor cites)
  picks, among ready operators, by (its output size if it would raise the peak so far
  else 0, output size minus bytes it frees, program index); BFS picks the ready operator
  whose predecessors ran earliest (FIFO); DFS visits operators by ascending bytes
  written plus read, depth first through their unmet dependencies;
- `inductor_order`: Inductor's rules as Inductor applies them: one graph at a time
  (forward, backward and the optimizer are separate graphs; nothing crosses between
  them), each sorted by the method (or kept as traced) that gives the lowest peak.

Parameters and other persistent storages are not freeable, as in Inductor.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from memplan.order.graph import INTERMEDIATE, StepGraph
from memplan.order.memory import peak_of_order


def program_order(graph: StepGraph) -> list[int]:
    """The traced order (what eager PyTorch runs)."""
    return list(range(graph.num_ops))


def _sub(graph: StepGraph, nodes: Sequence[int]) -> tuple[list[list[int]], list[list[int]]]:
    """Predecessors and successors restricted to `nodes`."""
    inside = set(nodes)
    preds = {v: [u for u in graph.preds[v] if u in inside] for v in nodes}
    succs: dict[int, list[int]] = {v: [] for v in nodes}
    for v in nodes:
        for u in preds[v]:
            succs[u].append(v)
    return preds, succs  # type: ignore[return-value]


def _buffer_users(graph: StepGraph, nodes: Sequence[int]) -> tuple[dict[int, set[int]], dict[int, int]]:
    """Users (other than the creator) of each intermediate storage, within `nodes`, and
    how many uses lie outside `nodes` (a storage used later is never freed here)."""
    inside = set(nodes)
    creator: dict[int, int] = {}
    for v in range(graph.num_ops):
        for s in graph.creates[v]:
            creator[s] = v
    users: dict[int, set[int]] = {}
    outside: dict[int, int] = {}
    for v in range(graph.num_ops):
        for s in graph.uses[v]:
            if graph.storage_kind[s] != INTERMEDIATE or creator.get(s) == v:
                continue
            if v in inside:
                users.setdefault(s, set()).add(v)
            else:
                outside[s] = outside.get(s, 0) + 1
    for s in graph.live_out:
        outside[s] = outside.get(s, 0) + 1
    return users, outside


def topological_sort_lpmf(graph: StepGraph, nodes: Sequence[int] | None = None) -> list[int]:
    """Inductor's LPMF sort of `nodes` (default: the whole graph)."""
    nodes = list(range(graph.num_ops)) if nodes is None else list(nodes)
    preds, succs = _sub(graph, nodes)
    users, outside = _buffer_users(graph, nodes)
    nbytes = graph.storage_nbytes
    size = {v: sum(nbytes[s] for s in graph.creates[v]) for v in nodes}
    outdegree = {s: len(users.get(s, ())) + outside.get(s, 0)
                 for s in {*users, *(s for v in nodes for s in graph.creates[v])}}
    pred_buffers = {v: [] for v in nodes}
    for s, us in users.items():
        for v in us:
            pred_buffers[v].append(s)
    to_free = dict.fromkeys(nodes, 0)
    for v in nodes:
        for s in pred_buffers[v]:
            if outdegree[s] == 1:
                to_free[v] += nbytes[s]
        for s in graph.creates[v]:
            if outdegree[s] == 0:
                to_free[v] += nbytes[s]
    indegree = {v: len(preds[v]) for v in nodes}
    ready = {v for v in nodes if indegree[v] == 0}
    live = 0
    max_memory = 0
    schedule: list[int] = []
    while ready:
        gap = max_memory - live
        chosen = min(ready, key=lambda v: (size[v] if size[v] > gap else 0, size[v] - to_free[v], v))
        ready.remove(chosen)
        schedule.append(chosen)
        live += size[chosen]
        max_memory = max(max_memory, live)
        live -= to_free[chosen]
        for w in succs[chosen]:
            indegree[w] -= 1
            if indegree[w] == 0:
                ready.add(w)
        for s in pred_buffers[chosen]:
            outdegree[s] -= 1
            if outdegree[s] == 1:
                for w in users[s]:
                    to_free[w] += nbytes[s]
    if len(schedule) != len(nodes):
        raise RuntimeError("lpmf: the dependency graph has a cycle")
    return schedule


def topological_sort_bfs(graph: StepGraph, nodes: Sequence[int] | None = None) -> list[int]:
    """Inductor's BFS sort: ready operators by the positions of their predecessors."""
    nodes = list(range(graph.num_ops)) if nodes is None else list(nodes)
    preds, succs = _sub(graph, nodes)
    indegree = {v: len(preds[v]) for v in nodes}
    order_of: dict[int, int] = {}
    heap: list[tuple[list[int], int]] = []
    for v in nodes:
        if indegree[v] == 0:
            heapq.heappush(heap, ([], v))
    schedule: list[int] = []
    while heap:
        _priority, v = heapq.heappop(heap)
        order_of[v] = len(schedule)
        schedule.append(v)
        for w in succs[v]:
            indegree[w] -= 1
            if indegree[w] == 0:
                heapq.heappush(heap, (sorted({order_of[u] for u in preds[w]}), w))
    if len(schedule) != len(nodes):
        raise RuntimeError("bfs: the dependency graph has a cycle")
    return schedule


def topological_sort_dfs(graph: StepGraph, nodes: Sequence[int] | None = None) -> list[int]:
    """Inductor's DFS sort: visit by ascending bytes written + read, dependencies first."""
    nodes = list(range(graph.num_ops)) if nodes is None else list(nodes)
    preds, _succs = _sub(graph, nodes)
    users, _outside = _buffer_users(graph, nodes)
    nbytes = graph.storage_nbytes
    weight = {v: sum(nbytes[s] for s in graph.creates[v]) for v in nodes}
    for s, us in users.items():
        for v in us:
            weight[v] += nbytes[s]
    seen: set[int] = set()
    schedule: list[int] = []
    for root in sorted(nodes, key=lambda v: (weight[v], v)):
        if root in seen:
            continue
        # iterative form of Inductor's recursive visit (graphs here are deep)
        stack: list[tuple[int, list[int]]] = [(root, sorted(preds[root], key=lambda u: (weight[u], u)))]
        seen.add(root)
        while stack:
            v, pending = stack[-1]
            while pending and pending[0] in seen:
                pending.pop(0)
            if pending:
                u = pending.pop(0)
                seen.add(u)
                stack.append((u, sorted(preds[u], key=lambda x: (weight[x], x))))
            else:
                stack.pop()
                schedule.append(v)
    return schedule


SORTS = {"lpmf": topological_sort_lpmf, "bfs": topological_sort_bfs, "dfs": topological_sort_dfs}


def inductor_order(graph: StepGraph) -> tuple[list[int], dict[str, int]]:
    """Inductor's rules per graph: each phase sorted by its best method, phases kept apart.

    Returns the order and the peak of each uniform method (`program`, `lpmf`, `bfs`,
    `dfs`, each applied to every phase) plus `best_per_phase`, the phase-by-phase choice.
    """
    phases = sorted(set(graph.phase))
    members = {p: [v for v in range(graph.num_ops) if graph.phase[v] == p] for p in phases}
    per_phase = {p: {"program": members[p]} for p in phases}
    for p in phases:
        for name, sort in SORTS.items():
            per_phase[p][name] = sort(graph, members[p])
    peaks: dict[str, int] = {}
    for name in ("program", *SORTS):
        order = [v for p in phases for v in per_phase[p][name]]
        peaks[name] = peak_of_order(graph, order).peak_bytes
    chosen = {p: "program" for p in phases}
    for p in phases:  # Inductor keeps, per graph, the method with the lowest estimate
        best = None
        for name in per_phase[p]:
            trial = {**chosen, p: name}
            order = [v for q in phases for v in per_phase[q][trial[q]]]
            peak = peak_of_order(graph, order).peak_bytes
            if best is None or peak < best[0]:
                best = (peak, name)
        chosen[p] = best[1]  # type: ignore[index]
    order = [v for p in phases for v in per_phase[p][chosen[p]]]
    peaks["best_per_phase"] = peak_of_order(graph, order).peak_bytes
    return order, peaks
