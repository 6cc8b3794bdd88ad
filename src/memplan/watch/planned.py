"""`memplan.watch(..., planned_allocator=True)`: the job's own loop, recorded, planned, served.

Iterations 1..N-1 (N = the watch's `step`, the measured one) run under the recording allocator
(`memplan.runtime.recording.AllocatorRecording`, what `planned_allocator.from_step` records
with), one recorded iteration per watch iteration. At the start of iteration N the recording
stops and `plan_steady_state` plans iteration N-1 as the period of all later ones; iteration N
is measured on the default allocator; from the start of iteration N+1 the loop's CPU
allocations are served by `memplan.runtime.PlannedAllocator`, one plan iteration per watch
iteration, until the watch closes. Its stats (requests, fallbacks by reason, conflicts) are
`Watch.allocator_stats` and `allocator.json` under the watch's `out_dir`.

Why not plan the measured step: it runs under memplan's dispatch-level recorder
(`memplan.capture.LiveCapture`), which changes the allocator's requests (tiny GPT-2, batch
2 x 32: 549 requests against 523 in every unmeasured step); planned from it, the next steps
fell back on 16% of their requests (312 size mismatches, 32 conflicts). So the plan comes from
step N-1, and N-1 must be a steady step: N >= 3 (step 1 makes the optimizer state).

The iteration boundary is where the watch's iteration starts (the first forward after an
optimizer step, or the callback's step begin): what the loop does between its optimizer step
and the next forward (the next batch, a loss it keeps) belongs to the iteration before.
Tensors of step N-1 freed during step N are not seen freed (the recording has stopped): they
are planned long-lived and served by the default allocator (`outlived_iteration`).

Cuda is refused in one line: PyTorch takes a pluggable CUDA allocator only before the first
CUDA allocation, which a model on the GPU has made, and the CUDA glue has no recording mode
to plan the step from (`memplan.runtime.cuda`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from memplan.errors import UserError
from memplan.runtime.allocator import FALLBACK_REASONS, PlannedAllocator
from memplan.runtime.recording import AllocatorRecording, plan_steady_state

STATS_FILE = "allocator.json"


def check_options(planned_allocator: object, step: int, device: str) -> bool:
    """Whether the watch runs the planned allocator; one-line UserErrors for what cannot compose."""
    if not isinstance(planned_allocator, bool):
        raise UserError(f"memplan.watch: planned_allocator takes True or False, not {planned_allocator!r}")
    if not planned_allocator:
        return False
    if step < 3:
        raise UserError(f"memplan.watch: planned_allocator=True plans step-1 (step {step} is measured, step 1 "
                        f"makes the optimizer state), so it needs step >= 3, not {step}")
    if device == "cuda":
        raise UserError(_cuda_refusal())
    return True


def _cuda_refusal() -> str:
    from memplan.runtime import cuda

    if not cuda._installed:
        return f"memplan.watch: planned_allocator=True on cuda: {cuda.TOO_LATE}"
    return ("memplan.watch: planned_allocator=True runs on cpu only: the CUDA planned allocator has no "
            "recording mode to plan a live job's step from (use memplan.runtime.cuda.CudaPlannedAllocator "
            "with a plan)")


class PlannedRun:
    """Recording before iteration `target`, the planned allocator after it (module docstring)."""

    def __init__(self, target: int, out_dir: Path) -> None:
        self.target = target
        self.out_dir = out_dir
        self.index = 0  # the watch iteration running under the recorder or the plan (0: none yet)
        self.recording: AllocatorRecording | None = None
        self.allocator: PlannedAllocator | None = None
        self.plan_stats: dict[str, Any] | None = None
        self._entered = False

    def iteration_starts(self, index: int) -> None:
        """Watch iteration `index` starts now (called once per iteration, at its boundary)."""
        if index <= self.index:
            return
        if self.index == 0 and index < self.target:
            self.recording = AllocatorRecording()
            self.recording.start()
        elif index < self.target and self.recording is not None:
            self.recording.next_iteration()
        else:
            self.stop_recording()
            if index > self.target:
                self._serve()
        self.index = index

    def stop_recording(self) -> None:
        """End the recording (once) and plan its last iteration."""
        recording, self.recording = self.recording, None
        if recording is None:
            return
        recording.next_iteration()
        trace = recording.stop()
        if self.index < self.target - 1:
            return  # the run stopped before the step to plan: close() says so
        plan = plan_steady_state(trace)
        self.plan_stats = dict(plan.stats)
        self.allocator = PlannedAllocator(plan, first_iteration=plan.periodic_iteration + 1, trace=trace)

    def _serve(self) -> None:
        if self.allocator is None:
            return
        if self._entered:
            self.allocator.next_iteration()
            return
        self.allocator.__enter__()
        self._entered = True

    @property
    def stats(self) -> dict[str, Any]:
        """`PlannedAllocator.stats` (zeros before the plan serves), with the plan's own stats."""
        if self.allocator is None:
            stats: dict[str, Any] = {"requests": 0, "served": 0, "fallbacks": 0,
                                     "fallback_reasons": dict.fromkeys(FALLBACK_REASONS, 0)}
        else:
            stats = self.allocator.stats
        return {**stats, "planned_from_step": self.target - 1, "served_from_step": self.target + 1,
                "plan": self.plan_stats}

    def close(self, steps_done: int) -> Path:
        """Uninstall whatever is installed, write the stats; one line when nothing was served."""
        if self.recording is not None:
            self.stop_recording()
        if self._entered:
            self.allocator.__exit__(None, None, None)
        stats = self.stats
        if not stats["requests"]:
            sys.stderr.write(f"memplan.watch: the planned allocator served nothing: it serves from step "
                             f"{self.target + 1} and the run made {steps_done} steps; watch an earlier step\n")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / STATS_FILE
        path.write_text(json.dumps(stats, indent=2, default=str) + "\n")
        return path
