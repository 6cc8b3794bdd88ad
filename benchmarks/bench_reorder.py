"""Benchmark: operator reordering of whole training steps (memplan.order, docs/reorder.md).

For each model and batch, traces the whole training step (forward, loss, backward,
AdamW; a CUDA job's defaults: foreach optimizer, split per parameter) on fake tensors
and reports the theoretical peak (ROAM's definition, parameters and optimizer states
included) of: the program order (eager PyTorch), the best Inductor-style order (LPMF,
BFS, DFS or the traced order, chosen per forward / backward / optimizer graph), and
memplan's order, with the optimiser's time and the whole run's time (tracing included).
Writes the `<!-- bench:reorder -->` section of BENCHMARKS.md.

    .venv/bin/python benchmarks/bench_reorder.py [--time-limit 60] [--only gpt2]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# (label, model spec, seq or None for the model's default, batches)
CASES = [
    ("gpt2", "gpt2", 1024, (1, 32)),
    ("gpt2-xl", "gpt2-xl", 1024, (1, 32)),
    ("bert-base", "bert-base", 512, (1, 32)),
    ("roberta-base", "roberta-base", 512, (1, 32)),
    ("ViT-base", "bench_reorder:vit_base", None, (1, 32)),
    ("llama-3.2-1b", "llama-3.2-1b", 1024, (1, 32)),
    ("opt-350m", "opt-350m", 1024, (1, 32)),
]

# Beyond the main cases: short sequences, where the optimizer phase (gradients and
# AdamW temporaries) rather than the saved activations sets the peak (docs/reorder.md §5).
SHORT_CASES = [
    ("gpt2", "gpt2", 128, (1,)),
    ("gpt2-xl", "gpt2-xl", 128, (1,)),
    ("bert-base", "bert-base", 128, (1,)),
    ("roberta-base", "roberta-base", 128, (1,)),
    ("llama-3.2-1b", "llama-3.2-1b", 128, (1,)),
    ("opt-350m", "opt-350m", 128, (1,)),
]


def vit_base(setup):  # noqa: ANN001, ANN201 - a memplan model factory
    """ViT-base/16 at 224x224 for image classification (1000 classes), HF transformers."""
    import contextlib

    import torch
    from transformers import ViTConfig, ViTForImageClassification
    from transformers.initialization import no_init_weights

    config = ViTConfig(num_labels=1000)  # ViT-base: hidden 768, 12 layers, 12 heads, patch 16
    with no_init_weights() if _fake() else contextlib.nullcontext():  # fake weights have no values
        model = ViTForImageClassification(config)

    def make_batch(setup, device, seed):  # noqa: ANN001, ANN202
        generator = None if _fake() else torch.Generator().manual_seed(seed)
        shape = (setup.batch, 3, config.image_size, config.image_size)
        pixels = torch.randn(shape, generator=generator, device=device)
        labels = torch.randint(0, config.num_labels, (setup.batch,), generator=generator, device=device)
        return {"pixel_values": pixels, "labels": labels}

    model.make_batch = make_batch
    if _fake():
        # memplan's factory builder then calls model.to(device, dtype), which under
        # FakeTensorMode fails for Conv2d (PyTorch swaps the parameter and refuses the
        # fake tensor); the model is already on the device, in fp32.
        model.to = lambda *args, **kwargs: model
    return model


def _fake() -> bool:
    from memplan.models import is_fake_mode_active

    return is_fake_mode_active()


def run_case(spec: str, batch: int, seq: int | None, time_limit_s: float, optimizer: str = "adamw") -> dict:
    """Trace `spec`'s whole training step (fake tensors, a CUDA job's defaults) and
    optimise its order; the row's peaks, lower bound and times."""
    from memplan import models
    from memplan.order import capture_model_step
    from memplan.order.solve import optimize_order

    start = time.perf_counter()
    model = models.load_config(spec)
    setup = models.TrainingSetup(precision="32-true", batch=batch, seq=seq, optimizer=optimizer)
    graph = capture_model_step(model, setup, device="cuda")
    result = optimize_order(graph, time_limit_s=time_limit_s)
    total = time.perf_counter() - start
    row = {
        "num_nodes": result.num_nodes,
        "baseline": result.baseline_peak_bytes,
        "inductor": result.inductor_peak_bytes,
        "optimized": result.optimized_peak_bytes,
        "lower_bound": result.lower_bound_bytes,
        "persistent": graph.persistent_bytes,
        "optimize_s": result.elapsed_s,
        "total_s": round(total, 1),
        "verified": result.verified,
        "start": result.stats.get("start"),
    }
    del graph, result
    gc.collect()
    return row


def progress_line(case: str, row: dict) -> str:
    """One case's figures, as printed while a benchmark runs."""
    red = 1 - row["optimized"] / row["baseline"]
    bound = _gib(row["lower_bound"]) if row["lower_bound"] is not None else "-"
    return (f"{case}: {row['num_nodes']} nodes, program {_gib(row['baseline'])} GiB, "
            f"inductor {_gib(row['inductor'])}, memplan {_gib(row['optimized'])} ({100 * red:.1f}%), "
            f"lb {bound}, opt {row['optimize_s']} s, total {row['total_s']} s, start {row['start']}")


def reproduce_command(script: str, time_limit_s: float, only: list[str] | None, *flags: str) -> str:
    """The command line that reproduces a reorder benchmark's table."""
    command = f".venv/bin/python benchmarks/{script}"
    if time_limit_s != 60.0:
        command += f" --time-limit {time_limit_s:g}"
    if only:
        command += " --only " + " ".join(only)
    return " ".join([command, *(f for f in flags if f)])


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f}"


def _summary(rows: list[tuple[str, int, int | None, dict]]) -> str:
    reductions = [1 - r["optimized"] / r["baseline"] for *_x, r in rows]
    vs_inductor = [1 - r["optimized"] / r["inductor"] for *_x, r in rows]
    at_bound = sum(r["optimized"] == r["lower_bound"] for *_x, r in rows)
    return (
        f"mean reduction vs program order {100 * statistics.mean(reductions):.1f}% "
        f"(median {100 * statistics.median(reductions):.1f}%, max {100 * max(reductions):.1f}%); "
        f"vs Inductor-style mean {100 * statistics.mean(vs_inductor):.1f}%, never worse: "
        f"{all(r['optimized'] <= r['inductor'] for *_x, r in rows)}; "
        f"at the lower bound (proven optimal): {at_bound} of {len(rows)}"
    )


def write_section(
    rows: list[tuple[str, int, int | None, dict]], short_rows: list[tuple[str, int, int | None, dict]],
    time_limit_s: float, command: str,
) -> None:
    lines = [
        "<!-- bench:reorder -->",
        "## Operator reordering of the whole training step (memplan reorder, ROAM)",
        "",
        f"Command: `{command}`",
        "",
        "Theoretical peak (ROAM's definition: parameters, AdamW states and inputs plus the",
        "intermediates alive while each operator runs) of one training step traced on fake",
        "tensors with a CUDA job's defaults (foreach AdamW, fp32, no checkpointing). Program",
        "order = eager PyTorch; Inductor-style = the best of LPMF, BFS, DFS and the traced",
        "order, per forward / backward / optimizer graph (Inductor never crosses them);",
        f"memplan = `optimize_order` with a {time_limit_s:g} s limit (validated). Total time",
        "includes tracing. GiB = 2^30 bytes.",
        "",
        "| model | batch | seq | nodes | program order GiB | Inductor-style GiB | memplan GiB | vs program | "
        "vs Inductor | lower bound GiB | optimise s | total s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, batch, seq, r in rows + short_rows:
        red = 1 - r["optimized"] / r["baseline"]
        red_i = 1 - r["optimized"] / r["inductor"]
        lines.append(
            f"| {label} | {batch} | {seq if seq else '224²'} | {r['num_nodes']} | {_gib(r['baseline'])} | "
            f"{_gib(r['inductor'])} | {_gib(r['optimized'])} | {100 * red:.1f}% | {100 * red_i:.1f}% | "
            f"{_gib(r['lower_bound'])} | {r['optimize_s']:.1f} | {r['total_s']:.1f} |"
        )
    lines += ["", f"Main cases (first {len(rows)} rows): {_summary(rows)}."]
    if short_rows:
        lines += ["", f"Short sequences (last {len(short_rows)} rows, seq 128): {_summary(short_rows)}."]
    lines += ["<!-- /bench:reorder -->"]
    from benchmarks_md import write_section as write_bench_section

    write_bench_section("reorder", "\n".join(lines))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--only", nargs="*", default=None, help="labels to run (default all)")
    parser.add_argument("--no-short", action="store_true", help="only the main cases (no seq-128 rows)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")
    args = parser.parse_args()
    import logging
    import os
    import warnings

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    rows: list = []
    short_rows: list = []
    cases = [(c, rows) for c in CASES] + ([] if args.no_short else [(c, short_rows) for c in SHORT_CASES])
    for (label, spec, seq, batches), into in cases:
        if args.only and label not in args.only:
            continue
        for batch in batches:
            row = run_case(spec, batch, seq, args.time_limit)
            into.append((label, batch, seq, row))
            print(progress_line(f"{label} b{batch}", row), flush=True)
    command = reproduce_command("bench_reorder.py", args.time_limit, args.only, "--no-short" if args.no_short else "")
    if rows and not args.no_write:
        write_section(rows, short_rows, args.time_limit, command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
