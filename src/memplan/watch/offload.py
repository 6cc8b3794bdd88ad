"""`memplan.watch(..., offload_plan=PATH | "auto")`: the offload runtime in the job's own loop.

Iteration N (the watch's `step`) is measured as it is, without offloading, so that its
comparison with the estimate holds. From the start of iteration N+1 until the watch closes
the loop runs inside `memplan.offload.run(model, optimizer, plan, RunOptions(...))`: the
optimizer states (and, with `streamed_step`, gradients) and the saved activations the plan
moves go to files under `offload_dir` after their last use and come back ahead of their next
(docs/offload.md, "The runtime").

- `offload_plan=PATH`: a plan file `memplan offload TRACE --plan-output PATH` wrote from a
  trace of this very step captured with names (`memplan.capture` with the model and
  optimizer). It is read and checked against the model when the watch starts (a plan of
  another model, or one that moves what the runtime does not, is refused in one line).
- `offload_plan="auto"`: when iteration N ends, its measured trace (memplan's recorder names
  every state and gradient as the runtime keys them and lists the forward's saved storages)
  is planned with `plan_offload` within `offload_budget` (on cuda by default the device's
  memory less the CUDA context and cuBLAS workspace, `default_budget_bytes`), among what the
  runtime moves (`runtime_categories`), with the op times of the device profile's roofline
  (cuda: the watched device's profile; cpu: `gpu=`, else `CPU_PLAN_PROFILE`). The plan is
  written to `offload-plan.json`.

`offload.json` under the watch's `out_dir` says what ran: the plan (its file, budget,
planned peak before and after, feasible), the iterations served, the state and gradient
keys written, the saved storages written, bytes written and read, tensors kept on the host
after a failed write (`degraded`).

Refused in one line: with `planned_allocator=True` (a plan of step N-1's addresses does not
hold once offloading frees storages) and with a cpu `capacity` (the capacity counts tensors'
storages, and the runtime releases an offloaded tensor's bytes by resizing its storage,
which that count does not see: give `offload_budget` instead).
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Any

from memplan.errors import UserError
from memplan.offload import (
    OffloadPlan,
    RunOptions,
    default_budget_bytes,
    load_offload_plan,
    make_hardware,
    plan_offload,
    runtime_categories,
    save_offload_plan,
)
from memplan.offload.runtime import plan_choices, run
from memplan.trace.model import Trace
from memplan.units import format_bytes, parse_size

STATS_FILE = "offload.json"
PLAN_FILE = "offload-plan.json"
AUTO = "auto"
# The profile whose roofline times a cpu job's ops for an automatic plan when no `gpu=` is
# given (`memplan demo`'s GPU). The runtime's own timing decides when tensors move; the
# plan's op times decide which tensors it picks.
CPU_PLAN_PROFILE = "a10g"


def run_options(directory: Path, options: object) -> RunOptions:
    """`RunOptions` of the watch's `offload_options` (a dict of its fields but `directory`)."""
    if not isinstance(options, dict):
        raise UserError(f"memplan.watch: offload_options takes a dict of memplan.offload.RunOptions fields, "
                        f"not {type(options).__name__}")
    fields = set(RunOptions.__dataclass_fields__) - {"directory"}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise UserError(f"memplan.watch: offload_options has no field {unknown[0]!r}; "
                        f"use {', '.join(sorted(fields))}")
    return RunOptions(directory=directory, **options)


class OffloadedRun:
    """The offload runtime from iteration `target`+1 until the watch closes (module docstring)."""

    def __init__(self, watch: Any, spec: object, budget: int | str | None, directory: str | Path | None,
                 options: object) -> None:
        self.watch = watch
        self.target = watch.target
        self.options = run_options(Path(directory) if directory is not None else watch.out_dir / "offload",
                                   options if options is not None else {})
        self.auto = spec == AUTO
        self.budget_bytes = self._budget(budget)
        self.hardware = self._hardware() if self.auto else None  # an unknown profile is refused now, not mid-run
        self.plan_file: Path | None = None
        self.plan: OffloadPlan | None = None
        if not self.auto:
            if not isinstance(spec, (str, Path)):
                raise UserError(f"memplan.watch: offload_plan takes a plan file or \"auto\", not {spec!r}")
            if budget is not None:
                raise UserError("memplan.watch: offload_budget is for offload_plan=\"auto\"; a plan file has its own")
            self.plan_file = Path(spec)
            self.plan = load_offload_plan(self.plan_file)
            plan_choices(self.plan, watch.model, self.options)
        self._context: contextlib.AbstractContextManager | None = None
        self._engine: Any = None
        self.iterations = 0  # iterations run under the runtime
        self._index = 0  # the last watch iteration seen starting
        self.skipped: str | None = None  # why nothing ran, when nothing did
        self._closed = False

    def _budget(self, budget: int | str | None) -> int | None:
        if budget is not None:
            value = parse_size(budget) if isinstance(budget, (int, str)) and not isinstance(budget, bool) else 0
            if value <= 0:
                raise UserError(f"memplan.watch: offload_budget takes a size (\"8GiB\", bytes), not {budget!r}")
            return value
        if self.auto and self.watch.device == "cpu":
            raise UserError("memplan.watch: offload_plan=\"auto\" on cpu needs offload_budget= (the memory the "
                            "plan keeps each step under, e.g. \"1GiB\")")
        return None

    def _hardware(self) -> Any:
        if self.watch.device == "cuda":
            return make_hardware(self.watch.target_gpu())
        return make_hardware(self.watch.gpu or CPU_PLAN_PROFILE)

    def step_measured(self, trace: Trace) -> None:
        """Iteration `target` was measured: with "auto", plan it now."""
        if not self.auto or self.plan is not None or self._closed:
            return  # a step measured at the watch's close is not planned: no later step would run it
        try:  # inside the job's loop: a step memplan cannot plan says why and the job goes on unoffloaded
            budget = self.budget_bytes if self.budget_bytes is not None else default_budget_bytes(self.hardware)
            self.plan = plan_offload(trace, self.hardware, budget, min_nbytes=self.options.min_nbytes,
                                     categories=runtime_categories(streamed_step=self.options.streamed_step))
        except UserError as exc:
            self.skipped = f"step {self.target} could not be planned: {exc}"
            sys.stderr.write(f"memplan.watch: no offloading: {self.skipped}\n")
            return
        self.watch.out_dir.mkdir(parents=True, exist_ok=True)
        self.plan_file = self.watch.out_dir / PLAN_FILE
        save_offload_plan(self.plan, self.plan_file)
        if not self.plan.feasible:
            sys.stderr.write(f"memplan.watch: the offload plan of step {self.target} does not reach the budget "
                             f"({format_bytes(self.plan.peak_bytes_after)} planned against "
                             f"{format_bytes(budget)}); it runs, moving what it can\n")

    def iteration_starts(self, index: int) -> None:
        """Watch iteration `index` starts now: the runtime enters at iteration `target`+1."""
        if index <= max(self.target, self._index):
            return
        self._index = index
        if self._context is None and self.skipped is None:
            self._enter()
        if self._context is not None:
            self.iterations += 1

    def _enter(self) -> None:
        if self.plan is None:
            self.skipped = f"step {self.target} was not measured, so there was no plan to run"
            return
        if not self.plan.transfers:
            self.skipped = (f"the plan moves nothing: the step's peak ({format_bytes(self.plan.peak_bytes_before)}) "
                            f"is within its budget ({format_bytes(self.plan.budget_bytes)})")
            sys.stderr.write(f"memplan.watch: no offloading: {self.skipped}\n")
            return
        Path(self.options.directory).mkdir(parents=True, exist_ok=True)
        context = run(self.watch.model, self.watch.optimizer, self.plan, self.options)
        self._engine = context.__enter__()
        self._context = context

    def close(self, steps_done: int) -> Path:
        """Leave the runtime (states back on the device), write `offload.json`, return its path."""
        self._closed = True
        context, self._context = self._context, None
        if context is not None:
            context.__exit__(None, None, None)
        if self.skipped is None and self.iterations == 0:
            self.skipped = (f"the runtime runs from step {self.target + 1} and the run made {steps_done} steps; "
                            "watch an earlier step")
            sys.stderr.write(f"memplan.watch: the offload runtime ran no step: {self.skipped}\n")
        self.watch.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.watch.out_dir / STATS_FILE
        path.write_text(json.dumps(self.stats, indent=2, default=str) + "\n")
        return path

    @property
    def stats(self) -> dict[str, Any]:
        """What ran (module docstring); zeros before the runtime starts."""
        plan = self.plan
        engine = self._engine
        return {
            "plan_file": str(self.plan_file) if self.plan_file is not None else None,
            "planned_from_step": self.target if self.auto else None,
            "served_from_step": self.target + 1,
            "iterations": self.iterations,
            "skipped": self.skipped,
            "budget_bytes": plan.budget_bytes if plan is not None else self.budget_bytes,
            "planned_peak_bytes_before": plan.peak_bytes_before if plan is not None else None,
            "planned_peak_bytes_after": plan.peak_bytes_after if plan is not None else None,
            "feasible": plan.feasible if plan is not None else None,
            "keys_written": sorted(engine.keys_written) if engine is not None else [],
            "storages_written": engine.storages_written if engine is not None else 0,
            "bytes_written": engine.bytes_written if engine is not None else 0,
            "bytes_read": engine.bytes_read if engine is not None else 0,
            "degraded": list(engine.degraded) if engine is not None else [],
            "directory": str(self.options.directory),
        }
