"""`Watch`: memplan inside a running training job (docs/watch.md).

Iterations. The watch counts the job's optimizer steps (a post-hook on the innermost
`torch.optim.Optimizer`) and opens iteration k at the first forward call of the model after
the (k-1)-th step; the iteration ends at the next such forward, at `w.step()`, or when the
watch closes. A loop without a `torch.optim` step calls `w.step()` at the end of each
iteration: from its first call the watch counts those calls instead. Integrations
(`memplan.integrations`) drive the same two events from their framework's callbacks
(`begin_iteration` / `end_iteration`).

At iteration `step` it measures the real step (`memplan.watch.measure`), writes the
measured trace and its snapshot at once, and when the watch closes (or at the callback's
step end) traces the same step on fake copies of the live model and optimizer, estimates it
for the device, compares the two (`memplan.estimation.compare`) and writes the report.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import _disable_current_modes

from memplan.errors import UserError
from memplan.models.setup import TrainingSetup
from memplan.units import parse_size
from memplan.watch import oom
from memplan.watch.fake import ForwardCall, fake_inputs, innermost_optimizer
from memplan.watch.job import infer_setup, model_identity
from memplan.watch.measure import Measurement, StepFiles, analyse
from memplan.watch.offload import OffloadedRun
from memplan.watch.planned import PlannedRun, check_options


class Watch:
    """See `memplan.watch.watch`."""

    def __init__(self, model: torch.nn.Module, optimizer: Any = None, step: int = 2,
                 out_dir: str | Path = "memplan-watch", on_oom: bool = True, capacity: int | str | None = None,
                 setup: TrainingSetup | None = None, *, step_fn: Callable[[], Any] | None = None,
                 gpu: str | None = None, clip_norm: float | None = None, profile: bool = True,
                 closure: bool = False, driver: str = "hooks", planned_allocator: bool = False,
                 offload_plan: str | Path | None = None, offload_budget: int | str | None = None,
                 offload_dir: str | Path | None = None, offload_options: dict[str, Any] | None = None) -> None:
        if not isinstance(model, torch.nn.Module):
            raise UserError(f"memplan.watch watches a torch.nn.Module, not {type(model).__name__}")
        if not any(True for _ in model.parameters()):
            raise UserError(f"memplan.watch: {type(model).__name__} has no parameters: watch the module the "
                            "optimizer trains")
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise UserError(f"memplan.watch: step must be a whole number >= 1 (the iteration to measure), not {step!r}")
        if setup is not None and not isinstance(setup, TrainingSetup):
            raise UserError("memplan.watch: setup= takes a memplan.models.TrainingSetup")
        self.model = model
        self.optimizer = innermost_optimizer(optimizer)
        if optimizer is not None and self.optimizer is None:
            raise UserError(f"memplan.watch: {type(optimizer).__name__} is not a torch.optim.Optimizer (nor wraps one)")
        self.target = step
        self.out_dir = Path(out_dir)
        self.on_oom = on_oom
        self.capacity_bytes = parse_size(capacity) if capacity is not None else None
        self.user_setup = setup
        self.step_fn = step_fn
        self.gpu = gpu
        self.clip_norm = clip_norm
        self.profile = profile
        self.closure = closure
        self.driver = driver
        self.device = next(model.parameters()).device.type
        if self.device not in ("cpu", "cuda"):
            raise UserError(f"memplan.watch measures cpu and cuda jobs, not {self.device}")
        self._planned = PlannedRun(step, self.out_dir) if check_options(planned_allocator, step, self.device) \
            else None
        self._offload = self._offloaded_run(offload_plan, offload_budget, offload_dir, offload_options)
        self.context_bytes: int | None = None  # cuda: device memory outside PyTorch's at the start
        self.fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.identity = model_identity(model)
        self.result: dict[str, Any] | None = None
        self.oom_files: dict[str, str] | None = None
        self._optimizer_steps = 0
        self._manual_steps: int | None = None
        self._open: Measurement | None = None  # the iteration being recorded, if any
        self._open_index = 0
        self._stepped_since_open = False
        self._calls: list[ForwardCall] = []  # the forward calls of the open iteration (fake copies)
        self._measured_calls: list[ForwardCall] = []  # those of the measured one
        self._autocast: tuple[str, torch.dtype] | None = None
        self._measured: StepFiles | None = None
        self._hooks: list[Any] = []
        self._oom_guard: Any = None
        self._closed = False
        self.allocator_file: Path | None = None  # allocator.json, once closed (planned_allocator=True)
        self.offload_file: Path | None = None  # offload.json, once closed (offload_plan=...)

    def _offloaded_run(self, spec: object, budget: int | str | None, directory: str | Path | None,
                       options: dict[str, Any] | None) -> OffloadedRun | None:
        """The offload runtime of `offload_plan` (`memplan.watch.offload`), or None."""
        if spec is None:
            if budget is not None or directory is not None or options is not None:
                raise UserError("memplan.watch: offload_budget, offload_dir and offload_options go with "
                                "offload_plan (a plan file or \"auto\")")
            return None
        if self._planned is not None:
            raise UserError("memplan.watch: planned_allocator=True and offload_plan do not compose: the allocator's "
                            "plan of step-1's addresses does not hold once offloading frees storages; choose one")
        if self.capacity_bytes is not None:
            raise UserError("memplan.watch: capacity= counts tensors' storages and the offload runtime releases "
                            "bytes by resizing them, which that count does not see: give offload_budget= instead")
        return OffloadedRun(self, spec, budget, directory, options)

    @property
    def offload_stats(self) -> dict[str, Any] | None:
        """What the offload runtime did (offload_plan=...; `memplan.watch.offload`), else None."""
        return self._offload.stats if self._offload is not None else None

    @property
    def allocator_stats(self) -> dict[str, Any] | None:
        """The planned allocator's stats (planned_allocator=True; `memplan.watch.planned`), else None."""
        return self._planned.stats if self._planned is not None else None

    # -- counting -------------------------------------------------------------------------
    @property
    def steps_done(self) -> int:
        return self._manual_steps if self._manual_steps is not None else self._optimizer_steps

    def _after_optimizer_step(self, *_args: Any) -> None:
        self._optimizer_steps += 1
        self._stepped_since_open = True

    def _before_forward(self, _module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if self._open is not None and self._stepped_since_open and self._manual_steps is None \
                and self.driver == "hooks":
            self.end_iteration()
        if self._open is None and self.driver == "hooks" and self._wants(self.steps_done + 1):
            self.begin_iteration(inputs=(args, kwargs))
        if self.driver == "hooks":
            self._iteration_starts(self.steps_done + 1)
        if self._open is not None:
            self._observe_call(args, kwargs)

    def _wants(self, index: int) -> bool:
        """Whether iteration `index` is recorded: the measured one, or every one under a cpu capacity."""
        return index == self.target or bool(getattr(self._oom_guard, "records_every_step", False))

    def _observe_call(self, args: tuple, kwargs: dict) -> None:
        if self.driver != "hooks":  # a callback opened the iteration before the batch reached the model
            self._open.mark_inputs((args, kwargs))
        with _disable_current_modes():
            self._calls.append(fake_inputs(self.fake_mode, (args, kwargs)))
        device = self.device if self.device in ("cpu", "cuda") else "cpu"
        if torch.is_autocast_enabled(device):
            self._autocast = (device, torch.get_autocast_dtype(device))

    # -- the watch's life ---------------------------------------------------------------------
    def __enter__(self) -> Watch:
        self.start()
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        self.close(exc)
        return None

    def start(self) -> None:
        """Install the hooks (and the out-of-memory guard) for the run."""
        self._hooks.append(self.model.register_forward_pre_hook(self._before_forward, with_kwargs=True))
        if self.optimizer is not None:
            self._hooks.append(self.optimizer.register_step_post_hook(self._after_optimizer_step))
        if self.device == "cuda":
            from memplan.watch.cuda import outside_reserved_bytes

            self.context_bytes = outside_reserved_bytes()
        self._oom_guard = self._install_guard() if self.on_oom else None

    def _install_guard(self) -> Any:
        """The out-of-memory guard of the device, or None (cpu without a capacity)."""
        if self.device == "cuda":
            from memplan.watch.cuda import CudaGuard

            return CudaGuard(self)
        return oom.CpuGuard(self) if self.capacity_bytes is not None else None

    def _start_measurement(self, inputs: Any, measured: bool) -> Measurement:
        if self.device == "cuda":
            from memplan.watch.cuda import CudaMeasurement

            return CudaMeasurement(self, inputs, measured)
        return Measurement(self, inputs, measured)

    def device_terms(self) -> tuple[Any, int | None]:
        """The device profile and measured context the estimate uses (none on cpu)."""
        if self.device != "cuda":
            return None, None
        from memplan.watch.cuda import device_terms

        return device_terms(self)

    def target_gpu(self) -> str:
        """The device profile name fit searches after a CUDA out-of-memory error."""
        from memplan.watch.cuda import target_gpu

        return target_gpu(self)

    def step(self) -> None:
        """Mark the end of an iteration (loops without a `torch.optim` step; see the module docstring)."""
        if self._manual_steps is None:
            self._manual_steps = 0
        self._manual_steps += 1
        if self._open is not None:
            self.end_iteration()

    def begin_iteration(self, inputs: Any = None) -> None:
        """Iteration `steps_done + 1` starts now (callbacks call it; the hooks do otherwise)."""
        if self._open is not None or self._closed:
            return
        index = self.steps_done + 1
        self._iteration_starts(index)  # before the measurement opens: its set-up is in no planned step
        if self._wants(index):
            self._open_index = index
            self._stepped_since_open = False
            self._calls = []
            self._open = self._start_measurement(inputs, index == self.target)

    def _iteration_starts(self, index: int) -> None:
        """Tell the runtime engines (planned allocator, offload runtime) that iteration `index` starts."""
        if self._planned is not None:
            self._planned.iteration_starts(index)
        if self._offload is not None:
            self._offload.iteration_starts(index)

    def end_iteration(self, steps_done: int | None = None) -> None:
        """The open iteration ends now; `steps_done` sets the count (a framework's global step)."""
        if steps_done is not None:
            self._manual_steps = steps_done
        open_, self._open = self._open, None
        if open_ is None:
            return
        files = open_.finish(self)
        if files is not None:
            self._measured = files
            self._measured_calls = self._calls
            if self._offload is not None:
                self._offload.step_measured(files.trace)

    def close(self, exc: BaseException | None = None) -> dict[str, Any] | None:
        """Stop watching; analyse the measured step (unless the run raised); report a
        measured step the run never reached. Returns the result (also `self.result`)."""
        if self._closed:
            return self.result
        self._closed = True
        if self._planned is not None:
            self.allocator_file = self._planned.close(self.steps_done)
        if self._offload is not None:  # before the estimate's fake step: the runtime's hooks are out
            self.offload_file = self._offload.close(self.steps_done)
        if self._open is not None:
            if exc is None:
                self.end_iteration()
            else:
                self._open.abandon()
                self._open = None
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        if self._oom_guard is not None:
            self._oom_guard.remove()
        if self._measured is None:
            if exc is None:
                sys.stderr.write(f"memplan.watch: step {self.target} was never reached (the run made "
                                 f"{self.steps_done} steps): nothing was measured; watch an earlier step\n")
            return None
        if exc is None and self.result is None:
            self.analyse()
        return self.result

    def analyse(self) -> dict[str, Any]:
        """Estimate the measured step on fake tensors, compare, write the report."""
        setup, unseen = (self.user_setup, []) if self.user_setup is not None else infer_setup(
            self.model, self.optimizer, self._measured_calls, self._autocast)
        self.result = analyse(self, self._measured, setup, unseen)
        if self.allocator_file is not None:
            self.result["allocator"] = str(self.allocator_file)
        if self.offload_file is not None:
            self.result["offload"] = str(self.offload_file)
        (self.out_dir / "watch.json").write_text(json.dumps(self.result, indent=2, default=str) + "\n")
        return self.result

    def setup_for_suggestions(self) -> tuple[TrainingSetup, list[str]]:
        if self.user_setup is not None:
            return self.user_setup, []
        return infer_setup(self.model, self.optimizer, self._calls or self._measured_calls, self._autocast)


def watch(model: torch.nn.Module, optimizer: Any = None, step: int = 2, out_dir: str | Path = "memplan-watch",
          on_oom: bool = True, capacity: int | str | None = None, setup: TrainingSetup | None = None,
          **options: Any) -> Watch:
    """Watch a training job: measure iteration `step` (1 = the first), estimate the same step,
    compare, report, and turn an out-of-memory error into changes that fit. A context manager::

        with memplan.watch(model, optimizer, step=3, out_dir="memplan-watch") as w:
            for batch in loader:          # the loop as it is: the watch hooks the model's
                loss = model(**batch).loss   # forward and optimizer.step() to find iterations
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
        print(w.result["compare"]["figures"])

    `capacity` (a size: "24GiB", bytes) is the device memory an out-of-memory check holds the
    job to on cpu (on cuda the device's own). `setup` (a `TrainingSetup`) replaces what the watch
    infers of the job (used for the suggestions after an out-of-memory error). Options:
    `step_fn` (the step as a function of no arguments, run on fake tensors for the estimate
    instead of the standard one), `gpu` (a device profile name, for cuda), `clip_norm` (the
    standard step clips gradients to it), `profile` (False: no torch.profiler timeline beside the
    cpu measurement), `closure` (the standard step runs as `optimizer.step(closure)`, Lightning's
    automatic optimization), `planned_allocator` (True, cpu, `step` >= 3: iterations before `step` are
    recorded at the allocator, `step`-1 is planned, and from `step`+1 the loop's allocations are
    served from the plan; stats in `w.allocator_stats` and `allocator.json`, `memplan.watch.planned`),
    `offload_plan` (a plan file of `memplan offload --plan-output`, or "auto": plan the measured
    step within `offload_budget`; from `step`+1 the loop runs under the offload runtime, files in
    `offload_dir`, `offload_options` a dict of `memplan.offload.RunOptions` fields; stats in
    `w.offload_stats` and `offload.json`, `memplan.watch.offload`).
    See docs/watch.md.
    """
    return Watch(model, optimizer, step, out_dir, on_oom, capacity, setup, **options)
