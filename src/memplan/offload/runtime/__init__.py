"""The offload runtime: applies offloading to a real PyTorch training loop, with NVMe files.

`run(model, optimizer, plan, RunOptions(directory=...))` is a context manager around the
training loop. Inside it:

- saved activations go through `torch.autograd.graph.saved_tensors_hooks`: the storage
  of a saved tensor (at least `min_nbytes`, not a parameter's, a view of one, or a
  buffer's) is written out once when autograd first saves it and read back, ahead of
  need, in backward (`activations.ActivationOffloader`);
- optimizer states (and, streamed, gradients) leave after their last use and come back
  ahead of the next (`states`).

The engine follows TERAIO's (arXiv 2506.06472, §4): a tensor location table (key ->
device / host / ssd) and a worker pool doing the I/O (`engine`), over one preallocated
file per tensor, O_DIRECT where the file system allows it (`store`). The knobs are one
`RunOptions` (`options`).

Assumptions: gradients and states that move are dense, contiguous and not views (the
others stay where they are); on CPU, "device memory" is the process's tensor memory and
a tensor's storage is released with `untyped_storage().resize_(0)`. Under FSDP2 the
sharded parameters, gradients and states are DTensors: their local shards move. CUDA
tensors move through `cuda_io` (imported only when one does): kvikio (GPUDirect Storage)
when it is installed and no checksum is asked for, else a pinned host buffer per I/O thread
and a side CUDA stream; the test suite runs the CPU paths only (docs/offload.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from memplan.errors import UserError
from memplan.offload.runtime.activations import ActivationOffloader
from memplan.offload.runtime.engine import OffloadEngine, OffloadError
from memplan.offload.runtime.options import RunOptions
from memplan.offload.runtime.states import (
    StateOffloader,
    StepInBackward,
    StreamedOptimizer,
    parameter_of,
)
from memplan.offload.runtime.store import FileStore, clean_stale
from memplan.units import format_bytes

__all__ = ["FileStore", "OffloadEngine", "OffloadError", "RunOptions", "clean_stale", "run"]

# a plan's choices for the runtime: (state and gradient keys -> first return op, or None: the
# runtime's own rules; (saved storage sizes, moved or not), or None; activations move;
# optimizer states move)
_PlanChoices = tuple[dict[str, int] | None, tuple[list[int], list[bool]] | None, bool, bool]


def plan_choices(plan: Any, model: torch.nn.Module, options: RunOptions) -> _PlanChoices:
    """What moves under `plan` (None: the runtime's own rules), after refusing a plan this
    runtime cannot apply to this model: one without names, one that moves what this mode does
    not move, or one of another model."""
    if plan is None:
        return None, None, options.activations, options.optimizer_states
    schedule = plan.tensors
    if schedule.empty and plan.transfers:
        raise OffloadError("this plan names no tensors of a live model (it was made from a modelled trace, or one "
                           "captured without names): capture the training step with memplan.capture and plan "
                           "that trace")
    if options.resident_nbytes:
        raise OffloadError("a plan decides which optimizer states stay: give either plan or resident_nbytes")
    if schedule.unnamed:
        what = ", ".join(f"{format_bytes(n)} of {c}s" for c, n in sorted(schedule.unnamed.items()))
        raise OffloadError(f"the plan moves tensors the runtime does not move ({what}): plan with "
                           f"categories=memplan.offload.runtime_categories(streamed_step={options.streamed_step})")
    if not options.streamed_step and any(k.startswith("grad.") for k in schedule.moved):
        raise OffloadError("the plan moves gradients, which only streamed_step=True moves: run with it, or plan "
                           "with categories=memplan.offload.runtime_categories()")
    moved = schedule.moved
    params = {name for name, _ in model.named_parameters()}
    unknown = [k for k in moved if parameter_of(k) not in params]
    if unknown:
        raise OffloadError(f"the plan moves {len(unknown)} tensor(s) of parameters this model does not have "
                           f"(e.g. {unknown[0]}): it was made for another model; capture and plan this very step")
    saved = (schedule.saved_nbytes, schedule.saved_moved)
    return (moved, saved, options.activations and any(schedule.saved_moved),
            options.optimizer_states and bool(moved))


def _state_mover(engine: OffloadEngine, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 options: RunOptions, moved: dict[str, int] | None) -> Any:
    """The hooks that move optimizer states (and gradients) in `options`' mode."""
    if options.step_in_backward:
        return StepInBackward(engine, model, optimizer, options.min_nbytes, options.chunk_nbytes,
                              options.resident_nbytes, options.forward_prefetch_nbytes, moved)
    if options.streamed_step:
        return StreamedOptimizer(engine, model, optimizer, options.min_nbytes, options.chunk_nbytes, moved)
    return StateOffloader(engine, model, optimizer, options.min_nbytes, False, moved)


@contextlib.contextmanager
def run(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    plan: Any = None,
    options: RunOptions | None = None,
) -> Iterator[OffloadEngine]:
    """Offload activations and optimizer states of `model`'s training to files under
    `options.directory`.

    `plan` (an `OffloadPlan` of a trace `memplan.capture` recorded of this very step) decides
    what moves: the optimizer states (and, with `streamed_step`, gradients) it offloads, by
    name, read back in the plan's order, and the saved storages it offloads, by their order
    in the forward (`memplan.offload.schedule`); the rest stays. A plan that moves what this
    mode does not (parameters; gradients without `streamed_step`) is refused: plan with
    `categories=runtime_categories(streamed_step=...)`. The runtime's own timing
    applies: out after last use, back ahead of next use. With None, every activation and
    optimizer state of at least `min_nbytes` moves. With `streamed_step`, gradients
    move too and the optimizer step streams states chunk by chunk (`StreamedOptimizer`):
    the device then never holds every gradient and state at once. With `step_in_backward`,
    each parameter's update runs in backward as soon as its gradient is ready
    (`StepInBackward`): gradients never leave and the update overlaps backward; it needs one
    backward per optimizer step; `resident_nbytes` of states then stay, and
    `forward_prefetch_nbytes` of states are read during the forward (see `StepInBackward`).
    Yields the engine (its location table, bytes moved and degraded tensors are there to
    inspect).
    """
    if options is None:
        raise UserError("memplan.offload.run needs a directory for its files: "
                        "give options=memplan.offload.RunOptions(directory=...)")
    moved, saved, activations, optimizer_states = plan_choices(plan, model, options)
    engine = OffloadEngine(FileStore(options.directory, direct=options.direct), workers=options.workers,
                           checksum=options.checksum, host_fallback=options.host_fallback)
    states = _state_mover(engine, model, optimizer, options, moved) if optimizer_states else None
    acts = (ActivationOffloader(engine, model, options.min_nbytes, options.chunk_nbytes, options.chunk_nbytes, saved)
            if activations else None)
    try:
        with acts.hooks if acts is not None else contextlib.nullcontext():
            engine.saved_tensors_hooks = acts.hooks if acts is not None else None
            yield engine
    finally:
        engine.saved_tensors_hooks = None
        try:
            if states is not None:
                states.restore()
                states.remove()
        finally:
            engine.close()
