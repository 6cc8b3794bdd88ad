"""How long a fake-tensor capture of a big training step takes on a CPU-only host.

Writes the `capture` table of BENCHMARKS.md.

    .venv/bin/python benchmarks/bench_capture.py [--repeats 3] [--no-write]

Each row builds the model inside FakeTensorMode, runs one untraced warm-up step (so
the optimizer state exists) and captures one step: the time is that whole call,
median of the repeats, in one process.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
import warnings

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
warnings.filterwarnings("ignore", category=FutureWarning)

from benchmarks_md import write_section  # noqa: E402
from memplan.capture import capture_model  # noqa: E402
from memplan.models import TrainingSetup  # noqa: E402
from memplan.units import format_bytes  # noqa: E402

CASES = [
    ("llama-2-70b", TrainingSetup(batch=1, seq=4096, precision="bf16-true", checkpointing="full")),
    ("llama-2-7b", TrainingSetup(batch=1, seq=4096, precision="bf16-true", checkpointing="full")),
    ("gpt2-xl", TrainingSetup(batch=4, seq=1024, precision="bf16-true")),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    rows = []
    for name, setup in CASES:
        times, trace = [], None
        for _ in range(args.repeats):
            start = time.perf_counter()
            trace = capture_model(name, setup, fake=True, device="cuda")
            times.append(time.perf_counter() - start)
        peak, event = trace.peak()
        rows.append(
            f"| {name} | batch {setup.batch}, seq {setup.seq}, {setup.dtype}, AdamW (foreach), "
            f"checkpointing {setup.checkpointing} | {trace.meta['parameters'] / 1e9:.2f} B | "
            f"{trace.num_ops:,} | {trace.num_buffers:,} | {format_bytes(peak)} ({trace.phase_at(event)}) | "
            f"{statistics.median(times):.1f} s |"
        )
        print(rows[-1], file=sys.stderr)
    table = "\n".join(
        [
            "<!-- bench:capture -->",
            "### Fake-tensor capture of one training step",
            "",
            "Command: `.venv/bin/python benchmarks/bench_capture.py`",
            "",
            f"Fake `cuda` job traced on fake cpu tensors (see docs/capture.md); wall time of "
            f"`capture_model` = build + warm-up step + captured step, median of {args.repeats}, "
            f"on this {os.cpu_count()}-core machine (Python {platform.python_version()}).",
            "",
            "| model | setup | parameters | ops | buffers | peak live (phase) | time |",
            "|---|---|---:|---:|---:|---:|---:|",
            *rows,
            "<!-- /bench:capture -->",
        ]
    )
    if not args.no_write:
        write_section("capture", table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
