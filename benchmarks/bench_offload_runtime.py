"""The offload runtime on real training here (CPU): GPT-2-medium, 50% of its no-offload peak, files on disk.

Issue 8's "real run": a GPT-2-medium (registry `gpt2-medium`, 355M parameters, fp32,
AdamW with per-parameter kernels) trains 3 steps without offloading and 3 steps with
`memplan.offload.run(..., streamed_step=True)`: saved activations, gradients and
optimizer states go to files in a directory on this machine's disk (O_DIRECT where the
file system allows it). Both runs are in this one process, one after the other.

- peak: over step 2 of each run, the resident parameters, gradients and states plus the
  running sum of the profiler's allocation records (`step_peak_bytes`); the budget is 50%
  of the no-offload peak;
- bit-identity: every parameter and optimizer state after step 3;
- step time: steps 1 and 3 of each run timed with perf_counter (step 2 runs under the
  profiler and is not timed); the ratio is no-offload / offload (>= 0.85 is the target).

Writes the `offload_runtime` section of BENCHMARKS.md.

    .venv/bin/python benchmarks/bench_offload_runtime.py [--model gpt2-medium] [--batch 1] [--seq 256] [--dir /var/tmp]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from benchmarks_md import write_section
from memplan.capture.step import build_training_step
from memplan.models import TrainingSetup, load_config
from memplan.offload.measure import step_peak_bytes
from memplan.offload.runtime import run


def train(step, timed: list[float], peaks: list[int]) -> None:
    for i in range(3):
        if i == 1:
            peaks.append(step_peak_bytes(step))
        else:
            t0 = time.perf_counter()
            step.run()
            timed.append(time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gpt2-medium")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--dir", default="/var/tmp")
    args = parser.parse_args()
    setup = TrainingSetup(batch=args.batch, seq=args.seq, dtype="fp32", optimizer="adamw", optimizer_impl="loop")
    config = load_config(args.model)

    ref = build_training_step(config, setup, device="cpu")
    ref_s: list[float] = []
    ref_peak: list[int] = []
    train(ref, ref_s, ref_peak)
    budget = ref_peak[0] // 2
    print(f"no offload: steps {ref_s} s, peak {ref_peak[0] / 2**30:.2f} GiB", file=sys.stderr, flush=True)

    off = build_training_step(config, setup, device="cpu")
    off_s: list[float] = []
    off_peak: list[int] = []
    directory = tempfile.mkdtemp(prefix="memplan-bench-", dir=args.dir)
    with run(off.model, off.optimizer, directory=directory, min_nbytes=1 << 20, streamed_step=True,
             chunk_nbytes=64 << 20) as engine:
        train(off, off_s, off_peak)
        direct = engine.store.direct and not engine.store.direct_refused
    os.rmdir(directory)
    print(f"offload: steps {off_s} s, peak {off_peak[0] / 2**30:.2f} GiB", file=sys.stderr, flush=True)

    same_params = all(torch.equal(a, b) for a, b in zip(ref.model.parameters(), off.model.parameters()))
    same_states = all(
        torch.equal(x[k], y[k])
        for x, y in zip(ref.optimizer.state.values(), off.optimizer.state.values())
        for k in x
        if isinstance(x[k], torch.Tensor)
    )
    fs = subprocess.run(["df", "-T", args.dir], capture_output=True, text=True).stdout.splitlines()[-1].split()[1]
    ratio = statistics.median(ref_s) / statistics.median(off_s)
    params = sum(p.numel() for p in ref.model.parameters())
    row = (
        f"| {args.model} ({params / 1e6:.0f}M) | {args.batch}x{args.seq} | {fs}, {'O_DIRECT' if direct else 'buffered'} "
        f"| {ref_peak[0] / 2**30:.2f} GiB | {budget / 2**30:.2f} GiB | {off_peak[0] / 2**30:.2f} GiB "
        f"| {'yes' if off_peak[0] <= budget else 'NO'} | {'yes' if same_params and same_states else 'NO'} "
        f"| {', '.join(f'{s:.2f}' for s in ref_s)} | {', '.join(f'{s:.2f}' for s in off_s)} | **{ratio:.2f}** "
        f"| {engine.bytes_written / 2**30:.1f} / {engine.bytes_read / 2**30:.1f} GiB |"
    )
    print(row, file=sys.stderr)
    cmd = f".venv/bin/python benchmarks/bench_offload_runtime.py --model {args.model} --batch {args.batch} --seq {args.seq} --dir {args.dir}"
    section = "\n".join([
        "<!-- bench:offload_runtime -->",
        "## Offload runtime, real CPU training here (issue 8)",
        "",
        f"Reproduce: `{cmd}` (one run; 2 shared CPU cores, so step times move with the machine's load).",
        "",
        "fp32, AdamW (per-parameter kernels); 3 steps without offloading, then 3 steps with "
        "`memplan.offload.run(..., streamed_step=True)` (activations, gradients and optimizer states "
        "to files, the optimizer step streamed in 64 MiB chunks), in one process. Peaks: resident parameters, "
        "gradients and states + the running sum of the profiler's allocation records over step 2 of each run "
        "(I/O bounce buffers for O_DIRECT are mmap'd, not tensors, and not counted); budget = 50% of the no-offload peak. Step times: "
        "steps 1 and 3 (step 2 runs under the profiler); ratio = median no-offload / median offload "
        "(target >= 0.85). Bit-identical: every parameter and optimizer state after step 3.",
        "",
        "| model | batch x seq | files | no-offload peak | budget (50%) | offload peak | within budget "
        "| bit-identical | no-offload step s | offload step s | time ratio | written / read per run |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        row,
        "<!-- /bench:offload_runtime -->",
    ])
    write_section("offload_runtime", section)


if __name__ == "__main__":
    main()
