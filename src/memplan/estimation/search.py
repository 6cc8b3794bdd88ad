"""Estimating many candidate (training setup, layout) pairs, in parallel: what `memplan fit`
searches with.

A candidate is evaluated only through `memplan.estimation.estimate`, one of two ways:

- **traced** (what `memplan estimate` computes for it, the figures fit shows): the same
  call, under the search's allocator and margin (`FitJob`), with the parallel step traced
  on a fake process group where the layout has such a part;
- **screened**: the layout's modelled rules over the single-device trace the candidates of
  one setup share (`parallel_tracing=False`), counting the tensor bytes live
  (`allocator="none"`: no allocator replay). A screened figure only prunes and orders; a
  screened candidate is shown after it has been traced.

A candidate fits when its estimate does (`Estimate.fits`: device used <= capacity x
(1 - margin)). The screen lets through what is within `SCREEN_SLACK` above the usable
memory: the screen counts no allocator slack, and the modelled rules are not the traced
figure (ZeRO-3 modelled 12.6% under the traced FSDP2 step on llama-2-70b, TP 31% under a
real TP run; docs/estimation.md).

Candidates are grouped (one group: one setup, so one shared trace); groups run on worker
processes, one per core (this process and one single-process pool per other core), so that
a group goes back to the worker that holds its setup's traces (`Evaluator._worker_for`). Workers start from a
`forkserver` that imported torch, transformers and memplan once (forking a process whose
torch threads are running is unsafe, spawning re-imports everything per worker; Python's
`multiprocessing` docs, "Contexts and start methods"). Within a group a candidate may
require an earlier one to pass the screen (memory that is monotone along an axis: if
ZeRO-3 does not fit, ZeRO-2 does not either). Progress goes to stderr one stage at a time,
each with the most candidates it estimates known when it starts (`Evaluator.stage`).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import threading
import time
import warnings
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from memplan.errors import UserError
from memplan.estimation.figures import DEFAULT_MARGIN, check_margin
from memplan.estimation.pipeline import ESTIMATE_ALLOCATORS, Estimate, StepCache, estimate
from memplan.estimation.steptime import StepTime, step_time
from memplan.hardware.devices import device_profile
from memplan.models.registry import FactorySpec, load_config
from memplan.models.setup import TrainingSetup
from memplan.parallel.apply import untraceable_tensor_parallel
from memplan.parallel.layout import Layout

if TYPE_CHECKING:  # transformers takes a second to import; only its config class is named here
    from transformers import PretrainedConfig

SCREEN_SLACK = 0.10
SCREEN_ALLOCATOR = "none"  # a screen counts the tensor bytes live: no allocator replay
ModelSpec = Any  # str | PretrainedConfig | FactorySpec (a registry name, a config, a factory)


@dataclass
class FitJob:
    """What every candidate of one search shares: the model, the GPU and the headroom."""

    model: ModelSpec
    gpu: str
    capacity_bytes: int | None = None  # overrides the profile's capacity
    margin: float = DEFAULT_MARGIN
    allocator: str = "caching"  # every traced estimate's, as `memplan estimate --allocator`

    def __post_init__(self) -> None:
        self.margin = check_margin(self.margin)
        if self.allocator not in ESTIMATE_ALLOCATORS:
            raise UserError(f"unknown allocator {self.allocator!r}: choose one of {', '.join(ESTIMATE_ALLOCATORS)}")
        device_profile(self.gpu)  # an unknown GPU is a UserError before any tracing

    def config(self) -> PretrainedConfig | FactorySpec:
        return load_config(self.model) if isinstance(self.model, str) else self.model


@dataclass
class Candidate:
    """One training setup under one layout; `changes` names what differs from the user's own."""

    setup: TrainingSetup
    layout: Layout
    changes: tuple[str, ...] = ()
    allocator: str | None = None  # None: the search's (`FitJob.allocator`)

    def key(self) -> str:
        return json.dumps([self.setup.to_dict(), self.layout.to_dict(), self.allocator], sort_keys=True)

    def setup_key(self) -> str:
        return json.dumps(self.setup.to_dict(), sort_keys=True)


@dataclass
class Row:
    """One candidate's estimate: traced (the figures `memplan estimate` gives) or screened."""

    candidate: Candidate
    traced: bool
    allocator: str = "caching"
    device_used_bytes: int = 0
    peak_allocated_bytes: int = 0
    peak_reserved_bytes: int = 0
    capacity_bytes: int = 0
    usable_bytes: int = 0
    parallel: str = ""
    method: str = ""
    time: StepTime | None = None
    refused: str | None = None  # why `estimate` refused it (a UserError's line)
    margin: float = DEFAULT_MARGIN
    phase_peaks: dict[str, int] = field(default_factory=dict)  # `Estimate.phase_peaks`

    @property
    def fits(self) -> bool:
        return self.refused is None and self.device_used_bytes <= self.usable_bytes

    def passes_screen(self) -> bool:
        if self.traced:
            return self.fits
        return self.refused is None and self.device_used_bytes <= self.usable_bytes * (1 + SCREEN_SLACK)

    @property
    def s_per_token(self) -> float:
        return self.time.s_per_token if self.time is not None else float("inf")

    def to_json(self) -> dict[str, Any]:
        lay = self.candidate.layout
        return {
            "changes": list(self.candidate.changes), "world_size": lay.world_size, "dp": lay.dp, "zero": lay.zero,
            "tp": lay.tp, "pp": lay.pp, "microbatches": lay.microbatches, "micro_batch": self.candidate.setup.batch,
            "grad_accum": self.candidate.setup.grad_accum, "checkpointing": self.candidate.setup.checkpointing,
            "allocator": self.allocator, "peak_allocated_bytes": self.peak_allocated_bytes,
            "peak_reserved_bytes": self.peak_reserved_bytes, "device_used_bytes": self.device_used_bytes,
            "capacity_bytes": self.capacity_bytes, "margin": self.margin, "usable_bytes": self.usable_bytes,
            "fits": self.fits,
            "parallel": self.parallel, "method": self.method, "traced": self.traced, "phase_peaks": self.phase_peaks,
            **(self.time.to_json() if self.time is not None else {}),
            "setup": self.candidate.setup.to_dict(), "layout": lay.to_dict(),
        }


@dataclass
class Task:
    """One group: candidates evaluated in order by one worker (they share its traces).
    `requires[i]`: the index of an earlier candidate that must pass the screen (or None);
    `traced[i]`: trace candidate i even where a screen would do."""

    candidates: list[Candidate]
    traced: list[bool]
    requires: list[int | None] = field(default_factory=list)
    key: str = ""  # the traces the task needs (default: its first candidate's setup)

    def __post_init__(self) -> None:
        if not self.requires:
            self.requires = [None] * len(self.candidates)


def refusal(config: PretrainedConfig | FactorySpec, cand: Candidate) -> str | None:
    """Why `estimate` would refuse `cand` before tracing it (None: it would not): a
    layout the model cannot take (`Layout.check`), TP that cannot be traced."""
    try:
        cand.layout.check(config, cand.setup)
    except UserError as exc:
        return str(exc)
    return untraceable_tensor_parallel(cand.layout, config, cand.setup)


@dataclass
class _State:
    """A process's traces and model config, kept across the tasks it runs."""

    job: FitJob
    config: Any
    cache: StepCache = field(default_factory=dict)


_PROCESS_STATE: dict[str, _State] = {}  # in a worker: its state, per job


def _job_key(job: FitJob) -> str:
    model = job.model if isinstance(job.model, (str, FactorySpec)) else json.dumps(job.model.to_dict(), sort_keys=True,
                                                                                 default=str)
    return json.dumps([str(model), job.gpu, job.capacity_bytes, job.margin, job.allocator])


def evaluate(state: _State, cand: Candidate, traced: bool) -> Row:
    """`cand`'s row: the estimate `memplan estimate` makes (`traced`), or its screen: the
    tensor bytes of the modelled layout (module docstring)."""
    job, config = state.job, state.config
    try:
        result = estimate(job.model, cand.setup, cand.layout, gpu=job.gpu, capacity=job.capacity_bytes,
                          allocator=(cand.allocator or job.allocator) if traced else SCREEN_ALLOCATOR,
                          cache=state.cache, parallel_tracing=traced, margin=job.margin)
    except UserError as exc:
        return Row(cand, traced, refused=str(exc))
    row = _row(cand, traced, result)
    row.time = step_time(result, cand.setup, cand.layout, config, device_profile(job.gpu))
    return row


def row_of(cand: Candidate, result: Estimate) -> Row:
    """`cand`'s row from its estimate, made elsewhere (`memplan estimate`'s own)."""
    return _row(cand, True, result)


def _row(cand: Candidate, traced: bool, result: Estimate) -> Row:
    return Row(cand, traced, result.allocator, result.device_used_bytes, result.peak_allocated_bytes,
               result.peak_reserved_bytes, int(result.capacity_bytes or 0), int(result.usable_bytes or 0),
               result.parallel, result.method, margin=result.margin, phase_peaks=result.phase_peaks)


def run_task(job: FitJob, task: Task, state: _State | None = None) -> tuple[list[Row | None], float]:
    """The rows of `task`'s candidates in order (None where a required one did not pass),
    and the CPU seconds they took."""
    start_s = time.process_time()
    if state is None:  # in a worker: the process's own state
        key = _job_key(job)
        if key not in _PROCESS_STATE:
            _PROCESS_STATE.clear()
            _PROCESS_STATE[key] = _State(job, job.config())
        state = _PROCESS_STATE[key]
    rows: list[Row | None] = []
    for cand, traced, needs in zip(task.candidates, task.traced, task.requires):
        if needs is not None and (rows[needs] is None or not rows[needs].passes_screen()):
            rows.append(None)
            continue
        rows.append(evaluate(state, cand, traced))
    return rows, time.process_time() - start_s


def _init_worker(filters: list[Any]) -> None:
    warnings.filters[:] = filters  # the caller's warning filters (the CLI silences library chatter)
    import torch

    torch.set_num_threads(1)  # fake tensors compute nothing; a worker is one core


def available_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class Evaluator:
    """Runs tasks on `workers` processes: this one and `workers - 1` others (one, for a
    model the others cannot import), with progress on stderr (`stage`). Use as a context
    manager."""

    def __init__(self, job: FitJob, workers: int | None = None, progress: bool = False, label: str = "memplan fit",
                 cache: StepCache | None = None):
        self.job = job
        self.workers = available_cores() if workers is None else workers
        if not isinstance(self.workers, int) or isinstance(self.workers, bool) or self.workers < 1:
            raise UserError(f"--workers must be a whole number >= 1, not {workers!r}")
        if isinstance(job.model, FactorySpec) or (isinstance(job.model, str) and ":" in job.model):
            self.workers = 1  # a factory's module is importable from this process's path only
        self.state = _State(job, job.config(), cache if cache is not None else {})
        self.estimates = 0  # candidates estimated so far (screened or traced)
        self.worker_cpu_s = 0.0  # CPU seconds the pool's workers spent on tasks
        self.started_s = time.perf_counter()
        self.started_cpu_s = time.process_time()
        self._pools: list[ProcessPoolExecutor] = []
        self._home: dict[str, int] = {}  # a task's key -> the worker that ran it (and keeps its traces)
        self._load = [0] * self.workers  # candidates sent to each worker
        self._progress = _Progress(label) if progress else None
        # the other workers start (their forkserver imports torch) while this process works
        self._starting = threading.Thread(target=self._start_pools, daemon=True) if self.workers > 1 else None
        if self._starting is not None:
            self._starting.start()

    def __enter__(self) -> Evaluator:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._starting is not None:
            self._starting.join()
        for pool in self._pools:
            pool.shutdown(wait=True, cancel_futures=True)
        if self._progress is not None:
            self._progress.finish()

    def stage(self, label: str, total: int) -> None:
        """A stage of the search that estimates at most `total` candidates (the progress shown)."""
        if self._progress is not None:
            self._progress.stage(label, total)

    def skip(self, count: int) -> None:
        """`count` candidates of the stage that the search will not estimate."""
        if self._progress is not None and count > 0:
            self._progress.advance(count)

    def run(self, tasks: Sequence[Task]) -> list[list[Row | None]]:
        """Each task's rows, in the order of `tasks`."""
        workers = [self._worker_for(task) for task in tasks]
        pools = self._ensure_pools() if any(workers) else []
        futures = {pools[w - 1].submit(run_task, self.job, task): i
                   for i, (task, w) in enumerate(zip(tasks, workers)) if w > 0}
        results: list[list[Row | None]] = [[] for _ in tasks]
        for i, (task, w) in enumerate(zip(tasks, workers)):  # this process is worker 0
            if w == 0:
                results[i] = run_task(self.job, task, self.state)[0]
                self._done(results[i])
        for future in as_completed(futures):
            rows, cpu_s = future.result()
            results[futures[future]] = rows
            self.worker_cpu_s += cpu_s
            self._done(rows)
        return results

    def spent(self) -> dict[str, Any]:
        """What the search spent: estimates, wall and CPU seconds (this process, plus the
        workers' seconds on tasks; the forkserver's one import of torch is not counted)."""
        main_cpu_s = time.process_time() - self.started_cpu_s
        return {"estimates": self.estimates, "workers": self.workers,
                "wall_s": round(time.perf_counter() - self.started_s, 3),
                "cpu_s": round(main_cpu_s + self.worker_cpu_s, 3), "worker_cpu_s": round(self.worker_cpu_s, 3)}

    def _done(self, rows: list[Row | None]) -> None:
        self.estimates += sum(r is not None for r in rows)
        if self._progress is not None:
            self._progress.advance(len(rows))

    def _worker_for(self, task: Task) -> int:
        """The worker that ran the task's setup before (it keeps the setup's traces), else
        the one given the fewest candidates so far."""
        key = task.key or (task.candidates[0].setup_key() if task.candidates else "")
        if key not in self._home:
            self._home[key] = min(range(self.workers), key=self._load.__getitem__)
        worker = self._home[key]
        self._load[worker] += len(task.candidates)
        return worker

    def _start_pools(self) -> None:
        """One single-process pool per worker but this process (worker 0), each started."""
        context = _context(self.state.config)
        pools = [ProcessPoolExecutor(max_workers=1, mp_context=context, initializer=_init_worker,
                                     initargs=(list(warnings.filters),)) for _ in range(self.workers - 1)]
        for future in [pool.submit(available_cores) for pool in pools]:
            future.result()
        self._pools = pools

    def _ensure_pools(self) -> list[ProcessPoolExecutor]:
        """The other workers' pools (`_start_pools`), once started: a task goes to the worker
        holding its traces (`_worker_for`)."""
        if self._starting is not None:
            self._starting.join()
            self._starting = None
        return self._pools


def _context(config: Any) -> multiprocessing.context.BaseContext:
    """`forkserver` with memplan, torch and the model's transformers module imported once
    (module docstring); `spawn` where there is no forkserver."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    preload = ["memplan.estimation.search"]
    family = type(config).__module__.replace(".configuration_", ".modeling_")
    if family.startswith("transformers.models."):
        preload.append(family)
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(preload)
    return context


class _Progress:
    """Progress on stderr, one stage at a time, each with the most candidates it
    estimates known when it starts: a rich bar on a terminal, else a line when a stage starts and
    one when it ends (a log keeps them)."""

    def __init__(self, label: str):
        self.label = label
        self.tty = sys.stderr.isatty()
        self.bar: Any = None
        self.stage_label: str | None = None
        self.total = self.done = 0
        self.started_s = 0.0

    def stage(self, label: str, total: int) -> None:
        self.finish()
        self.stage_label, self.total, self.done, self.started_s = label, max(int(total), 0), 0, time.perf_counter()
        if not self.tty:
            sys.stderr.write(f"{self.label}: {label} (at most {self.total} candidates)\n")
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        self.bar = Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TextColumn("candidates"),
                            TimeElapsedColumn(), console=Console(file=sys.stderr), transient=True)
        self.bar.start()
        self.task = self.bar.add_task(label, total=self.total)

    def advance(self, count: int) -> None:
        self.done += count
        if self.bar is not None:
            self.bar.update(self.task, completed=min(self.done, self.total))

    def finish(self) -> None:
        """End the stage in progress, if any."""
        if self.stage_label is None:
            return
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
        else:
            sys.stderr.write(f"{self.label}: {self.stage_label}: {self.done} candidates, "
                             f"{time.perf_counter() - self.started_s:.1f} s\n")
        self.stage_label = None
