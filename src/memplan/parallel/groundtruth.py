"""CPU ground truth for parallel layouts: real multi-process training steps on gloo.

`measure_rank_peaks([(config, setup, layout), ...])` starts `world_size` processes
(`torch.multiprocessing` spawn, the gloo backend: what `torchrun --nproc_per_node N`
does, with less process overhead), applies the layout with the same code the traced
estimate uses (`memplan.parallel.apply`), runs one untraced warm-up step (so the
optimizer state exists, as in the estimate's traced step) and then measures one step on
every rank with torch.profiler's memory timeline (`memplan.capture.groundtruth`); the
step is `memplan.parallel.apply.build_parallel_step`, the one the traced estimate runs.
It returns, per case, the per-rank peak bytes in rank order. `measure_rank_calls` is
the same measurement of any call a module-level function builds on each rank (a
tensor-parallel `generate()`: `memplan.inference.gen_parallel`). Profile one step per set
of processes: torch's memory-profiler analysis fails ("version mismatch") on a second
profiled step in the same process more often than not.

One step's figure depends a little on scheduling: gloo stages every all-gather in a
buffer on its own thread, freed when the collective completes, so whether one is still
alive at the main thread's peak depends on how the ranks' processes run (a loaded host
can show one root all-gather staging buffer more on a rank; docs/estimation.md). Repeat
the measurement in fresh processes and take medians where that matters.

Under a multi-stage pipeline schedule (`memplan.parallel.schedules`), each rank runs its
pipeline rank of PyTorch's schedule with real sends and receives on gloo
(`schedule_rank_step`, the step the estimate traces on the fake group); with CP, the step
runs inside PyTorch's `context_parallel` (`memplan.parallel.context`).

Assumes a small model (every rank holds its shard in the host's memory) and a layout
that `memplan.parallel.apply.traceable` accepts.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from memplan.capture.groundtruth import profiler_peak_bytes
from memplan.capture.step import TrainingStep
from memplan.models.setup import TrainingSetup
from memplan.parallel.apply import build_parallel_step, pipeline_mesh
from memplan.parallel.layout import MULTI_STAGE_SCHEDULES, Layout
from memplan.parallel.schedules import schedule_rank_step

if TYPE_CHECKING:  # transformers takes a second to import; only its config class is named here
    from transformers import PretrainedConfig

Case = tuple["PretrainedConfig", TrainingSetup, Layout]  # what one measurement runs

# fresh runs of the whole set of processes when torch's memory-profiler analysis fails (it does
# on about half of the DeepSpeed runs: "version mismatch"); a run measures or is repeated
PROFILER_ATTEMPTS = 6
PROFILER_LOGGER = "torch.profiler._memory_profiler"
SIZE_MISMATCH = "Mismatch between allocation and free"


class _SizeMismatches(logging.Handler):
    """Counts torch's memory-profiler warnings that an address was freed with another
    size than it was allocated with (its analysis keys tensors by data pointer)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith(SIZE_MISMATCH):
            self.count += 1


def _profiled_peak(run: Callable[[], Any]) -> int:
    """The profiler peak of one call of `run`; AssertionError when torch's analysis fails or
    reports itself inconsistent (see `_measured_call`)."""
    logger = logging.getLogger(PROFILER_LOGGER)
    mismatches = _SizeMismatches()
    logger.addHandler(mismatches)
    try:
        peak = profiler_peak_bytes(run)
    finally:
        logger.removeHandler(mismatches)
    if mismatches.count:
        raise AssertionError(f"torch.profiler: {mismatches.count} allocation/free size mismatches")
    return peak


def _measured_call(run: Callable[[], Any], dist: Any) -> int:
    """Profiler peak of one call of `run` (one step). torch's memory-profiler analysis sometimes fails on
    FSDP2 steps ("version mismatch" assertion, after the step ran), and sometimes
    reports its own timeline inconsistent ("Mismatch between allocation and free": gloo's
    worker thread frees and re-uses an address, and the analysis pairs an allocation with
    the free of another buffer; docs/estimation.md). Either way every rank runs and
    measures one more step together; the value is never chosen among attempts."""
    for _ in range(PROFILER_ATTEMPTS):
        try:
            peak, ok = _profiled_peak(run), 1
        except AssertionError as exc:
            sys.stderr.write(f"memplan ground truth: rank {dist.get_rank()}: {str(exc)[:100]}; measuring another step\n")
            peak, ok = -1, 0
        flag = torch.tensor([ok])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if flag.item():
            return peak
    raise RuntimeError(f"torch.profiler's memory analysis failed {PROFILER_ATTEMPTS} times")


def _rank_main(rank: int, build_call: Callable[[Any, int], Callable[[], Any]], cases: list[Any], world_size: int,
               workdir: str) -> None:
    import gc

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=world_size)
    try:
        peaks = []
        for case in cases:
            run = build_call(case, rank)
            run()  # warm-up: a training step's optimizer state exists
            dist.barrier()
            peaks.append(_measured_call(run, dist))
            del run
            gc.collect()
        Path(workdir, f"rank{rank}.json").write_text(json.dumps(peaks))
    finally:
        dist.destroy_process_group()


def _training_call(case: tuple[PretrainedConfig, TrainingSetup, Layout, Callable[[TrainingStep], None] | None],
                   rank: int) -> Callable[[], Any]:
    """`rank`'s training step of `case`, prepared, as the call to measure."""
    config, setup, layout, prepare = case
    step = _rank_step(config, setup, layout, rank)
    if prepare is not None:
        prepare(step)
    return step.run


def _rank_step(config: PretrainedConfig, setup: TrainingSetup, layout: Layout, rank: int) -> TrainingStep:
    """`rank`'s step of `layout`: its pipeline rank under PyTorch's multi-stage schedule
    (`memplan.parallel.schedules`), else the parallel step (`build_parallel_step`)."""
    if layout.pp > 1 and layout.schedule in MULTI_STAGE_SCHEDULES:
        return schedule_rank_step(config, setup, layout, rank // (layout.dp * layout.tp), pipeline_mesh(layout))
    return build_parallel_step(config, setup, layout)


def measure_rank_peaks(cases: list[Case], prepare: Callable[[TrainingStep], None] | None = None) -> list[list[int]]:
    """Per case `(config, setup, layout)`, the profiler peak bytes of one real training
    step on every rank (rank order). All cases share one world size and run, one after
    the other, in the same set of processes. `prepare` (a module-level function, so that
    the processes can import it) is run on every rank's built step before its warm-up,
    e.g. to give the model trained weights."""
    sizes = {layout.world_size for _, _, layout in cases}
    if len(sizes) != 1:
        raise ValueError(f"one world size per call, not {sorted(sizes)}")
    return measure_rank_calls(_training_call, [(c, s, layout, prepare) for c, s, layout in cases], sizes.pop())


def measure_rank_calls(build_call: Callable[[Any, int], Callable[[], Any]], cases: list[Any],
                       world_size: int) -> list[list[int]]:
    """Per case, the profiler peak bytes of one call on every rank of a real gloo group of
    `world_size` processes (rank order): `build_call(case, rank)` (a module-level function, so
    that the processes can import it) builds the rank's call, which runs once untraced (the
    warm-up), then once measured, one case after the other in the same processes."""
    import torch.multiprocessing as mp

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # A failed memory analysis poisons torch's profiler for the rest of the process, so
    # the in-process retries of `_measured_call` can all fail: then the whole set of
    # processes runs again, fresh. A run either measures or fails; no value is chosen.
    for attempt in range(PROFILER_ATTEMPTS):
        with tempfile.TemporaryDirectory(prefix="memplan-gt-") as workdir:
            try:
                mp.spawn(_rank_main, args=(build_call, cases, world_size, workdir), nprocs=world_size, join=True)
            except mp.ProcessRaisedException as exc:
                if "memory analysis failed" not in str(exc) or attempt == PROFILER_ATTEMPTS - 1:
                    raise
                continue
            per_rank = [json.loads(Path(workdir, f"rank{r}.json").read_text()) for r in range(world_size)]
        return [[per_rank[r][c] for r in range(world_size)] for c in range(len(cases))]
    raise AssertionError("unreachable")
