"""The memory of a training step run in a given operator order.

ROAM's theoretical peak (Shu et al., arXiv 2310.19295; docs/sources.md §5): walk the
order; when an operator runs, its new storages are allocated while its inputs are
still alive (that sum is a candidate for the peak); then every storage whose last use
was this operator is freed. Persistent storages (parameters, buffers, optimizer states, the step's
inputs) are alive throughout and sit under the transient peak. Storages the graph
returns live to the end. This is also what a GraphModule does at run time: fx code
generation drops each value right after its last user.

The layout-aware peak places the intermediate storages at addresses with the offset
solver of `memplan.layout` (`pack`), so it includes fragmentation that a given order
forces on any static layout; it is the theoretical peak when the packing is tight.

Assumes operators allocate nothing beyond their outputs (kernel workspaces are not in
the graph).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from memplan.layout import pack
from memplan.order.graph import INTERMEDIATE, StepGraph


@dataclass
class OrderMemory:
    """Memory of one order: the peak, the persistent part under it and where it is reached."""

    peak_bytes: int
    persistent_bytes: int
    peak_position: int


def last_uses(graph: StepGraph, order: Sequence[int]) -> np.ndarray:
    """Position in `order` of each storage's last use (len(order) for graph outputs)."""
    last = np.full(len(graph.storage_nbytes), -1, dtype=np.int64)
    for position, op in enumerate(order):
        for s in graph.uses[op]:
            last[s] = position
    for s in graph.live_out:
        last[s] = len(order)
    return last


def memory_timeline(graph: StepGraph, order: Sequence[int]) -> np.ndarray:
    """Transient bytes alive while each operator of `order` runs (outputs allocated,
    inputs not yet freed)."""
    nbytes = graph.storage_nbytes
    last = last_uses(graph, order)
    frees: list[list[int]] = [[] for _ in order]
    for s, position in enumerate(last):
        if graph.storage_kind[s] == INTERMEDIATE and 0 <= position < len(order):
            frees[position].append(s)
    live = 0
    out = np.zeros(len(order), dtype=np.int64)
    for position, op in enumerate(order):
        for s in graph.creates[op]:
            live += nbytes[s]
            if last[s] < position:  # created and never used: freed right after
                frees[position].append(s)
        out[position] = live
        for s in frees[position]:
            live -= nbytes[s]
    return out


def peak_of_order(graph: StepGraph, order: Sequence[int]) -> OrderMemory:
    """ROAM's theoretical peak of `order` (see the module docstring)."""
    timeline = memory_timeline(graph, order)
    persistent = graph.persistent_bytes
    if len(timeline) == 0:
        return OrderMemory(persistent, persistent, 0)
    position = int(np.argmax(timeline))
    return OrderMemory(persistent + int(timeline[position]), persistent, position)


def lifetimes(graph: StepGraph, order: Sequence[int]) -> list[tuple[int, int, int]]:
    """(lower, upper, nbytes) of each intermediate storage, on the operator-position axis,
    half-open: created at `lower`, last alive at `upper - 1`."""
    position_of = {op: p for p, op in enumerate(order)}
    last = last_uses(graph, order)
    rows = []
    for op in order:
        for s in graph.creates[op]:
            if graph.storage_nbytes[s] == 0:
                continue
            lower = position_of[op]
            upper = max(lower, int(last[s])) + 1
            rows.append((lower, upper, int(graph.storage_nbytes[s])))
    return rows


def layout_peak(graph: StepGraph, order: Sequence[int], time_limit_s: float = 5.0, alignment: int = 1) -> int:
    """Persistent bytes plus the height of an offset packing of the intermediates."""
    rows = [(lo, hi, n, alignment) for lo, hi, n in lifetimes(graph, order)]
    if not rows:
        return graph.persistent_bytes
    solution = pack(rows, time_limit_s=time_limit_s)
    return graph.persistent_bytes + int(solution.height)
