"""CPU ground truth for `memplan run`: the same command run for real, measured by the profiler.

`measure_program(words, steps=2)` runs the training command for real on the CPU in fresh
processes, one per rank, as its launcher would start them (`Launch.rank_env`: RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; the ranks meet on gloo through the
program's own `init_process_group`, with a free local port), each with nothing of memplan's
world installed: real weights, real data, real collectives. In each rank, torch.profiler's
memory timeline (`memplan.capture.groundtruth.memory_profiler`) runs over the same window
memplan's trace covers (`memplan.program.steps.StepWindow`: from the program's first
top-level forward to its stop after `steps + 1` optimizer steps), and the rank's peak is the
peak of the timeline's total on the cpu (`timeline_peak_bytes`). It returns the per-rank
peaks in rank order.

The profiler learns the size of a block allocated before it started only from the ops that
take it, as the span of the tensors those ops see: a buffer used only through views
(DeepSpeed ZeRO-3's flat gradient partition, 332,416 B, seen through a 65,536 B slice) is
undercounted. With `whole_storages=True`, when the window opens every storage alive in the
process (the tensors the garbage collector tracks) is shown to the profiler once whole, by a
view of all its bytes, which allocates nothing (`memplan.capture.groundtruth
.profiler_peak_bytes` does the same for the tensors a step carries). Profiling each process
from its start instead records the Python tracer's every call from the imports on
(`with_stack`): gigabytes for a tiny DeepSpeed program.

torch's memory-profiler analysis sometimes fails on an FSDP2 step ("version mismatch"), or
reports its own timeline inconsistent ("Mismatch between allocation and free": gloo's worker
thread frees and re-uses an address; `memplan.parallel.groundtruth`): then the whole set of
processes runs again, fresh, up to `PROFILER_ATTEMPTS` times. A run either measures on every
rank or is repeated; no value is chosen among runs.

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
from pathlib import Path
from typing import Any

from memplan.parallel.groundtruth import PROFILER_ATTEMPTS, PROFILER_LOGGER, _SizeMismatches
from memplan.program.deepspeed_engine import no_shm_comm_op
from memplan.program.launchers import parse_command, run_launched
from memplan.program.patches import Patches


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure_program(words: list[str], steps: int = 2, timeout_s: float = 600.0,
                    whole_storages: bool = False, warmup_steps: int = 0) -> list[int]:
    """Per rank, the profiler peak bytes of the real run of `words` (module docstring);
    with `warmup_steps`, the profiler opens at the first top-level call after that many
    optimizer steps (a compiled program compiles in its first step: Inductor's compile
    under the profiler's Python tracer took more than the host's memory)."""
    failures = []
    for _ in range(PROFILER_ATTEMPTS):
        peaks, failed = _measured_run(words, steps, timeout_s, whole_storages, warmup_steps)
        if not failed:
            return peaks
        failures.append(failed)
    raise RuntimeError(f"torch.profiler's memory analysis failed {PROFILER_ATTEMPTS} times: {failures}")


def _measured_run(words: list[str], steps: int, timeout_s: float,
                  whole_storages: bool, warmup_steps: int) -> tuple[list[int], list[str]]:
    """One fresh set of processes: the per-rank peaks, and the ranks whose analysis failed."""
    launch = parse_command(words)
    port = str(_free_port())
    with tempfile.TemporaryDirectory(prefix="memplan-run-gt-") as workdir:
        procs = []
        for rank in range(launch.world_size):
            env = {**os.environ, **launch.rank_env(rank), "MASTER_PORT": port, "MASTER_ADDR": "127.0.0.1",
                   "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
            spec = json.dumps({"words": words, "steps": steps, "out": f"{workdir}/rank{rank}.json", "rank": rank,
                               "threads": 1 if launch.world_size > 1 else 0, "whole_storages": whole_storages,
                               "warmup_steps": warmup_steps})
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
        results = [json.loads(Path(workdir, f"rank{r}.json").read_text()) for r in range(launch.world_size)]
    return [r.get("peak_bytes", -1) for r in results], [f"rank {i}: {r['failed']}" for i, r in enumerate(results)
                                                        if "failed" in r]


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

    from memplan.capture.groundtruth import memory_profiler, timeline_peak_bytes
    from memplan.program.steps import ProgramStop, StepWindow

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
    logger = logging.getLogger(PROFILER_LOGGER)
    mismatches = _SizeMismatches()
    logger.addHandler(mismatches)
    try:
        result: dict[str, Any] = {"peak_bytes": timeline_peak_bytes(profiler, "cpu"), "steps": window.steps}
        if mismatches.count:
            result = {"failed": f"{mismatches.count} allocation/free size mismatches"}
    except AssertionError as exc:
        result = {"failed": str(exc)[:100]}
    Path(spec["out"]).write_text(json.dumps(result))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
