"""Recording one real iteration of the watched job, and what the watch writes about it.

On cpu the iteration runs under memplan's dispatch-level recorder (`memplan.capture.LiveCapture`,
real tensors: categories, phases, ops) and, for the measured step, under torch.profiler's
memory timeline too (`memplan.capture.groundtruth`), whose peak goes into the trace's metadata
(`profiler_peak_bytes`) as the independent figure. On cuda it is PyTorch's own record:
`torch.cuda.memory._record_memory_history` and `_snapshot()`, with `memory_stats()` and
`mem_get_info()` (`memplan.watch.cuda.CudaMeasurement`, imported only where CUDA is present).

Files (under the watch's `out_dir`): `stepN.memtrace` (the measured trace), `stepN.pickle`
(its PyTorch memory snapshot, for pytorch.org/memory_viz), then from `analyse`:
`estimate.memtrace`, `estimate.json`, `compare.json` and `report/index.html`.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from memplan.capture import LiveCapture, Recorder
from memplan.capture.groundtruth import memory_profiler, timeline_peak_bytes
from memplan.errors import UserError
from memplan.estimation.compare import buffers_at_peak, compare, side_of_estimate, side_of_trace
from memplan.models.setup import TrainingSetup
from memplan.report import build_report
from memplan.trace import save, save_snapshot
from memplan.trace.model import Trace
from memplan.watch.estimate import estimate_of_trace, trace_fake_step
from memplan.watch.fake import standard_step


@dataclass
class StepFiles:
    """The measured step: its trace and the files written."""

    trace: Trace
    memtrace: Path
    snapshot: Path


def step_meta(watch: Any) -> dict[str, Any]:
    """What every trace the watch writes says about the job."""
    return {"device": watch.device, "torch_version": str(torch.__version__), "watched_model": watch.identity,
            "model": watch.identity["name"], "parameters": watch.identity["parameters"], "step": watch.target}


class Measurement:
    """One recorded iteration (cpu); `finish` returns the measured step's files, or None."""

    def __init__(self, watch: Any, inputs: Any, measured: bool) -> None:
        self.measured = measured
        optimizers = [watch.optimizer] if watch.optimizer is not None else []
        guard = watch._oom_guard
        recorder = guard.recorder(record_flops=measured) if guard is not None and hasattr(guard, "recorder") \
            else Recorder(record_flops=measured)
        self.live = LiveCapture([watch.model], optimizers, recorder=recorder)
        self.profiler: Any = None
        self.oom_trace: Trace | None = None
        if measured:
            self.start_profiler(watch)
        self.live.begin(inputs=inputs)

    def start_profiler(self, watch: Any) -> None:
        """torch.profiler's memory timeline over the measured step (unless `profile=False`)."""
        if watch.profile:
            self.profiler = memory_profiler()
            self.profiler.start()

    def mark_inputs(self, inputs: Any) -> None:
        """The tensors of a forward call made before the recording began are the step's inputs."""
        for t in (x for x in tree_flatten(inputs)[0] if isinstance(x, torch.Tensor)):
            self.live.recorder.mark(t, "input")

    def stop_profiler(self) -> int | None:
        """Stop the profiler (once); its peak."""
        prof, self.profiler = self.profiler, None
        if prof is None:
            return None
        prof.stop()
        return timeline_peak_bytes(prof, "cpu")

    def finish(self, watch: Any) -> StepFiles | None:
        if not self.measured or self.oom_trace is not None:
            self.abandon()
            return None
        trace = self.live.end(meta=step_meta(watch))
        peak = self.stop_profiler()
        if peak is not None:
            trace.meta["profiler_peak_bytes"] = peak
        return write_step(watch, trace)

    def abandon(self) -> None:
        self.stop_profiler()
        self.live.abandon()


def write_step(watch: Any, trace: Trace, raw_snapshot: dict | None = None) -> StepFiles:
    """Write the measured step's trace and snapshot (PyTorch's own where it made one)."""
    watch.out_dir.mkdir(parents=True, exist_ok=True)
    memtrace = watch.out_dir / f"step{watch.target}.memtrace"
    snapshot = watch.out_dir / f"step{watch.target}.pickle"
    save(trace, memtrace)
    if raw_snapshot is not None:
        import pickle

        snapshot.write_bytes(pickle.dumps(raw_snapshot, protocol=4))
    else:
        save_snapshot(trace, snapshot)
    return StepFiles(trace, memtrace, snapshot)


def analyse(watch: Any, files: StepFiles, setup: TrainingSetup, unseen: list[str]) -> dict[str, Any]:
    """Estimate the measured step on fake tensors, compare, report (module docstring)."""
    out = watch.out_dir
    result: dict[str, Any] = {"measured": str(files.memtrace), "snapshot": str(files.snapshot),
                              "setup": setup.to_dict(), "setup_not_seen": unseen, "estimate": None,
                              "compare": None}
    inputs = [files.memtrace]
    try:
        step = watch.step_fn or standard_step(watch.model, watch.optimizer, watch._measured_calls, scale_loss=True,
                                              clip_norm=watch.clip_norm, autocast=watch._autocast,
                                              closure=watch.closure)
        start = time.perf_counter()
        fake = trace_fake_step(watch.model, watch.optimizer, watch.fake_mode, step,
                               {**step_meta(watch), "setup": setup.to_dict()})
        profile, context = watch.device_terms()
        est = estimate_of_trace(fake, device=watch.device, setup=setup.to_dict(), model=watch.identity,
                                capacity_bytes=watch.capacity_bytes, profile=profile, context_bytes=context,
                                elapsed_s=time.perf_counter() - start)
    except UserError as exc:
        result["estimate_refused"] = str(exc)
        sys.stderr.write(f"memplan.watch: step {watch.target} was measured but not estimated: {exc}\n")
    else:
        save(fake, out / "estimate.memtrace")
        doc = {**est.to_json(), "watched_model": watch.identity, "torch_version": str(torch.__version__),
               "buffers_at_peak": buffers_at_peak(fake)}
        (out / "estimate.json").write_text(json.dumps(doc, indent=2) + "\n")
        cmp = compare(side_of_trace(files.trace, files.memtrace.name, "memtrace"),
                      side_of_estimate(doc, "estimate.json"))
        (out / "compare.json").write_text(json.dumps(cmp, indent=2) + "\n")
        result.update(estimate=str(out / "estimate.json"), compare=cmp)
        inputs += [out / "estimate.json", out / "compare.json"]
    result["report"] = str(build_report(inputs, out / "report"))
    return result
