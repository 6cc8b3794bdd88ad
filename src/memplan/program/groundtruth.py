"""CPU ground truth for `memplan run`: the same command run for real, measured by the profiler.

`measure_program(words, steps=2)` runs the training command for real on the CPU in fresh
processes, one per rank, as its launcher would start them (`Launch.rank_env`: RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; the ranks meet on gloo through the
program's own `init_process_group`, with a free local port), each with nothing of memplan's
world installed: real weights, real data, real collectives. In each rank, torch.profiler's
memory profiler (`memplan.capture.groundtruth.memory_profiler`) runs over the same window
memplan's trace covers (`memplan.program.steps.StepWindow`: from the program's first
top-level forward to its stop after `steps + 1` optimizer steps), and the rank's peak is the
peak of the bytes the profiler's allocation events hold on the cpu
(`memplan.capture.groundtruth.events_peak_bytes`: the storages the profile sees from before
it, then every allocation and free). It returns the per-rank peaks in rank order.

Each process first has c10 report the free of every CPU block it allocates
(`report_every_cpu_free`): a block allocated before the window and freed in it (the first
batch of a loop, the flat bucket Lightning's DDP frees when it rebuilds its buckets after the
first step) leaves the profile where it is freed, instead of counting to its end.

The allocation events, not the peak of torch's memory timeline (`timeline_peak_bytes`), are the
ground truth: the timeline's data-flow analysis refuses some runs ("version mismatch",
"duplicate outputs", or its own warnings that an address was freed with another size than it
was allocated with) where gloo's thread frees a block the profiler does not see and its
address is reused (FSDP2 and DeepSpeed ZeRO runs on gloo, about half of them here); the events
measure every run, and equal the timeline's peak to the byte where it reads
(tests/program/test_groundtruth_events.py: the plain loop, each rank of the 2-rank FSDP2
program). `measure_program_ranks(..., with_timeline=True)` gives both per rank, or why the
timeline refused a rank. A run is measured once: nothing is repeated or chosen among runs.

The profiler learns the size of a block allocated before it started only from the ops that
take it, as the span of the tensors those ops see: a buffer used only through views
(DeepSpeed ZeRO-3's flat gradient partition, 332,416 B, seen through a 65,536 B slice) is
undercounted. With `whole_storages=True`, when the window opens every storage alive in the
process (the tensors the garbage collector tracks) is shown to the profiler once whole, by a
view of all its bytes, which allocates nothing (`memplan.capture.groundtruth
.profiler_peak_bytes` does the same for the tensors a step carries). Profiling each process
from its start instead records the Python tracer's every call from the imports on
(`with_stack`): gigabytes for a tiny DeepSpeed program.

Assumes a program small enough to train for real on the host's CPU, whose device choice falls
back to the CPU (`"cuda" if torch.cuda.is_available() else "cpu"`) and whose process group
falls back to gloo there.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memplan.parallel.groundtruth import PROFILER_LOGGER, _SizeMismatches
from memplan.program.deepspeed_engine import no_shm_comm_op
from memplan.program.launchers import parse_command, run_launched
from memplan.program.patches import Patches


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class RankPeaks:
    """One rank's measured peaks: `peak_bytes` from the allocation events (the ground truth),
    `c10_peak_bytes` from c10's own running total of the same profile (every thread's frees:
    `memplan.capture.groundtruth.c10_total_peak_bytes`), and torch's memory timeline's peak
    when asked for, or why its analysis refused the profile (`timeline_error`)."""

    rank: int
    peak_bytes: int
    c10_peak_bytes: int | None = None
    timeline_peak_bytes: int | None = None
    timeline_error: str | None = None


def measure_program(words: list[str], steps: int = 2, timeout_s: float = 600.0,
                    whole_storages: bool = False, warmup_steps: int = 0) -> list[int]:
    """Per rank, the profiler peak bytes of the real run of `words` (module docstring);
    with `warmup_steps`, the profiler opens at the first top-level call after that many
    optimizer steps (a compiled program compiles in its first step: Inductor's compile
    under the profiler's Python tracer took more than the host's memory)."""
    return [r.peak_bytes for r in measure_program_ranks(words, steps, timeout_s, whole_storages, warmup_steps)]


def measure_program_ranks(words: list[str], steps: int = 2, timeout_s: float = 600.0, whole_storages: bool = False,
                          warmup_steps: int = 0, with_timeline: bool = False) -> list[RankPeaks]:
    """`measure_program`'s run, each rank's `RankPeaks`: with `with_timeline`, torch's memory
    timeline of the same profile too (its analysis takes longer than the run)."""
    launch = parse_command(words)
    port = str(_free_port())
    with tempfile.TemporaryDirectory(prefix="memplan-run-gt-") as workdir:
        procs = []
        for rank in range(launch.world_size):
            env = {**os.environ, **launch.rank_env(rank), "MASTER_PORT": port, "MASTER_ADDR": "127.0.0.1",
                   "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
            spec = json.dumps({"words": words, "steps": steps, "out": f"{workdir}/rank{rank}.json", "rank": rank,
                               "threads": 1 if launch.world_size > 1 else 0, "whole_storages": whole_storages,
                               "warmup_steps": warmup_steps, "with_timeline": with_timeline})
            procs.append(subprocess.Popen([sys.executable, "-c",
                                           "from memplan.program.groundtruth import measure_rank; measure_rank()",
                                           spec], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        errors = []
        for rank, proc in enumerate(procs):
            _out, err = proc.communicate(timeout=timeout_s)
            if proc.returncode != 0:
                errors.append(f"rank {rank} exited {proc.returncode}: {err.decode()[-2000:]}")
        if errors:
            raise RuntimeError("the ground-truth run failed:\n" + "\n".join(errors))
        return [RankPeaks(rank=r, **json.loads(Path(workdir, f"rank{r}.json").read_text()))
                for r in range(launch.world_size)]


def _show_whole_storages() -> None:
    """One view of all the bytes of each storage alive, for the profiler (module docstring)."""
    import gc

    import torch

    seen: set[int] = set()
    for obj in gc.get_objects():
        if type(obj) is not torch.Tensor and type(obj) is not torch.nn.Parameter:
            continue
        try:
            storage = obj.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse or other storage-less layouts
            continue
        if storage.nbytes() == 0 or storage.device.type != "cpu" or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        torch.empty(0, dtype=torch.uint8).set_(storage).view(-1)


def measure_rank() -> None:
    """The body of one ground-truth process (spec as JSON in `sys.argv[1]`)."""
    import torch

    from memplan.capture.groundtruth import (
        c10_total_peak_bytes,
        events_peak_bytes,
        memory_profiler,
        report_every_cpu_free,
    )
    from memplan.program.steps import ProgramStop, StepWindow

    report_every_cpu_free()
    spec: dict[str, Any] = json.loads(sys.argv[1])
    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    launch = parse_command(spec["words"])
    profiler = memory_profiler()

    started = []

    def on_call(_call: Any) -> None:
        if not started and window.steps >= spec["warmup_steps"]:
            started.append(True)
            profiler.start()
            if spec["whole_storages"]:
                _show_whole_storages()

    window = StepWindow(spec["steps"] + 1, on_call=on_call)
    no_shm_comm_op(Patches())  # as in the traced run (memplan.program.deepspeed_engine)
    sys.argv = [launch.target, *launch.rank_args(spec["rank"])]
    if launch.path_entry is not None:
        sys.path.insert(0, launch.path_entry)
    sys.path.extend(launch.path_after)
    window.install()
    try:
        run_launched(launch)
    except ProgramStop:
        pass
    finally:
        window.remove()
    profiler.stop()
    result: dict[str, Any] = {"peak_bytes": events_peak_bytes(profiler, "cpu"),
                              "c10_peak_bytes": c10_total_peak_bytes(profiler, "cpu")}
    if spec["with_timeline"]:
        result.update(_timeline_peak(profiler))
    Path(spec["out"]).write_text(json.dumps(result))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _timeline_peak(profiler: Any) -> dict[str, Any]:
    """torch's memory timeline's peak of a stopped profile, or why its analysis refused it
    ("version mismatch"; or its own warnings that an address was freed with another size
    than it was allocated with: `memplan.parallel.groundtruth._SizeMismatches`)."""
    from memplan.capture.groundtruth import timeline_peak_bytes

    mismatches = _SizeMismatches()
    logger = logging.getLogger(PROFILER_LOGGER)
    logger.addHandler(mismatches)
    try:
        peak = timeline_peak_bytes(profiler, "cpu")
    except AssertionError as exc:
        return {"timeline_error": str(exc)[:200]}
    finally:
        logger.removeHandler(mismatches)
    if mismatches.count:
        return {"timeline_error": f"{mismatches.count} allocation/free size mismatches"}
    return {"timeline_peak_bytes": peak}
