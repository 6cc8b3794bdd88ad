"""A plan in the terms the runtime applies it to real training (`memplan.offload.run`).

The planner works on buffers of a trace; the runtime sees tensors of a live model. Two
names join them, both recorded by `memplan.capture` on the traced step:

- gradients and optimizer states by the runtime's own keys, `grad.<parameter name>` and
  `state.<parameter name>.<state key>` (`trace.meta["tensor_names"]`, buffer -> key);
- the storages autograd saves for backward by their order of first saving in one forward
  (`trace.meta["saved_order"]`): the k-th storage a forward saves is the k-th of the traced
  forward, and its size must agree (`memplan.offload.runtime` checks it, and refuses a plan
  made for another step).

`TensorSchedule.moved` also gives each named tensor the op at which the plan first brings it
back, so the runtime reads them back in the plan's order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from memplan.trace.model import CATEGORY, Trace

# storages the runtime's saved-tensor hook never moves: parameters (and their views) and
# module buffers, which stay on the device anyway
_NOT_SAVED_ACTIVATIONS = ("parameter", "gradient", "optimizer_state", "other")


def runtime_categories(*, streamed_step: bool = False) -> tuple[str, ...]:
    """The planner's candidate categories the runtime moves (`plan_offload(..., categories=...)`):
    optimizer states and saved activations, and gradients with `streamed_step` (in the other
    modes a gradient stays until the update consumes it). Parameters never move."""
    return ("gradient", "optimizer_state", "activation") if streamed_step else ("optimizer_state", "activation")


@dataclass
class TensorSchedule:
    """Which tensors a plan moves, by the names the runtime knows them by."""

    moved: dict[str, int] = field(default_factory=dict)  # runtime key -> first return op (num_ops: never back)
    saved_nbytes: list[int] = field(default_factory=list)  # one forward's saved storages, first-saving order
    saved_moved: list[bool] = field(default_factory=list)  # whether the plan moves each of them
    # category -> bytes of planned transfers of buffers the runtime has no name for (parameters,
    # buffers autograd never saved): the runtime cannot apply such a plan and refuses it
    unnamed: dict[str, int] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not self.moved and not self.saved_nbytes

    def to_json(self) -> dict[str, Any]:
        return {"moved": dict(self.moved), "saved_nbytes": list(self.saved_nbytes),
                "saved_moved": list(self.saved_moved), "unnamed": dict(self.unnamed)}


def _first_forward(trace: Trace, order: list[int]) -> list[int]:
    """The saved buffers of the trace's first forward (one iteration's first micro-batch).

    Storages that existed before the step (the input batch) are saved first in the first
    forward only, and count there; the first buffer made inside a later (iteration,
    micro-batch) ends the forward."""
    b = trace.buffers
    first: tuple[int, int] | None = None
    out = []
    for idx in order:
        made_in_step = int(b["alloc_op"][idx]) >= 0
        key = (int(b["iteration"][idx]), int(b["microbatch"][idx]))
        if made_in_step:
            if first is None:
                first = key
            elif key != first:
                break
        out.append(idx)
    return out


def tensor_schedule(trace: Trace, transfers: list[Any], num_ops: int) -> TensorSchedule:
    """The runtime's view of `transfers` (a plan's) on `trace`; empty where the trace has
    no names (a modelled trace, or one captured before names were recorded)."""
    names: dict[str, str] = trace.meta.get("tensor_names") or {}
    first_back: dict[int, int] = {}
    for t in transfers:
        back = num_ops if t.use_op is None else int(t.return_op)
        first_back[t.buffer] = min(first_back.get(t.buffer, back), back)
    moved: dict[str, int] = {}
    for buffer, back in first_back.items():
        name = names.get(str(buffer))
        if name is not None:
            moved[name] = min(moved.get(name, back), back)
    excluded = np.isin(trace.buffers["category"], [CATEGORY[c] for c in _NOT_SAVED_ACTIVATIONS])
    order = [int(i) for i in trace.meta.get("saved_order") or [] if not excluded[int(i)]]
    saved = _first_forward(trace, order)
    nbytes = trace.buffers["nbytes"]
    # every forward (micro-batch) applies the first forward's choices, so any saved buffer counts as named
    saved_anywhere = set(order)
    unnamed: dict[str, int] = {}
    for t in transfers:
        if str(t.buffer) not in names and t.buffer not in saved_anywhere:
            unnamed[t.category] = unnamed.get(t.category, 0) + int(t.nbytes)
    return TensorSchedule(
        moved=dict(sorted(moved.items(), key=lambda kv: (kv[1], kv[0]))),
        saved_nbytes=[int(nbytes[i]) for i in saved],
        saved_moved=[i in first_back for i in saved],
        unnamed=unnamed,
    )
