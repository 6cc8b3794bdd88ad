"""The live job's step on fake tensors: the estimate `memplan.watch` sets beside its measurement.

`faked(model, optimizer, mode)` swaps, for the duration of a `with` block, every parameter,
buffer, gradient and optimizer state of the *live* objects for a fake copy made by
`FakeTensorMode.from_tensor` (same shape, dtype, device and strides, no memory), and puts the
real ones back on exit, also when the step raises. The model, the optimizer and the step
function are the user's own objects and code, so what runs on the fake copies is the job's
step itself: its forward, its loss, backward, clipping, the optimizer's update (foreach,
fused or per-parameter, as the live optimizer is configured) and `zero_grad`.

Limits (docs/watch.md): a step function that holds a tensor of the model or the optimizer in
a closure (not reached through the objects) runs that tensor for real; Python-side state the
step changes (a learning-rate scheduler's counter, an optimizer's `_step_count`) is changed
by the fake run too, so `estimate_live_step` does not step schedulers; random numbers drawn
on fake tensors are not drawn (dropout masks are fake), which changes no size.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map

from memplan.errors import UserError
from memplan.models.live import ForwardCall


def innermost_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The `torch.optim.Optimizer` that holds the state: `optimizer` itself, or the one a
    wrapper keeps as `.optimizer` (accelerate's `AcceleratedOptimizer`, Lightning's
    `LightningOptimizer` keeps it as `._optimizer`)."""
    seen = 0
    while optimizer is not None and seen < 8:
        inner = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
        if inner is None or inner is optimizer:
            break
        optimizer, seen = inner, seen + 1
    return optimizer if isinstance(optimizer, torch.optim.Optimizer) else None


class _Swaps:
    """The real tensors taken out of the live objects, to be put back."""

    def __init__(self, mode: FakeTensorMode) -> None:
        self.mode = mode
        self.fakes: dict[int, torch.Tensor] = {}
        self.undo: list[Callable[[], None]] = []

    def fake(self, t: torch.Tensor) -> torch.Tensor:
        f = self.fakes.get(id(t))
        if f is None:
            f = self.fakes[id(t)] = fake_copy(self.mode, t)
        return f

    def restore(self) -> None:
        while self.undo:
            self.undo.pop()()


def _swap_module(swaps: _Swaps, module: torch.nn.Module) -> None:
    for table_name in ("_parameters", "_buffers"):
        table = getattr(module, table_name)
        for name, real in list(table.items()):
            if real is None:
                continue
            fake = swaps.fake(real)
            if table_name == "_parameters" and real.grad is not None and fake.grad is None:
                fake.grad = swaps.fake(real.grad)
            table[name] = fake
            swaps.undo.append(lambda table=table, name=name, real=real: table.__setitem__(name, real))


def _swap_optimizer(swaps: _Swaps, optimizer: torch.optim.Optimizer) -> None:
    for group in optimizer.param_groups:
        real_params = group["params"]
        group["params"] = [swaps.fake(p) for p in real_params]
        swaps.undo.append(lambda group=group, real=real_params: group.__setitem__("params", real))
    real_state = optimizer.state
    fake_state: defaultdict = defaultdict(dict)
    for p, state in real_state.items():
        key = swaps.fake(p) if isinstance(p, torch.Tensor) else p
        fake_state[key] = {k: swaps.fake(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    optimizer.state = fake_state
    swaps.undo.append(lambda: setattr(optimizer, "state", real_state))


@contextlib.contextmanager
def faked(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
          mode: FakeTensorMode) -> Iterator[_Swaps]:
    """Inside the block, `model` and `optimizer` hold fake copies of their tensors (see the
    module docstring); `swaps.fake(t)` gives the fake copy of any other tensor."""
    swaps = _Swaps(mode)
    try:
        for module in model.modules():
            _swap_module(swaps, module)
        if optimizer is not None:
            _swap_optimizer(swaps, optimizer)
        yield swaps
    finally:
        swaps.restore()


def fake_copy(mode: FakeTensorMode, t: torch.Tensor) -> torch.Tensor:
    """A fake copy of `t`. A one-element tensor that is not a parameter (an optimizer's `step`
    counter) keeps a copy of its value as the fake tensor's constant, as a tensor made under
    the mode by `torch.tensor` does, so that the step can read it (`.item()`) as the real one."""
    if t.numel() <= 1 and not isinstance(t, torch.nn.Parameter) and t.device.type == "cpu":
        return mode.fake_tensor_converter.from_real_tensor(mode, t.detach().clone(), make_constant=True)
    return mode.from_tensor(t)


def fake_inputs(mode: FakeTensorMode, call: ForwardCall) -> ForwardCall:
    """A forward call's arguments with every tensor replaced by a fake copy (no memory)."""
    return tree_map(lambda x: fake_copy(mode, x) if isinstance(x, torch.Tensor) else x, call)


def loss_of(output: Any) -> torch.Tensor:
    """The loss a model's forward returned: `.loss` / `["loss"]` (Hugging Face models given
    labels), or the output itself when it is a scalar tensor."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if loss is None and isinstance(output, torch.Tensor) and output.dim() == 0:
        loss = output
    if loss is None:
        raise UserError("memplan.watch cannot tell the loss from the model's output (no .loss and not a "
                        "scalar): pass step_fn=, your step as a function, for the estimate")
    return loss


def standard_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, calls: list[ForwardCall], *,
                  scale_loss: bool, clip_norm: float | None,
                  autocast: tuple[str, torch.dtype] | None, closure: bool = False) -> Callable[[], None]:
    """The step a Hugging Face-style loop runs, over the forward calls seen in the measured
    step: per call `loss = model(...).loss` (the output object dropped at once, as
    `Trainer.compute_loss` returns the loss alone), divided by the number of calls when
    `scale_loss`, `loss.backward()`; then `clip_grad_norm_` when `clip_norm` is given
    (`Trainer._clip_grad_norm`, or `float("inf")` for the norm it logs), `optimizer.step()`
    and `zero_grad(set_to_none=True)` (the model's `zero_grad` alone without an optimizer).

    `closure=True` is Lightning's automatic optimization instead
    (`lightning/pytorch/loops/optimization/automatic.py`: `Closure.closure` runs the training
    step, then the zero-grad function, which only the first batch of an accumulation has, then
    backward; the last batch's closure runs inside `optimizer.step(closure)`, with clipping
    after it in `Precision._wrap_closure`); the gradients stay live after the step."""

    def loss_of_call(args: tuple, kwargs: dict) -> torch.Tensor:
        with torch.autocast(autocast[0], dtype=autocast[1]) if autocast else contextlib.nullcontext():
            loss = loss_of(model(*args, **kwargs))
        return loss / len(calls) if scale_loss and len(calls) > 1 else loss

    def step() -> None:
        for args, kwargs in calls:
            loss = loss_of_call(args, kwargs)
            loss.backward()
            del loss
        if clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        else:
            model.zero_grad(set_to_none=True)

    def closure_step() -> None:
        last = len(calls) - 1
        for i, (args, kwargs) in enumerate(calls):
            def body(i: int = i, args: tuple = args, kwargs: dict = kwargs) -> None:
                loss = loss_of_call(args, kwargs)
                if i == 0:
                    optimizer.zero_grad(set_to_none=True)
                loss.backward()
                del loss
                if i == last and clip_norm is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)

            if i == last:
                optimizer.step(body)
            else:
                body()

    if closure and optimizer is None:
        raise UserError("memplan.watch: a closure step needs the optimizer")
    return closure_step if closure else step
