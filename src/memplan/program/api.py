"""`run_program(command, ...)`: the memory of the user's own training program (docs/run.md).

The command is read as its launcher reads it (memplan.program.launchers); each rank traced
is run in this process, one after the other (memplan.program.runner), and its trace goes
through the estimate's device stages (memplan.program.estimate). Ranks: `"distinct"` traces
rank 0, then the first rank of every other class of ranks whose parameter shards differ
(memplan.program.distributed.distinct_ranks); `"all"` every rank; a number, or numbers
separated by commas, those ranks.

Files under `out_dir`: `rankR.memtrace` per traced rank (for `memplan show`, `plan`,
`offload`, `report`, `compare`), and `run.json` (what `--json` prints). The program's own
writes go under `out_dir/files/` (memplan.program.side_effects).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from memplan.errors import UserError
from memplan.estimation.pipeline import Estimate, RankEstimate
from memplan.hardware.devices import DeviceProfile, device_profile
from memplan.program import cuda_api, deepspeed_engine
from memplan.program.distributed import distinct_ranks
from memplan.program.estimate import rank_estimate
from memplan.program.launchers import Launch, parse_command
from memplan.program.runner import RankRun, RunOptions, run_rank
from memplan.trace import save
from memplan.trace.model import PHASE, Trace

DEFAULT_GPU = "h100-80gb"  # the profile a cuda run answers for when --gpu is not given


@dataclass
class ProgramRun:
    """The result of `run_program`: the estimate, per traced rank what ran, and the files."""

    launch: Launch
    estimate: Estimate
    runs: list[RankRun]
    seen: dict[str, Any]
    files: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        runs = [{"rank": r.rank, "steps": r.steps, "ended": r.ended, "elapsed_s": round(r.elapsed_s, 3),
                 "values_read": r.reads, "writes_skipped": r.skipped_writes, "writes_redirected": r.redirected_writes}
                for r in self.runs]
        return {**self.estimate.to_json(), "watched_model": self.seen["model"],
                "torch_version": str(torch.__version__), "command": [self.launch.launcher, self.launch.target, *self.launch.args],
                "launcher": self.launch.launcher, "world_size": self.launch.world_size, "seen": self.seen,
                "runs": runs, "files": self.files}


def parse_ranks(spec: str | int, world_size: int) -> list[int] | str:
    """"all", "distinct", or the rank numbers of `spec` (each below `world_size`)."""
    if isinstance(spec, str) and spec in ("all", "distinct"):
        return spec
    try:
        ranks = [int(spec)] if isinstance(spec, int) else [int(x) for x in str(spec).split(",")]
    except ValueError:
        raise UserError(f"--ranks takes all, distinct, or rank numbers (0,3), not {spec!r}") from None
    bad = [r for r in ranks if not 0 <= r < world_size]
    if bad:
        raise UserError(f"--ranks {spec}: the world has ranks 0..{world_size - 1}")
    return sorted(set(ranks))


def _progress(message: str, on: bool) -> None:
    if on:
        sys.stderr.write(f"memplan run: {message}\n")


def _traced_runs(launch: Launch, options: RunOptions, ranks: list[int] | str,
                 progress: bool) -> tuple[list[RankRun], dict[int, list[int]]]:
    """Run the ranks to trace; each traced rank -> the ranks it stands for."""
    first = 0 if not isinstance(ranks, list) else ranks[0]
    _progress(f"running rank {first} of {launch.world_size}", progress)
    runs = [run_rank(launch, first, options)]
    if isinstance(ranks, list):
        stands_for = {r: [r] for r in ranks}
    elif ranks == "all" or deepspeed_engine.wraps_a_model(runs[0].seen.models):  # DeepSpeed: every rank
        stands_for = {r: [r] for r in range(launch.world_size)}
    else:  # "distinct"
        stands_for = distinct_ranks(runs[0].seen.models, launch.world_size) if launch.world_size > 1 else {0: [0]}
    for rank in sorted(stands_for):
        if rank != first:
            _progress(f"running rank {rank} (stands for ranks {stands_for[rank]})", progress)
            runs.append(run_rank(launch, rank, options))
    return runs, stands_for


def run_program(command: list[str], *, device: str = "cuda", gpu: str | None = None, steps: int = 2,
                ranks: str | int = "distinct", max_seconds: float | None = 600.0,
                out_dir: str | Path = "memplan-run", progress: bool = False) -> ProgramRun:
    """Run the training `command` (its words, as typed) and estimate its memory (module docstring)."""
    start = time.perf_counter()
    if device not in ("cuda", "cpu"):
        raise UserError(f"--device {device}: memplan run runs a program for cuda or cpu")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise UserError(f"--steps takes the optimizer steps after the first (0 or more), not {steps!r}")
    profile: DeviceProfile | None = device_profile(gpu or DEFAULT_GPU) if device == "cuda" else None
    if device == "cpu" and gpu is not None:
        raise UserError("--gpu names the GPU of a cuda run: leave it out with --device cpu")
    launch = parse_command(list(command), (lambda: cuda_api.answering(profile)) if profile is not None else None)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    options = RunOptions(device=device, profile=profile, steps=steps, max_seconds=max_seconds, out_dir=out)
    runs, stands_for = _traced_runs(launch, options, parse_ranks(ranks, launch.world_size), progress)
    per_rank, files = [], {}
    for run in runs:
        if run.trace is None:
            raise UserError(f"rank {run.rank}: the program called no module with parameters before it "
                            f"{'ended' if run.ended == 'ended' else 'stopped'}: there was no training step to trace")
        path = out / f"rank{run.rank}.memtrace"
        save(run.trace, path)
        files[f"rank{run.rank}"] = str(path)
        per_rank.append(rank_estimate(run.trace, run.rank, stands_for.get(run.rank, [run.rank]), device, profile,
                                      world_size=launch.world_size, process_groups=run.process_groups))
    result = _program_run(launch, runs, per_rank, profile, device, time.perf_counter() - start)
    files["json"] = str(out / "run.json")
    result.files = files
    Path(files["json"]).write_text(json.dumps(result.to_json(), indent=2, default=str) + "\n")
    return result


def _recomputed_ops(trace: Trace) -> int:
    """Ops the trace ran in backward as a module's forward again: activation checkpointing."""
    return int((trace.ops["phase"] == PHASE["recompute"]).sum()) if trace.num_ops else 0


def _program_run(launch: Launch, runs: list[RankRun], per_rank: list[RankEstimate], profile: DeviceProfile | None,
                 device: str, elapsed_s: float) -> ProgramRun:
    seen = {**runs[0].facts, "recomputed_ops": _recomputed_ops(runs[0].trace)}
    identity = seen["model"]
    layout = {"world_size": launch.world_size, **{k: v for k, v in seen["layout"].items() if k != "world_size"}}
    estimate = Estimate(
        model=str(identity.get("name", "program")), parameters=int(identity.get("parameters", 0)),
        setup={k: v for k, v in seen["setup"].items() if k != "impl"}, layout=layout, per_rank=per_rank,
        capacity_bytes=profile.capacity_bytes if profile is not None else None, device=device,
        allocator="caching" if device == "cuda" else "none", gpu=profile.key if profile is not None else None,
        method="program", elapsed_s=elapsed_s,
        parallel="the program's own, traced on a fake process group" if launch.world_size > 1 else "single device")
    return ProgramRun(launch, estimate, runs, seen)
