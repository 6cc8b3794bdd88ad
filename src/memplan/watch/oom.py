"""An out-of-memory error of the watched job, turned into an answer.

Detection. On cuda, PyTorch's caching allocator calls its out-of-memory observers
(`torch._C._cuda_attach_out_of_memory_observer`, after releasing its lock, before it raises
`torch.OutOfMemoryError`) while the memory history (`_record_memory_history`, on for the
whole watch) still holds what led there (`memplan.watch.cuda`). On cpu there is no device
limit, so a `capacity` given to the watch stands for one: every iteration runs under
`CapacityRecorder`, memplan's recorder counting the bytes of the storages it has seen live
(the model's, the optimizer's and every op's output), which raises `torch.OutOfMemoryError`
after the op whose output takes the total past the capacity.

Answer (`handle_oom`, before the error leaves the op that raised it): the trace up to the
error is written (`oom.memtrace`, its snapshot `oom.pickle`), then the report, then memplan
searches the job's own setup and layout for the smallest changes that fit (`fitting_changes`)
and prints the three fastest, each as the `memplan estimate` command that shows it. Each stage is guarded: an
error inside one (a second out-of-memory error included) is reported in one line and ends
the handler, and the original error is the one raised.
"""

from __future__ import annotations

import json
import math
import shlex
import sys
import threading
import traceback
from dataclasses import replace
from typing import Any

import torch

from memplan.capture import Recorder
from memplan.errors import UserError
from memplan.estimation import estimate
from memplan.estimation.fit import CHECKPOINTING, MICRO_BATCHES
from memplan.estimation.whatfits import what_fits
from memplan.models.setup import TrainingSetup
from memplan.parallel.layout import Layout
from memplan.report import build_report
from memplan.trace import save, save_snapshot
from memplan.trace.model import Trace
from memplan.units import format_bytes
from memplan.watch.job import layout_flags, model_config, setup_flags

SUGGESTIONS = 3
OOM_FORMAT = "memplan-oom"


class CapacityRecorder(Recorder):
    """memplan's recorder that also holds the live bytes it sees to `capacity_bytes` (module docstring)."""

    def __init__(self, capacity_bytes: int, on_oom: Any, *, record_flops: bool = False) -> None:
        super().__init__(record_flops=record_flops)
        self.capacity_bytes = capacity_bytes
        self.live_bytes = 0
        self.on_oom = on_oom

    def _new_buffer(self, storage: Any, device: torch.device, *, preexisting: bool, op: int) -> int:
        idx = super()._new_buffer(storage, device, preexisting=preexisting, op=op)
        self.live_bytes += self._b.nbytes[idx]
        return idx

    def _make_free_callback(self, idx: int) -> Any:
        inner = super()._make_free_callback(idx)

        def on_free(ref: Any) -> None:
            self.live_bytes -= self._b.nbytes[idx]
            inner(ref)

        return on_free

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.active and self.live_bytes > self.capacity_bytes:
            error = torch.OutOfMemoryError(
                f"memplan.watch: out of memory: {func} took the job's tensors to {format_bytes(self.live_bytes)} "
                f"({self.live_bytes} bytes), over the capacity of {format_bytes(self.capacity_bytes)} "
                f"({self.capacity_bytes} bytes) given to memplan.watch")
            self.on_oom(self, error)
            raise error
        return out


class CpuGuard:
    """A cpu capacity: every iteration is recorded by a `CapacityRecorder`."""

    records_every_step = True

    def __init__(self, watch: Any) -> None:
        self.watch = watch

    def recorder(self, *, record_flops: bool) -> CapacityRecorder:
        return CapacityRecorder(self.watch.capacity_bytes, self._on_oom, record_flops=record_flops)

    def _on_oom(self, recorder: CapacityRecorder, error: BaseException) -> None:
        watch = self.watch
        measurement = watch._open
        if measurement is not None:
            measurement.stop_profiler()
        trace = recorder.finish(meta={"device": "cpu", "torch_version": str(torch.__version__),
                                      "watched_model": watch.identity, "oom": str(error)})
        if measurement is not None:
            measurement.oom_trace = trace
        handle_oom(watch, str(error), trace)

    def remove(self) -> None:
        pass


def _stage(name: str, failures: list[str], work: Any) -> Any:
    """Run one stage of the handler; an error in it is kept as one line, never raised."""
    try:
        return work()
    except BaseException as exc:  # noqa: BLE001 - the original out-of-memory error must leave, not this one
        line = " ".join(str(exc).split()) or type(exc).__name__
        failures.append(f"{name}: {type(exc).__name__}: {line[:300]}")
        sys.stderr.write(f"memplan.watch: the out-of-memory handler stopped at {name}: {type(exc).__name__}: "
                         f"{line[:300]}\n")
        if not isinstance(exc, Exception):
            traceback.print_exc(file=sys.stderr)
        return None


def handle_oom(watch: Any, message: str, trace: Trace, raw_snapshot: dict | None = None) -> dict[str, Any]:
    """Write the trace, the snapshot, the report and the suggestions (module docstring)."""
    if watch.oom_files is not None:  # a later error of the same run: the first one's answer stands
        return watch.oom_files
    out = watch.out_dir
    out.mkdir(parents=True, exist_ok=True)
    failures: list[str] = []
    files: dict[str, Any] = {"message": message}
    watch.oom_files = files

    def dump() -> None:
        save(trace, out / "oom.memtrace")
        files["trace"] = str(out / "oom.memtrace")
        if raw_snapshot is not None:
            import pickle

            (out / "oom.pickle").write_bytes(pickle.dumps(raw_snapshot, protocol=4))
        else:
            save_snapshot(trace, out / "oom.pickle")
        files["snapshot"] = str(out / "oom.pickle")

    if _stage("the snapshot", failures, dump) is None and "snapshot" not in files:
        return files
    changes = _stage("the suggestions", failures, lambda: _in_clean_state(lambda: suggest_changes(watch)))
    files["suggestions"] = changes
    doc = {"format": OOM_FORMAT, "message": message, "suggestions": changes or [], "handler_failures": failures}
    (out / "oom.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    report = _stage("the report", failures, lambda: build_report([out / "oom.memtrace", out / "oom.json"],
                                                                  out / "oom-report"))
    files["report"] = str(report) if report is not None else None
    files["handler_failures"] = failures
    _print_answer(watch, message, files)
    return files


def _in_clean_state(work: Any) -> Any:
    """`work()` on a new thread, and its result (or its error, raised here). The error that
    called the handler may be raised inside a dispatch mode (below autograd, where no op
    records a gradient), inside `optimizer.step()` (`no_grad`) or an autocast region: all
    thread-local state, which a new thread starts without, so the search's own steps run as
    they would in a fresh process."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = work()
        except BaseException as exc:  # noqa: BLE001 - handed to the calling thread
            box["error"] = exc

    thread = threading.Thread(target=run, name="memplan-watch-oom")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box.get("result")


def _print_answer(watch: Any, message: str, files: dict[str, Any]) -> None:
    lines = [message.splitlines()[0] if message else "memplan.watch: out of memory",
             f"memplan.watch: snapshot {files.get('snapshot')}, report {files.get('report')}"]
    changes = files.get("suggestions")
    if isinstance(changes, dict) and changes.get("refused"):
        lines.append(f"memplan.watch: no suggestions: {changes['refused']}")
    elif changes:
        lines.append(f"memplan.watch: the {len(changes['fits'])} cheapest changes that fit:")
        lines += [f"  {c['command']}" for c in changes["fits"]]
    sys.stderr.write("\n".join(lines) + "\n")


def suggest_changes(watch: Any) -> dict[str, Any]:
    """The job's model and setup, searched for what fits: `{"fits": [...]}` or `{"refused": why}`."""
    config = model_config(watch.model)
    if config is None:
        return {"refused": f"{type(watch.model).__name__} has no Hugging Face config for memplan to rebuild it "
                           "on fake tensors"}
    setup, unseen = watch.setup_for_suggestions()
    if "batch" in unseen:
        return {"refused": "the failing step's batch shape was not seen (no input_ids): pass setup= to the watch"}
    config_path = watch.out_dir / "model-config.json"
    config.to_json_file(str(config_path))
    if watch.device == "cuda":
        target = {"gpu": watch.target_gpu(), "gpus": 1}
    else:
        target = {"capacity_bytes": watch.capacity_bytes}
    try:
        fits = fitting_changes(config, setup, target)[:SUGGESTIONS]
    except UserError as why:
        return {"refused": str(why)}
    for change in fits:
        change["command"] = shlex.join(["memplan", "estimate", str(config_path), *change.pop("flags")])
    return {"fits": fits, "setup": setup.to_dict(), "setup_not_seen": unseen}


def fitting_changes(config: Any, setup: TrainingSetup, target: dict[str, Any]) -> list[dict[str, Any]]:
    """The changes of `setup` that fit `target`, cheapest first: on a GPU profile
    (`{"gpu": name, "gpus": n}`, optionally `"capacity_bytes"` for a lower limit) the smallest
    sets of changes `memplan.estimation.what_fits` finds (checkpointing, a smaller micro-batch
    with more accumulation, the memory techniques, ZeRO / TP / PP), fastest first; on a cpu
    capacity (`{"capacity_bytes": n}`) `_cpu_changes`. The one place the watch calls a search;
    `UserError` when the search finds that the job fits as it is."""
    if "gpu" in target:
        return _gpu_changes(config, setup, target)
    return _cpu_changes(config, setup, target["capacity_bytes"])


def _gpu_changes(config: Any, setup: TrainingSetup, target: dict[str, Any]) -> list[dict[str, Any]]:
    result = what_fits(config, target["gpu"], setup, Layout(world_size=target.get("gpus", 1)), top=SUGGESTIONS,
                       capacity=target.get("capacity_bytes"), workers=1, progress=False)
    base = result.base
    if base is not None and base.fits:
        raise UserError(f"the estimate fits {target['gpu']} as it is ({format_bytes(base.device_used_bytes)} of "
                        f"{format_bytes(base.usable_bytes)} usable): compare the measured step with the estimate "
                        "(`memplan compare`) to see what the estimate does not hold")
    return [{"changes": list(row.candidate.changes), "setup": row.candidate.setup.to_dict(),
             "layout": row.candidate.layout.to_dict(), "peak_bytes": row.device_used_bytes,
             "capacity_bytes": row.capacity_bytes, "usable_bytes": row.usable_bytes, "cost": row.s_per_token,
             "flags": [*setup_flags(row.candidate.setup), *layout_flags(row.candidate.layout),
                       *(["--capacity", str(target["capacity_bytes"])] if "capacity_bytes" in target else []),
                       *(["--allocator", row.allocator] if row.allocator != "caching" else []),
                       "--gpu", target["gpu"]]}
            for row in result.rows]


def _cpu_changes(config: Any, setup: TrainingSetup, capacity: int) -> list[dict[str, Any]]:
    """On cpu (module docstring): fit's micro-batches and checkpointing policies
    (`memplan.estimation.fit.MICRO_BATCHES`, `CHECKPOINTING`) up to the job's micro-batch, the
    tokens per optimizer step kept by gradient accumulation, each estimated for cpu."""
    tokens = setup.batch * setup.grad_accum
    cache: dict = {}
    out: list[dict[str, Any]] = []
    batches = sorted({b for b in (*MICRO_BATCHES, setup.batch) if b <= setup.batch})
    for micro_batch in batches:  # a larger micro-batch holds more activations: never the change that fits
        for checkpointing in CHECKPOINTING:
            accum = max(1, math.ceil(tokens / micro_batch))
            trial = replace(setup, batch=micro_batch, checkpointing=checkpointing, grad_accum=accum)
            if trial == setup:
                continue
            est = estimate(config, trial, device="cpu", allocator="none", capacity=capacity, cache=cache)
            if not est.fits:
                continue
            per_token = est.flops / max(1, micro_batch * accum * (trial.seq or 1))
            out.append({"setup": trial.to_dict(), "peak_bytes": est.peak_allocated_bytes,
                        "capacity_bytes": capacity, "cost": per_token, "micro_batch": micro_batch,
                        "flags": [*setup_flags(trial), "--device", "cpu", "--allocator", "none",
                                  "--capacity", str(capacity)]})
    out.sort(key=lambda c: (c["cost"], -c.pop("micro_batch")))  # equal FLOPs: fewer micro-batches first
    return out
