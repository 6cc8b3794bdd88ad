"""Where a running program's training steps begin and end, and when it is stopped.

`StepWindow` sees every module call (`torch.nn.Module._call_impl`, wrapped: a global
forward pre-hook would not see the call's keyword arguments, which are a Hugging Face
model's batch) and PyTorch's global optimizer step pre-/post-hooks
(`torch.optim.optimizer.register_optimizer_step_pre_hook`), the same events `memplan.watch`
counts iterations by (docs/watch.md). In the program's terms:

- a *top-level call* is a forward of a module with parameters that no other module's
  forward is running around (`model(batch)`, not its blocks);
- the window opens at the first top-level call (`on_open`), before anything of the step
  has run: what exists then (parameters, the batch) is what the step starts with. Python's
  cycle collector runs first (`gc.collect()`): what the program left unreachable while
  loading (transformers' `safe_open` handles, a file's bytes) would otherwise be freed at
  whatever point of the step the collector next runs, differently in every run;
- iteration k ends with the program's k-th optimizer step (`on_step`); gradient
  accumulation is every top-level call between two steps;
- a step given a closure (`optimizer.step(closure)`, torch/optim/optimizer.py: Lightning's
  automatic optimization runs `training_step` and `backward` in it, as LBFGS re-evaluates
  the loss) runs the closure as outside the step: its model calls are the iteration's
  top-level calls, not the optimizer's work (the pre-hook returns the step's arguments with
  the closure wrapped, as `register_optimizer_step_pre_hook` allows);
- optimizer steps taken inside autograd's backward (the optimizer in backward: one
  optimizer per parameter stepped by its post-accumulate-grad hook, PyTorch's tutorial
  "How to save memory by fusing the optimizer step into the backward pass", torchtune's
  `optimizer_in_bwd`) are together one step, which ends when that backward ends (a callback
  queued on autograd's engine, `Variable._execution_engine.queue_callback`, as FSDP's
  post-backward runs; torch/distributed/fsdp/_runtime_utils.py); `on_step` gets every
  optimizer the step took, and `step_in_backward` says it was taken so;
- a wrapper that is itself an Optimizer and steps optimizers of its own (torchtitan's
  `OptimizersContainer`, one per model part) takes one step: `on_step` gets the optimizers it
  stepped, which hold the states, not the wrapper;
- after `stop_after` optimizer steps, the program is stopped at its next top-level call or
  optimizer step (`ProgramStop`), so the last iteration's `zero_grad`, logging and next
  batch have run, as in the watch's iterations;
- `max_seconds`: a program that takes no optimizer step for that long (its first included,
  data loading counted) is stopped with `ProgramTimeout` (a real-time interval timer,
  `signal.setitimer`, reset at each step; in the main thread only). The timer repeats every
  `RETRY_S` after it first expires: Python runs a signal handler between bytecodes of
  whatever runs then, a finaliser or weakref callback included, whose exception the
  interpreter prints and drops ("Exception ignored in"); the next expiry raises again.

The same window drives memplan's trace of the program (memplan.program.runner) and the
profiler of its real run (memplan.program.groundtruth), so both cover the same steps.
Both exceptions derive from `BaseException`: a program's own `except Exception` does not
swallow them.
"""

from __future__ import annotations

import gc
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

RETRY_S = 2.0  # the timeout's repeat once it has expired (module docstring)


class ProgramStop(BaseException):  # noqa: N818 - a stop, not an error
    """The program took the optimizer steps asked for: memplan stops it here."""


class ProgramTimeout(BaseException):  # noqa: N818 - raised through the program
    """The program took no optimizer step within `max_seconds`."""


Call = tuple[torch.nn.Module, tuple, dict]


class StepWindow:
    """The program's iterations and its stop (module docstring)."""

    def __init__(self, stop_after: int, *, on_open: Callable[[Call], None] | None = None,
                 on_call: Callable[[Call], None] | None = None,
                 on_step: Callable[[list[torch.optim.Optimizer], int], None] | None = None,
                 on_return: Callable[[Any], None] | None = None,
                 on_first_child: Callable[[torch.nn.Module], None] | None = None,
                 max_seconds: float | None = None) -> None:
        self.stop_after = stop_after
        self.on_open, self.on_call, self.on_step, self.on_return = on_open, on_call, on_step, on_return
        self.on_first_child = on_first_child  # the first module called inside the first top-level call
        self._child_seen = False
        self.max_seconds = max_seconds
        self.depth = 0  # module forwards running
        self.optimizer_depth = 0
        self.steps = 0
        self.calls = 0  # top-level calls
        self.opened = False
        self.stopped = False
        self.started_s = time.perf_counter()
        self.first_step_s: float | None = None  # seconds from the start to the first optimizer step
        self._handles: list[Any] = []
        self._original_call: Any = None
        self._timer = False
        self._previous_handler: Any = signal.SIG_DFL
        self._expired: Any = None  # this window's SIGALRM handler, once armed
        self._has_parameters: dict[int, bool] = {}
        self._backward_optimizers: list[torch.optim.Optimizer] = []  # stepped in the running backward
        self._inner: list[torch.optim.Optimizer] = []  # stepped inside the running step of a wrapper
        self._marks: list[int] = []  # len(self._inner) at each running step's start
        self.step_in_backward = False  # whether the last step counted was taken inside a backward

    def install(self) -> None:
        original = self._original_call = torch.nn.Module._call_impl
        window = self

        def call_impl(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            top = window.depth == 0 and window.optimizer_depth == 0 and window._top_level(module) \
                and not _in_backward()  # a recomputation in backward is no new call
            if top:
                window._top_call(module, args, kwargs)
            elif window.depth == 1 and window.on_first_child is not None and not window._child_seen:
                window._child_seen = True
                window.on_first_child(module)
            window.depth += 1
            try:
                out = original(module, *args, **kwargs)
            finally:
                window.depth -= 1
            if top and window.on_return is not None:
                window.on_return(out)
            return out

        torch.nn.Module._call_impl = call_impl
        self._handles = [register_optimizer_step_pre_hook(self._pre_step),
                         register_optimizer_step_post_hook(self._post_step)]
        self._arm_timer()

    def remove(self) -> None:
        if self._original_call is not None:
            torch.nn.Module._call_impl = self._original_call
            self._original_call = None
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._timer:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self._previous_handler)
            self._timer = False

    def _arm_timer(self) -> None:
        if not self.max_seconds or threading.current_thread() is not threading.main_thread():
            return

        def expired(_signum: int, _frame: Any) -> None:
            raise ProgramTimeout(f"the program took no optimizer step in {self.max_seconds:g} s "
                                 f"(after {self.steps} steps): give --max-seconds more, or check that it trains")

        self._previous_handler = signal.signal(signal.SIGALRM, expired)
        self._expired = expired
        signal.setitimer(signal.ITIMER_REAL, float(self.max_seconds), RETRY_S)
        self._timer = True

    def _top_level(self, module: torch.nn.Module) -> bool:
        key = id(module)
        if key not in self._has_parameters:
            self._has_parameters[key] = next(module.parameters(), None) is not None
        return self._has_parameters[key]

    def _stop_if_done(self) -> None:
        if self.steps >= self.stop_after and not self.stopped:
            self.stopped = True
            raise ProgramStop()

    def _top_call(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        self._stop_if_done()
        self.calls += 1
        call = (module, args, kwargs)
        if not self.opened:
            self.opened = True
            gc.collect()
            if self.on_open is not None:
                self.on_open(call)
        if self.on_call is not None:
            self.on_call(call)

    def _pre_step(self, _optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if self.optimizer_depth == 0 and not _in_backward():
            self._stop_if_done()
        self.optimizer_depth += 1
        self._marks.append(len(self._inner))
        return self._closure_outside_step(args, kwargs)

    def _closure_outside_step(self, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """The step's arguments with its closure run outside the step (module docstring); None
        for a step without a closure (a pre-hook's None leaves the arguments as they are)."""
        closure = kwargs.get("closure", args[0] if args else None)
        if not callable(closure):
            return None

        def closure_outside_step() -> Any:
            depth, self.optimizer_depth = self.optimizer_depth, 0
            try:
                return closure()
            finally:
                self.optimizer_depth = depth

        if "closure" in kwargs:
            return args, {**kwargs, "closure": closure_outside_step}
        return (closure_outside_step, *args[1:]), kwargs

    def _post_step(self, optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        self.optimizer_depth = max(0, self.optimizer_depth - 1)
        mark = self._marks.pop() if self._marks else 0
        wrapper = len(self._inner) > mark  # it stepped optimizers of its own: they hold the states
        if self.optimizer_depth:
            if not wrapper:
                self._inner.append(optimizer)  # an inner optimizer of a wrapper that is itself an Optimizer
            return
        stepped, self._inner = (self._inner[mark:] if wrapper else [optimizer]), []
        if _in_backward():
            if not self._backward_optimizers:
                torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)
            self._backward_optimizers.extend(stepped)
            return
        self._count_step(stepped, in_backward=False)

    def _backward_ended(self) -> None:
        optimizers, self._backward_optimizers = self._backward_optimizers, []
        self._count_step(optimizers, in_backward=True)

    def _count_step(self, optimizers: list[torch.optim.Optimizer], *, in_backward: bool) -> None:
        self.step_in_backward = in_backward
        self.steps += 1
        if self.first_step_s is None:
            self.first_step_s = time.perf_counter() - self.started_s
        if self._timer and signal.getsignal(signal.SIGALRM) is self._expired:
            # re-armed only while SIGALRM is still this window's: an alarm under another
            # handler (the default one terminates the process) is never set from here
            signal.setitimer(signal.ITIMER_REAL, float(self.max_seconds), RETRY_S)
        if self.on_step is not None:
            self.on_step(optimizers, self.steps)


def _in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread."""
    return torch._C._current_graph_task_id() != -1
