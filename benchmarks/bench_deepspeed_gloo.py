"""DeepSpeed's ZeRO on real gloo ranks against memplan's modelled `--engine deepspeed`.

DeepSpeed runs on a CPU with its CPU accelerator (`DS_ACCELERATOR=cpu`, gloo, after it
JIT-builds its shared-memory communication op once). This script starts `--world-size`
processes, wraps the tiny Llama of the test suite in `deepspeed.initialize` with the
ZeRO stage and knobs of each case and the setup's torch optimizer (foreach AdamW, as the
trace), runs one warm-up step and profiles one step per rank with torch.profiler
(`memplan.capture.groundtruth.profiler_peak_bytes`), then compares every rank with
`estimate(..., device="cpu", allocator="none")` of the same layout.

The "memplan run" columns trace DeepSpeed itself rather than model it: the same model and
DeepSpeed config in a script (tests/program/programs/deepspeed_loop.py: `deepspeed.initialize`
with the client foreach AdamW) under `memplan run --device cpu -- deepspeed --num_gpus W ...`
(`run_program`, 2 optimizer steps), against the same command run for real on gloo and
measured by torch.profiler over the same steps (`measure_program`, every storage alive at
the window's opening shown to the profiler whole: `whole_storages`; a real run that misses by
more than 1% on some rank is run again, `program_run`). DeepSpeed is pinned in
requirements.lock (`pip install -r requirements.lock`):

    DS_ACCELERATOR=cpu PYTHONPATH=src .venv/bin/python benchmarks/bench_deepspeed_gloo.py

Writes the `deepspeed_groundtruth` table of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from benchmarks_md import write_section  # noqa: E402
from memplan import models  # noqa: E402
from memplan.capture.groundtruth import profiler_peak_bytes  # noqa: E402
from memplan.estimation import estimate  # noqa: E402
from memplan.parallel import Layout  # noqa: E402
from memplan.parallel.layout import DeepSpeedConfig  # noqa: E402

COMMAND = "DS_ACCELERATOR=cpu PYTHONPATH=src .venv/bin/python benchmarks/bench_deepspeed_gloo.py"
PROGRAM = Path(__file__).resolve().parents[1] / "tests" / "program" / "programs" / "deepspeed_loop.py"
REAL_RUNS = 3  # real runs of the memplan run columns at most (program_run)
SMALL_BUCKET = 100_000  # elements: the default 5e8 would be 2 GB per rank for a 166k-parameter model
CASES = [  # (name, setup options, ZeRO stage, layout knobs)
    ("zero1", {}, 1, {"reduce_bucket_size": SMALL_BUCKET}),
    ("zero2", {}, 2, {"reduce_bucket_size": SMALL_BUCKET}),
    ("zero3", {}, 3, {"reduce_bucket_size": SMALL_BUCKET, "param_persistence_threshold": 0}),
    ("zero3-persistent", {}, 3, {"reduce_bucket_size": SMALL_BUCKET}),
    ("zero2-bf16", {"precision": "bf16-true"}, 2, {"reduce_bucket_size": SMALL_BUCKET}),
    ("zero3-bf16", {"precision": "bf16-true"}, 3, {"reduce_bucket_size": SMALL_BUCKET, "param_persistence_threshold": 0}),
]


def ds_config(setup: models.TrainingSetup, stage: int, layout: Layout) -> dict[str, Any]:
    """The DeepSpeed config of one case (memplan's knobs under DeepSpeed's names)."""
    knobs = layout.deepspeed
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": knobs.reduce_bucket_size,
                            "overlap_comm": knobs.overlap_comm if stage < 3 else True}
    if stage == 3:
        zero.update(stage3_prefetch_bucket_size=knobs.prefetch_bucket_size,
                    stage3_param_persistence_threshold=knobs.param_persistence_threshold,
                    stage3_max_live_parameters=knobs.max_live_parameters)
    return {"train_micro_batch_size_per_gpu": setup.batch, "gradient_accumulation_steps": 1,
            "zero_optimization": zero, "bf16": {"enabled": setup.dtype == "bf16"}}


def _rank_main(rank: int, world_size: int, case: tuple, workdir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getppid() % 400), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    _, options, stage, knobs = case
    setup = models.TrainingSetup(batch=2, seq=32, optimizer_impl="foreach", **{"precision": "32-true", **options})
    layout = Layout(world_size=world_size, zero=stage, engine="deepspeed", deepspeed=DeepSpeedConfig(**knobs))
    torch.manual_seed(0)
    model = models.build_model(models.tiny_config("llama-2-7b"), setup)
    optimizer = models.build_optimizer(model, setup)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(setup, stage, layout))
    batch = models.make_batch(model, setup)

    def step() -> None:
        loss = models.forward_loss(engine, batch)
        engine.backward(loss)
        engine.step()
        del loss

    step()
    Path(workdir, f"rank{rank}.json").write_text(json.dumps(profiler_peak_bytes(step)))


def measure(case: tuple, world_size: int) -> list[int]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="memplan-ds-") as workdir:
        mp.spawn(_rank_main, args=(world_size, case, workdir), nprocs=world_size, join=True)
        return [json.loads(Path(workdir, f"rank{r}.json").read_text()) for r in range(world_size)]


def measure_retried(case: tuple, world_size: int, attempts: int = 3) -> list[int]:
    """`measure`, run again in fresh processes when torch's memory-profiler analysis fails
    ("duplicate outputs", "version mismatch": memplan.parallel.groundtruth)."""
    for attempt in range(attempts):
        try:
            return measure(case, world_size)
        except Exception as exc:  # mp.spawn re-raises the rank's AssertionError as its own
            if attempt == attempts - 1 or "duplicate outputs" not in str(exc) and "version mismatch" not in str(exc):
                raise
    raise AssertionError("unreachable")


def program_run(case: tuple, world_size: int) -> tuple[list[int], list[list[int]]] | str:
    """`memplan run --device cpu` of the case's DeepSpeed script, and the same command's real
    gloo runs under torch.profiler: the per-rank peaks of the traced run and of each real run,
    or why memplan run refused it (no real run where the profiler's analysis failed each time).
    A real run that misses the traced one by more than 1% on
    some rank is repeated in fresh processes, up to `REAL_RUNS` runs in all, and each rank's
    smallest peak is compared, as the suite does (tests/program/test_run_deepspeed.py): a
    buffer of an all-gather still held when the rank peaks, whose timing depends on gloo's
    worker thread, counts in some real runs and not in others (docs/run.md, "DeepSpeed")."""
    from memplan.errors import UserError
    from memplan.program import run_program

    _, options, stage, knobs = case
    setup = models.TrainingSetup(batch=2, seq=32, optimizer_impl="foreach", **{"precision": "32-true", **options})
    layout = Layout(world_size=world_size, zero=stage, engine="deepspeed", deepspeed=DeepSpeedConfig(**knobs))
    with tempfile.TemporaryDirectory(prefix="memplan-ds-run-") as workdir:
        models.tiny_config("llama-2-7b").save_pretrained(workdir)
        Path(workdir, "ds.json").write_text(json.dumps(ds_config(setup, stage, layout)))
        text = " ".join(["the quick brown fox jumps over a lazy dog while memory is planned"] * 300)
        Path(workdir, "data.txt").write_text(text)
        command = ["deepspeed", "--num_gpus", str(world_size), str(PROGRAM), "--model", workdir, "--data",
                   f"{workdir}/data.txt", "--deepspeed_config", f"{workdir}/ds.json"]
        try:
            traced = run_program(command, device="cpu", steps=1, out_dir=f"{workdir}/run").estimate.per_rank
        except UserError as exc:
            return str(exc).split(": ", 1)[-1].split(":", 1)[0]
        peaks = [r.peak_allocated_bytes for r in traced]
        runs: list[list[int]] = []
        for _ in range(REAL_RUNS):
            if runs and all(abs(t - r) <= 0.01 * r for t, r in zip(peaks, map(min, zip(*runs)))):
                break
            runs += _measured(command)
        print(f"{case[0]}: real runs {runs}", flush=True)
        return peaks, runs


def _measured(command: list[str]) -> list[list[int]]:
    """The per-rank peaks of one real run (`measure_program`) in a list, or no run where torch's
    memory-profiler analysis failed on each of its attempts (that run has no ground truth)."""
    from memplan.program import measure_program

    try:
        return [measure_program(command, steps=1, whole_storages=True)]
    except RuntimeError as exc:
        if "memory analysis failed" not in str(exc):
            raise
        print(f"no ground truth from this run: {str(exc)[:120]}", flush=True)
        return []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--only", nargs="*", default=None, metavar="NAME")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    rows = ["## DeepSpeed ZeRO on real gloo ranks vs the modelled estimate", "",
            "Tiny Llama (2 blocks, hidden 64), batch 2 x 32, foreach AdamW, DeepSpeed 0.19.8 on its CPU",
            "accelerator, one profiled step per rank after one warm-up step. Reproduce with:", "", "```", COMMAND,
            "```", "", "memplan run: the same model and config in a DeepSpeed script, traced by",
            "`memplan run --device cpu -- deepspeed --num_gpus 2 ...` over its first 2 optimizer steps,",
            "against that command run for real on gloo under torch.profiler over the same steps, every",
            "storage alive when they begin shown to the profiler whole (`measure_program(whole_storages=True)`).",
            "A real run that misses by more than 1% on some rank is repeated in fresh processes (3 runs at",
            "most) and each rank's smallest peak is compared; the cell then lists every run's peaks",
            "(docs/run.md, \"DeepSpeed\": an all-gather's buffer that gloo's thread still holds at the peak).", "",
            "| case | layout knobs | estimate B | real B per rank | error per rank | memplan run B per rank "
            "| real run B per rank | run error per rank |",
            "|---|---|---:|---:|---|---:|---:|---|"]
    for case in CASES:
        name, options, stage, knobs = case
        if args.only and name not in args.only:
            continue
        setup = models.TrainingSetup(batch=2, seq=32, optimizer_impl="foreach", **{"precision": "32-true", **options})
        layout = Layout(world_size=args.world_size, zero=stage, engine="deepspeed", deepspeed=DeepSpeedConfig(**knobs))
        predicted = estimate(models.tiny_config("llama-2-7b"), setup, layout, device="cpu",
                             allocator="none").peak_allocated_bytes
        real = measure_retried(case, args.world_size)
        errors = ", ".join(f"{100 * (predicted - r) / r:+.2f}%" for r in real)
        print(f"{name}: estimate {predicted}, real {real} ({errors})", flush=True)
        label = ", ".join(f"{k}={v}" for k, v in {**options, **knobs}.items())
        row = f"| {name} (zero {stage}) | {label} | {predicted:,} | {', '.join(f'{r:,}' for r in real)} | {errors} "
        ran = program_run(case, args.world_size)
        if isinstance(ran, str):
            print(f"{name}: memplan run refused: {ran}", flush=True)
            rows.append(row + f"| refused: {ran} | | |")
            continue
        traced, runs = ran
        if not runs:
            rows.append(row + f"| {', '.join(f'{t:,}' for t in traced)} | no ground truth: torch.profiler's memory "
                        f"analysis failed on every attempt of {REAL_RUNS} runs | |")
            continue
        run_real = [min(peaks) for peaks in zip(*runs)]
        run_errors = ", ".join(f"{100 * (t - r) / r:+.3f}%" for t, r in zip(traced, run_real))
        print(f"{name}: memplan run {traced}, real run {run_real} ({run_errors})", flush=True)
        real_cell = ", ".join(f"{r:,}" for r in run_real) + (f" (smallest of {len(runs)} runs: "
                                                               + "; ".join(", ".join(f"{r:,}" for r in peaks)
                                                                           for peaks in runs) + ")"
                                                               if len(runs) > 1 else "")
        rows.append(row + f"| {', '.join(f'{t:,}' for t in traced)} | {real_cell} | {run_errors} |")
    if not args.no_write and not args.only:
        write_section("deepspeed_groundtruth", "\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
