"""`capture(step_fn, ...)`: run any training step under the dispatch-level `Recorder`
and return a validated `Trace`.

It knows what the storages are from the model and the optimizer: parameters (with the
quantisation constants of bitsandbytes' layers), `.grad` tensors, `optimizer.state`, the
step's inputs and autograd's saved tensors (through `saved_tensors_hooks`); the recorder
derives the phase (forward, backward, recompute, optimizer) and the micro-batch on its own
(docs/capture.md).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils._python_dispatch import _disable_current_modes

from memplan.capture import grouped_mm
from memplan.capture.hf_masks import masks_as_on_real_tensors
from memplan.capture.recorder import Recorder, _tensors
from memplan.models.quant import quantisation_constants
from memplan.trace.model import Trace


def _trainable_bytes(optimizers: list[torch.optim.Optimizer]) -> int:
    """Bytes of the parameters the optimizers step, rank-local shards for DTensors: what
    a data-parallel wrapper's gradient buckets hold (a gradient's storage can be larger:
    DTensor's vocabulary-sharded embedding computes a full-vocabulary dense gradient)."""
    seen: dict[int, int] = {}
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for p in group["params"]:
                local = p.to_local() if hasattr(p, "to_local") else p
                seen[id(p)] = local.numel() * local.element_size()
    return sum(seen.values())


def _mark_model(rec: Recorder, model: torch.nn.Module) -> None:
    for name, p in model.named_parameters():
        owner = name.rpartition(".")[0] or type(model).__name__
        rec.mark(p, "parameter", module=owner)
        if p.grad is not None:
            rec.mark(p.grad, "gradient", module=owner)
            rec.name(p.grad, f"grad.{name}")
    for name, buf in model.named_buffers():
        rec.mark(buf, "other", module=name.rpartition(".")[0] or type(model).__name__)
    for owner, constant in quantisation_constants(model):
        # bitsandbytes' absmax / code / offset / row scales: frozen parts of the weights
        rec.mark(constant, "parameter", module=owner or type(model).__name__)


def _owner(p: torch.Tensor, names: dict[int, str]) -> str | None:
    """The module of parameter `p` (None: not one of the model's)."""
    return names[id(p)].rpartition(".")[0] if id(p) in names else None


def _mark_gradient(rec: Recorder, p: torch.Tensor, names: dict[int, str]) -> None:
    """`p`'s gradient, if it has one, and its name as the offload runtime keys it."""
    if p.grad is not None:
        rec.mark(p.grad, "gradient", module=_owner(p, names))
        if id(p) in names:
            rec.name(p.grad, f"grad.{names[id(p)]}")


def _with_host_copies(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> dict[int, str]:
    """`names` plus the host copies of the parameters an optimizer steps on the host
    (torchao's `CPUOffloadOptimizer` keeps them in `param_d2h_map`), named as theirs."""
    copies = getattr(optimizer, "param_d2h_map", None)
    if not copies:
        return names
    return {**names, **{id(host): names[id(p)] for p, host in copies.items() if id(p) in names}}


def _mark_optimizer(rec: Recorder, optimizer: torch.optim.Optimizer, names: dict[int, str]) -> None:
    """Categories of the optimizer's tensors and the module of each one's parameter; with
    `names` (id of a parameter -> its qualified name), also the names the offload runtime
    keys them by (`memplan.offload.runtime`)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            rec.mark(p, "parameter", module=_owner(p, names))
            _mark_gradient(rec, p, names)
    for p, state in optimizer.state.items():
        for key, value in state.items():
            for t in _tensors(value):
                rec.mark(t, "optimizer_state", module=_owner(p, names))
                if id(p) in names:
                    rec.name(t, f"state.{names[id(p)]}.{key}")


def _parameter_names(models: list[torch.nn.Module]) -> dict[int, str]:
    return {id(p): name for model in models for name, p in model.named_parameters()}


@contextlib.contextmanager
def _recording_hooks(
    rec: Recorder, models: list[torch.nn.Module], optimizers: list[torch.optim.Optimizer]
) -> Iterator[None]:
    """Phase and category hooks active while the recorder runs."""
    names = _parameter_names(models)
    for optimizer in optimizers:  # an offloaded optimizer's inner ones step the host copies
        names = _with_host_copies(optimizer, names)

    depth = [0]  # optimizer steps in progress: a wrapper's step runs its inner optimizers' steps

    def pre_step(optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        depth[0] += 1
        rec.in_optimizer = True
        # gradients are final when the optimizer starts
        for group in optimizer.param_groups:
            for p in group["params"]:
                rec.mark(p, "parameter")
                _mark_gradient(rec, p, names)

    def post_step(optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        _mark_optimizer(rec, optimizer, names)
        depth[0] = max(0, depth[0] - 1)
        rec.in_optimizer = depth[0] > 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        rec.note_saved(t)
        if t.grad_fn is None:
            return t
        # Returned as is, a tensor an op saves of its own output would hold that op's
        # autograd node, which holds the packed tensor: a cycle through C++ that no garbage
        # collection frees, so a graph kept with `retain_graph=True` (the pipeline's
        # zero-bubble input backward, `stage_backward_input`) would never free it.
        # PyTorch's SavedVariable keeps a saved output without its node for the same
        # reason (`SavedVariable::save_metadata`); a detached alias of the same storage
        # does the same here (its node is the saving op's own, restored on unpack).
        with _disable_current_modes():  # the alias is no op of the step: unrecorded
            return t.detach()

    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    grad_hooks = []
    for model in models:
        for p in model.parameters():
            if p.requires_grad:
                grad_hooks.append(p.register_post_accumulate_grad_hook(lambda q: _mark_gradient(rec, q, names)))
    h_pre = register_optimizer_step_pre_hook(pre_step)
    h_post = register_optimizer_step_post_hook(post_step)
    try:
        with rec.module_hooks(models), torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
    finally:
        h_pre.remove()
        h_post.remove()
        for h in grad_hooks:
            h.remove()
        rec.in_optimizer = False


def capture(
    step_fn: Callable[..., Any],
    *args: Any,
    model: torch.nn.Module | list[torch.nn.Module] | None = None,
    optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer] | None = None,
    iterations: int = 1,
    warmup: int = 0,
    meta: dict[str, Any] | None = None,
    record_flops: bool = True,
    inputs: Any = None,
    recorder: Recorder | None = None,
    **kwargs: Any,
) -> Trace:
    """Run `step_fn(*args, **kwargs)` `warmup` times untraced, then `iterations` times
    under the recorder, and return the trace of the traced iterations.

    Give `model` and `optimizer` so that every parameter, gradient and optimizer
    state is in the trace from its first event, even if the step never touches it.
    Tensors in `args`/`kwargs`, and in `inputs` (for a step that closes over its
    batch), are the step's inputs. `recorder` records with a `Recorder` subclass
    (e.g. the DTensor-aware one of `memplan.parallel.traced`) instead of a plain one. Works on real tensors and on
    fake ones (call it inside the `FakeTensorMode` that made them); on fake tensors a
    mixture-of-experts step's `grouped_mm` runs in every dtype, as on CUDA
    (`memplan.capture.grouped_mm`).
    """
    grouped_mm.register()
    if iterations < 1:
        raise ValueError("iterations must be >= 1")
    models = [model] if isinstance(model, torch.nn.Module) else list(model or [])
    optimizers = (
        [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer or [])
    )
    with masks_as_on_real_tensors():
        return _capture(step_fn, args, kwargs, models, optimizers, iterations, warmup, meta,
                        recorder or Recorder(record_flops=record_flops), inputs)


def _capture(
    step_fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    models: list[torch.nn.Module],
    optimizers: list[torch.optim.Optimizer],
    iterations: int,
    warmup: int,
    meta: dict[str, Any] | None,
    rec: Recorder,
    inputs: Any,
) -> Trace:
    for _ in range(warmup):
        step_fn(*args, **kwargs)
    for m in models:
        _mark_model(rec, m)
    for opt in optimizers:
        _mark_optimizer(rec, opt, _parameter_names(models))
    for t in _tensors((args, kwargs, inputs)):
        rec.mark(t, "input")
    start = time.perf_counter()
    with _recording_hooks(rec, models, optimizers), rec.extra_hooks(), rec:
        for it in range(iterations):
            rec.iteration = it
            rec.microbatch = 0
            rec.reset_phase()
            step_fn(*args, **kwargs)
    info = {"capture_s": round(time.perf_counter() - start, 3), "iterations": iterations, "warmup": warmup,
            "trainable_bytes": _trainable_bytes(optimizers)}
    info.update(meta or {})
    return rec.finish(meta=info)


class LiveCapture:
    """A capture opened and closed by two calls instead of around one function call: what a
    training loop's own hooks use (`memplan.watch`) to record the iteration the loop runs.

    `begin()` marks the model's and optimizers' tensors and the given inputs, installs the
    phase and category hooks and enters the recorder; `end()` leaves them and returns the
    validated trace, as `capture` does. `abandon()` leaves them and keeps nothing. Between
    the two, whatever runs on this thread is recorded (the recorder is a dispatch mode):
    `begin` and `end` must be called with the same modes above it, e.g. from the same
    module's forward pre-hook or from a loop's top level.
    """

    def __init__(self, models: list[torch.nn.Module], optimizers: list[torch.optim.Optimizer], *,
                 recorder: Recorder | None = None, record_flops: bool = True) -> None:
        self.models = models
        self.optimizers = optimizers
        self.recorder = recorder or Recorder(record_flops=record_flops)
        self._stack: contextlib.ExitStack | None = None
        self._start = 0.0

    @property
    def recording(self) -> bool:
        return self._stack is not None

    def begin(self, inputs: Any = None) -> None:
        rec = self.recorder
        for m in self.models:
            _mark_model(rec, m)
        for opt in self.optimizers:
            _mark_optimizer(rec, opt, _parameter_names(self.models))
        for t in _tensors(inputs):
            rec.mark(t, "input")
        stack = contextlib.ExitStack()
        stack.enter_context(masks_as_on_real_tensors())
        stack.enter_context(_recording_hooks(rec, self.models, self.optimizers))
        stack.enter_context(rec.extra_hooks())
        stack.enter_context(rec)
        self._stack = stack
        self._start = time.perf_counter()

    def end(self, meta: dict[str, Any] | None = None) -> Trace:
        """Stop recording; the trace of what ran since `begin`."""
        if self._stack is None:
            raise RuntimeError("LiveCapture.end() without begin()")
        stack, self._stack = self._stack, None
        stack.close()
        info = {"capture_s": round(time.perf_counter() - self._start, 3), "iterations": 1, "warmup": 0,
                "trainable_bytes": _trainable_bytes(self.optimizers)}
        info.update(meta or {})
        return self.recorder.finish(meta=info)

    def abandon(self) -> None:
        """Stop recording and keep nothing (the step raised)."""
        if self._stack is not None:
            stack, self._stack = self._stack, None
            stack.close()
        self.recorder.active = False
