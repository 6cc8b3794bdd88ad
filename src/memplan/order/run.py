"""Running a reordered step: the GraphModule in memplan's order, and `memplan.reorder`.

`reordered_module(graph, order)` copies the traced graph's nodes in the new order into a
new GraphModule that shares the original's constants (the real parameters and optimizer
states when the step was captured with `capture_step_graph`), so calling it runs one
real training step, in place, in the new order. fx code generation frees every value
after its last user, which is exactly the memory model of `memplan.order.memory`.

`reorder(step_fn, *example_inputs)` is the Python API: trace, optimise, validate, and
return a `ReorderedStep` to call instead of `step_fn`. The backward pass is part of the
graph (explicit operators), so it runs under `torch.no_grad()`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx

from memplan.errors import UserError
from memplan.order.graph import StepGraph, capture_step_graph
from memplan.order.solve import OrderResult, optimize_order


def reordered_module(graph: StepGraph, order: Sequence[int]) -> fx.GraphModule:
    """A GraphModule running `graph`'s operators in `order` (constants shared)."""
    gm = graph.gm
    new_graph = fx.Graph()
    new_graph._codegen = gm.graph._codegen
    env: dict[fx.Node, fx.Node] = {}
    nodes = list(gm.graph.nodes)
    for node in nodes:
        if node.op in ("placeholder", "get_attr"):
            env[node] = new_graph.node_copy(node, lambda n: env[n])
    for v in order:
        node = graph.ops[v]
        env[node] = new_graph.node_copy(node, lambda n: env[n])
    for node in nodes:
        if node.op == "output":
            new_graph.node_copy(node, lambda n: env[n])
    new_graph.lint()
    return fx.GraphModule(gm, new_graph)


class ReorderedStep:
    """A training step that runs in memplan's order. Call it like the original step.

    `result` holds the figures (program-order, Inductor-style and optimised peaks);
    `graph_module` is the reordered GraphModule; `graph` the traced step.
    """

    def __init__(self, graph: StepGraph, result: OrderResult) -> None:
        self.graph = graph
        self.result = result
        self.graph_module = reordered_module(graph, result.order)

    @property
    def predicted_peak_bytes(self) -> int:
        return self.result.optimized_peak_bytes

    def __call__(self, *inputs: Any) -> Any:
        with torch.no_grad():
            return self.graph_module(*inputs)


def reorder(
    step_fn: Callable[..., Any],
    *example_inputs: Any,
    time_limit_s: float = 30.0,
    node_limit: int = 100,
) -> ReorderedStep:
    """Trace `step_fn(*example_inputs)` as one graph, find a lower-peak order, and return
    a callable running it on real tensors.

    `step_fn` runs forward, backward and the optimizer step on a model and optimizer it
    holds (real tensors); run it once before (so optimizer state exists). Tracing uses
    fake tensors and leaves the model and optimizer untouched. Raises `UserError` for a
    step that depends on tensor values or a time limit that is not positive.
    """
    if not time_limit_s or time_limit_s <= 0:
        raise UserError(f"the time limit must be more than 0 seconds, not {time_limit_s}")
    graph = capture_step_graph(step_fn, *example_inputs)
    result = optimize_order(graph, time_limit_s=time_limit_s, node_limit=node_limit)
    return ReorderedStep(graph, result)
