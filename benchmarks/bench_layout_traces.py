"""Static planning (STWeaver) vs the caching allocator on captured training steps.

Captures three iterations of each training step with fake tensors on a fake `cuda`
device, plans it (`memplan.plan_addresses`: iterations 0 and 1, iteration 1 replayed for 2),
and replays the whole trace through caching, expandable segments and the plan.
Also one stage of a 1F1B pipeline (captured with `memplan.capture.pipeline`), a
small Mixtral whose expert token counts change every iteration (a real CPU run with
transformers' per-expert loop and a fresh batch each step), and a synthetic MoE-like
step (one activation per layer whose size changes every iteration). Writes the
`layout_traces` table of BENCHMARKS.md.

    .venv/bin/python benchmarks/bench_layout_traces.py [--models gpt2,llama-3.2-1b] [--no-write]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks_md import write_section  # noqa: E402
from memplan import models  # noqa: E402
from memplan.alloc import replay  # noqa: E402
from memplan.capture import capture, capture_model  # noqa: E402
from memplan.capture.pipeline import capture_pipeline_stage  # noqa: E402
from memplan.capture.step import build_training_step  # noqa: E402
from memplan.layout import plan_addresses  # noqa: E402
from memplan.layout.generate import training_trace  # noqa: E402
from memplan.models.setup import TrainingSetup  # noqa: E402

BENCH = "layout_traces"
SETUPS = {
    "full checkpointing (batch 4, seq 1024)": dict(batch=4, seq=1024, precision="bf16-true", checkpointing="full"),
    "4 grad-accum micro-batches (batch 2, seq 1024)": dict(batch=2, seq=1024, precision="bf16-true", grad_accum=4),
}


def measure(label: str, trace) -> tuple:
    start = time.perf_counter()
    result = plan_addresses(trace)
    plan_s = time.perf_counter() - start
    runs = {name: replay(trace, name, segment_map=False) for name in ("caching", "expandable")}
    runs["planned"] = replay(trace, "planned", plan=result)
    lower = trace.peak()[0]
    print(f"{label}: {trace.num_buffers:,} buffers, plan {plan_s:.2f} s, {runs['planned'].extra}", file=sys.stderr)
    return label, trace.num_buffers, lower, runs, plan_s


def varying_moe_trace(iterations: int):
    """A small Mixtral trained for real on CPU, a new batch every step: routing, and so
    the sizes of the per-expert buffers, change between iterations."""
    config = models.tiny_config("mixtral-8x7b", hidden_size=128, intermediate_size=256,
                                num_hidden_layers=4, num_local_experts=8)
    config._experts_implementation = "eager"  # the per-expert loop: data-dependent sizes
    setup = TrainingSetup(precision="32-true", batch=4, seq=64, optimizer_impl="foreach")
    built = build_training_step(config, setup, device="cpu")
    calls = [0]

    def step():
        calls[0] += 1
        built.batches[:] = [models.make_batch(built.model, setup, device="cpu", seed=100 + calls[0])]
        built.run()

    return capture(step, model=built.model, optimizer=built.optimizer, iterations=iterations, warmup=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2,llama-3.2-1b")
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    rows = []
    for model in args.models.split(","):
        for label, fields in SETUPS.items():
            trace = capture_model(model, TrainingSetup(**{"precision": "32-true", **fields}), fake=True, device="cuda", iterations=args.iterations)
            rows.append(measure(f"{model} / {label}", trace))
    stage = capture_pipeline_stage(
        "llama-3.2-1b", TrainingSetup(batch=2, seq=1024, precision="bf16-true"), stages=4, stage=0, microbatches=8,
        iterations=args.iterations,
    )
    rows.append(measure("llama-3.2-1b / 1F1B stage 0 of 4, 8 micro-batches (batch 2, seq 1024)", stage))
    rows.append(measure("mixtral (4 layers, 8 experts, hidden 128; real CPU run, token counts vary per "
                        "iteration)", varying_moe_trace(args.iterations)))
    synthetic = training_trace(iterations=args.iterations, microbatches=4, layers=24, dynamic=True,
                               hidden_bytes=16 << 20, weight_bytes=64 << 20)
    rows.append(measure("synthetic MoE-like step (sizes vary per iteration; not captured)", synthetic))
    gib = 2**30
    lines = [
        f"<!-- bench:{BENCH} -->",
        "### Static planning (STWeaver) on training steps",
        "",
        f"Command: `.venv/bin/python benchmarks/bench_layout_traces.py --models {args.models} "
        f"--iterations {args.iterations}`",
        "",
        f"{args.iterations} training iterations (AdamW, bf16) captured with fake tensors on a fake `cuda` "
        "device; the plan covers iterations 0-1 and is replayed periodically. Peak reserved in GiB, "
        "fragmentation = 1 - peak allocated / peak reserved, lower bound = max live bytes; "
        "planned overhead = planned peak reserved / lower bound - 1.",
        "",
        "| trace | buffers | lower bound | caching reserved | caching frag. | expandable reserved | "
        "expandable frag. | planned reserved | planned frag. | planned overhead | planning (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, n, lower, runs, plan_s in rows:
        c, e, p = runs["caching"], runs["expandable"], runs["planned"]
        lines.append(
            f"| {label} | {n:,} | {lower / gib:.3f} | {c.peak_reserved_bytes / gib:.3f} | {c.fragmentation:.1%} | "
            f"{e.peak_reserved_bytes / gib:.3f} | {e.fragmentation:.1%} | {p.peak_reserved_bytes / gib:.3f} | "
            f"{p.fragmentation:.2%} | {p.peak_reserved_bytes / lower - 1:+.3%} | {plan_s:.2f} |"
        )
    lines.append(f"<!-- /bench:{BENCH} -->")
    table = "\n".join(lines)
    print(table)
    if not args.no_write:
        write_section(BENCH, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
