"""Operator reordering of the whole training step (ROAM, arXiv 2310.19295).

- `graph`: the step as one fx graph (`capture_step_graph`, `capture_model_step`) and
  its scheduling facts, a `StepGraph` (`step_graph`: storages, aliasing, dependencies,
  phases);
- `memory`: the theoretical and layout-aware peak of an order;
- `baselines`: program order and Inductor's LPMF, BFS and DFS topological sorts;
- `solve`: key-point decomposition, windows solved exactly with CP-SAT, stitching;
- `validate`: the independent check of an order (dependencies, recomputed peak);
- `run`: the reordered GraphModule and `reorder(step_fn, *inputs)`.
"""

from memplan.order.graph import StepGraph, capture_model_step, capture_step_graph, step_graph
from memplan.order.memory import OrderMemory, layout_peak, peak_of_order

__all__ = [
    "OrderMemory",
    "StepGraph",
    "capture_model_step",
    "capture_step_graph",
    "layout_peak",
    "peak_of_order",
    "step_graph",
]
