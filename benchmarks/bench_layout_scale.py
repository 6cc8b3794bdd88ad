"""Time to plan addresses for a 100,000-buffer training trace (STWeaver plan).

Writes the `layout_scale` table of BENCHMARKS.md: wall and CPU seconds of
`memplan.plan_addresses` on the synthetic training trace of `memplan.layout.generate`
(2 iterations, 8 micro-batches, 900 layers: 107,100 buffers), median of `--repeats` runs,
and the planned arena against the live peak (the lower bound). Target: <= 30 s.
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks_md import write_section
from memplan.layout import plan_addresses
from memplan.layout.generate import training_trace


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=900)
    args = parser.parse_args()
    trace = training_trace(iterations=2, microbatches=8, layers=args.layers)
    walls, cpus, ratio = [], [], 0.0
    for _ in range(args.repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        plan = plan_addresses(trace)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
        ratio = plan.arena_bytes / trace.peak()[0]
    lines = [
        "## Address planning at scale",
        "",
        f"Command: `.venv/bin/python benchmarks/bench_layout_scale.py --repeats {args.repeats}`",
        "",
        f"Synthetic training trace (`memplan.layout.generate.training_trace`, 2 iterations, 8 micro-batches, "
        f"{args.layers} layers). Median of {args.repeats} runs; wall time depends on what else runs on the "
        "host's cores, CPU time less so. Target: <= 30 s.",
        "",
        "| buffers | wall s | CPU s | arena / live peak |",
        "|---:|---:|---:|---:|",
        f"| {trace.num_buffers:,} | {statistics.median(walls):.1f} | {statistics.median(cpus):.1f} | {ratio:.4f} |",
    ]
    write_section("layout_scale", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
