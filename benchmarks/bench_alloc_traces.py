"""Caching vs expandable vs ideal allocator on captured GPT-2 and Llama training steps.

Captures each step with fake tensors on a fake `cuda` device (no GPU needed), then
replays it through the three allocators. Writes the `alloc_traces` table of
BENCHMARKS.md.

    .venv/bin/python benchmarks/bench_alloc_traces.py [--models gpt2,llama-3.2-1b] [--no-write]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks_md import write_section  # noqa: E402
from memplan.alloc import replay  # noqa: E402
from memplan.capture import capture_model  # noqa: E402
from memplan.models.setup import TrainingSetup  # noqa: E402

BENCH = "alloc_traces"
SETUPS = {
    "full checkpointing": dict(batch=4, seq=1024, precision="bf16-true", checkpointing="full"),
    "4 grad-accum micro-batches": dict(batch=2, seq=1024, precision="bf16-true", grad_accum=4),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2,llama-3.2-1b")
    parser.add_argument("--device", default="cuda",
                        help="fake device to capture on (cpu where this torch build cannot fake cuda)")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    rows = []
    for model in args.models.split(","):
        for label, fields in SETUPS.items():
            start = time.perf_counter()
            trace = capture_model(model, TrainingSetup(**{"precision": "32-true", **fields}), fake=True, device=args.device)
            capture_s = time.perf_counter() - start
            results = {name: replay(trace, name, segment_map=False) for name in ("caching", "expandable", "ideal")}
            print(f"{model} / {label}: {trace.num_events:,} events, capture {capture_s:.1f} s", file=sys.stderr)
            rows.append((model, label, fields, trace.num_events, results))
    gib = 2**30
    lines = [
        f"<!-- bench:{BENCH} -->",
        "### Allocators on captured training steps",
        "",
        f"Command: `.venv/bin/python benchmarks/bench_alloc_traces.py --device {args.device}`",
        "",
        f"One training step (AdamW, bf16 weights) captured with fake tensors on a fake `{args.device}` device, "
        "replayed through each allocator with default settings and unlimited capacity. "
        "Peaks in GiB; fragmentation = 1 - peak allocated / peak reserved.",
        "",
        "| model | setup | events | allocator | peak requested | peak allocated | peak reserved | fragmentation |",
        "|---|---|---:|---|---:|---:|---:|---:|",
    ]
    for model, label, fields, num_events, results in rows:
        setup = f"{label} (batch {fields['batch']}, seq {fields['seq']})"
        for name, result in results.items():
            lines.append(
                f"| {model} | {setup} | {num_events:,} | {name} | {result.peak_requested_bytes / gib:.3f} | "
                f"{result.peak_allocated_bytes / gib:.3f} | {result.peak_reserved_bytes / gib:.3f} | "
                f"{result.fragmentation:.1%} |"
            )
    lines.append(f"<!-- /bench:{BENCH} -->")
    if not args.no_write:
        write_section(BENCH, "\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
