"""The offload runtime on real training on a CPU-only host: GPT-2-medium, 50% of its no-offload peak, files on disk.

The real run of docs/offload.md: a GPT-2-medium (registry `gpt2-medium`, 355M parameters, fp32,
AdamW with per-parameter kernels) trains without offloading (A) and with
`memplan.offload.run(..., RunOptions(step_in_backward=True, ...))` (B; or `streamed_step=True` with
`--mode streamed`): saved activations and optimizer states (and gradients, when streamed) go to files in a directory on the local disk (O_DIRECT where the
file system allows it). Both set-ups are built side by side in this one process (same
seed, same initial weights) and their steps are **interleaved**, so that the machine's
load, which moves by the minute on a shared host, hits both alike:

- step 1 of each (A then B) warms up allocator and page cache and is not timed; step 2 of
  each runs under the profiler and gives the peak (`step_peak_bytes`); the budget is 50%
  of A's peak;
- then `--pairs` timed pairs, AB, BA, AB, ... (the order alternates, so that neither set-up
  always runs right after the other's I/O); the ratio of each pair is A's step time / B's;
  the result is the median of the pair ratios (target >= 0.85), with their range;
- bit-identity: every parameter after every step, and every optimizer state at the end.

B's activation hooks are paused (`engine.paused()`) while A runs, so A trains exactly as
it would alone.

`--mode planned` applies a plan instead of the runtime's own rules: B's step (updates in
backward, nothing moved) is captured on real tensors with each op's measured time, planned
by `memplan.offload.plan_offload` for this disk (bandwidth measured through the runtime's store)
among optimizer states (and saved activations where states alone cannot fit), and `run(model, optimizer, plan,
RunOptions(step_in_backward=True, ...))` moves exactly what the plan moves.

Writes the `offload_runtime` section of BENCHMARKS.md.

    .venv/bin/python benchmarks/bench_offload_runtime.py [--model gpt2-medium] [--shapes 1x128,4x256] [--pairs 6] [--dir /var/tmp] [--mode in-backward|streamed|planned[,...]] [--plan-margin-mib 128]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from benchmarks_md import write_section
from memplan.capture import capture
from memplan.capture.step import build_training_step
from memplan.hardware.links import Hardware, NvmeArray, make_hardware
from memplan.models import TrainingSetup, load_config
from memplan.offload import plan_offload, runtime_categories
from memplan.offload.lifetimes import measured_op_durations_s
from memplan.offload.measure import step_peak_bytes
from memplan.offload.runtime import FileStore, RunOptions, run


class Stream:
    """One set-up's step with its own RNG state, so that interleaving does not change its dropout masks."""

    def __init__(self, step, rng: torch.Tensor) -> None:
        self.step = step
        self.rng = rng.clone()

    def run(self) -> None:
        torch.set_rng_state(self.rng)
        self.step.run()
        self.rng = torch.get_rng_state()

    def timed(self) -> float:
        torch.set_rng_state(self.rng)
        t0 = time.perf_counter()
        self.step.run()
        elapsed = time.perf_counter() - t0
        self.rng = torch.get_rng_state()
        return elapsed

    def peak(self) -> int:
        torch.set_rng_state(self.rng)
        nbytes = step_peak_bytes(self.step)
        self.rng = torch.get_rng_state()
        return nbytes


def same_parameters(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.model.parameters(), b.model.parameters()))


def disk_hardware(directory: str, nbytes: int = 512 << 20) -> Hardware:
    """The local disk as the planner's NVMe: one file of `nbytes` written and read back
    through the runtime's own store (O_DIRECT where allowed), timed."""
    root = tempfile.mkdtemp(prefix="memplan-disk-", dir=directory)
    store = FileStore(root)
    data = torch.empty(nbytes + 4096, dtype=torch.uint8)
    start = (-data.data_ptr()) % 4096  # page-aligned, as the runtime's refilled storages are
    view = memoryview(data[start:start + nbytes].numpy()).cast("B")
    write_s, read_s = [], []
    for i in range(3):  # medians of three: a shared disk's speed varies from one transfer to the next
        t0 = time.perf_counter()
        path = store.write(f"probe{i}", view)
        write_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        store.read(path, view)
        read_s.append(time.perf_counter() - t0)
        store.remove(path)
    store.close()
    os.rmdir(root)
    base = make_hardware("h100-nvl-94gb", nvme="0")
    disk = NvmeArray(1, nbytes / statistics.median(read_s), nbytes / statistics.median(write_s), math.inf,
                     "local disk")
    return dataclasses.replace(base, nvme=disk)


def planned_trace(b: Stream, directory: str):
    """B's second step captured on real tensors (measured op times) with its updates in backward and
    nothing moved: the step `run(..., plan, RunOptions(step_in_backward=True, ...))` will run. The first (untimed) makes
    the optimizer's states."""
    with run(b.step.model, b.step.optimizer, options=RunOptions(directory=directory, step_in_backward=True, min_nbytes=1 << 62,
             activations=False)):
        b.run()
        torch.set_rng_state(b.rng)
        trace = capture(b.step.run, model=b.step.model, optimizer=b.step.optimizer, inputs=b.step.batches)
        b.rng = torch.get_rng_state()
    return trace


def measure(args: argparse.Namespace, batch: int, seq: int, resident_mib: int, mode_name: str) -> tuple[str, list[float]]:
    """One shape's A/B run in one offload mode: its table row and its pair ratios."""
    setup = TrainingSetup(batch=batch, seq=seq, precision="32-true", optimizer="adamw", optimizer_impl="loop")
    config = load_config(args.model)

    ref = build_training_step(config, setup, device="cpu")
    off = build_training_step(config, setup, device="cpu")  # seeds the RNG again: same weights and batches
    a, b = Stream(ref, torch.get_rng_state()), Stream(off, torch.get_rng_state())
    directory = tempfile.mkdtemp(prefix="memplan-bench-", dir=args.dir)
    ref_s: list[float] = []
    off_s: list[float] = []
    identical = True
    planned = None
    if mode_name == "planned":
        # the plan: of B's second step, captured, with this disk's measured bandwidth and the
        # op times measured in the capture; budget 50% of A's peak
        a.run()
        a.run()
        trace = planned_trace(b, directory)
        identical &= same_parameters(ref, off)
        ref_peak = a.peak()
        budget = ref_peak // 2
        hardware = disk_hardware(args.dir)
        # what the in-backward runtime moves: states and saved activations (parameters stay; gradients are
        # consumed as they are made); states alone first, as the runtime's own rules do: an activation moved
        # costs a hook and a transfer per storage, many of them small
        for categories in (("optimizer_state",), runtime_categories()):
            planned = plan_offload(trace, hardware, budget=budget - args.plan_margin_mib * (1 << 20),
                                   op_durations_s=measured_op_durations_s(trace), categories=categories)
            if planned.feasible:
                break
        print(f"{batch}x{seq}: plan: {len(planned.transfers)} transfers, {planned.offloaded_bytes / 2**30:.2f} GiB, "
              f"planned peak {planned.peak_bytes_after / 2**30:.2f} GiB of a traced "
              f"{planned.peak_bytes_before / 2**30:.2f} GiB, {planned.plan_elapsed_s:.1f} s; disk "
              f"{hardware.nvme.write_bytes_per_s / 1e9:.2f} GB/s write, {hardware.nvme.read_bytes_per_s / 1e9:.2f} "
              "GB/s read", file=sys.stderr)
        mode: dict = {"step_in_backward": True}
    elif mode_name == "in-backward":
        mode = {"step_in_backward": True, "resident_nbytes": resident_mib << 20,
                "forward_prefetch_nbytes": args.forward_prefetch_mib << 20}
    else:
        mode = {"streamed_step": True}
    with run(off.model, off.optimizer, planned, RunOptions(directory=directory, min_nbytes=1 << 20, chunk_nbytes=64 << 20,
             **mode)) as engine:
        if planned is None:
            with engine.paused():
                a.run()
            b.run()
            identical &= same_parameters(ref, off)
            with engine.paused():
                ref_peak = a.peak()
            budget = ref_peak // 2
            # activations move only where the budget needs them: first a step with them kept
            with engine.paused():
                off_peak = b.peak()
            kept_peak = off_peak
            move_acts = off_peak > budget
            if move_acts:  # one more profiled step of B, and one more step of A: they stay in lockstep
                with engine.paused():
                    a.run()
                off_peak = b.peak()
        else:  # the plan decides which activations move; its first step starts with every state in
            with engine.paused():  # memory (they leave after their update), so it is not the one measured
                a.run()
            b.run()
            move_acts = any(planned.tensors.saved_moved)
            off_peak = kept_peak = b.peak()
        identical &= same_parameters(ref, off)
        acts = engine.paused if not move_acts else contextlib.nullcontext
        print(f"{batch}x{seq}: peaks: no offload {ref_peak / 2**30:.2f} GiB, offload {off_peak / 2**30:.2f} GiB "
              f"(activations kept: {kept_peak / 2**30:.2f} GiB)", file=sys.stderr)
        written0, read0 = engine.bytes_written, engine.bytes_read
        for i in range(args.pairs):
            for which in ("AB" if i % 2 == 0 else "BA"):
                if which == "A":
                    with engine.paused():
                        ref_s.append(a.timed())
                else:
                    with acts():
                        off_s.append(b.timed())
            identical &= same_parameters(ref, off)
            print(f"{batch}x{seq} pair {i + 1}: no offload {ref_s[-1]:.2f} s, offload {off_s[-1]:.2f} s, "
                  f"ratio {ref_s[-1] / off_s[-1]:.3f}", file=sys.stderr, flush=True)
        written = (engine.bytes_written - written0) / args.pairs
        read = (engine.bytes_read - read0) / args.pairs
        direct = engine.store.direct and not engine.store.direct_refused
    os.rmdir(directory)
    identical &= all(  # by parameter: with the step in backward, states are created in another order
        torch.equal(ref.optimizer.state[p][k], off.optimizer.state[q][k])
        for p, q in zip(ref.model.parameters(), off.model.parameters())
        for k in ref.optimizer.state[p]
        if isinstance(ref.optimizer.state[p][k], torch.Tensor)
    )
    steps = (4 if planned is not None else 3 if move_acts else 2) + args.pairs
    plan_note = "" if planned is None else (
        f" (plan: {planned.offloaded_bytes / 2**30:.1f} GiB moved, planned peak {planned.peak_bytes_after / 2**30:.2f} "
        f"GiB, {planned.plan_elapsed_s:.1f} s; disk {hardware.nvme.write_bytes_per_s / 1e9:.1f} / "
        f"{hardware.nvme.read_bytes_per_s / 1e9:.1f} GB/s w/r)")
    fs = subprocess.run(["df", "-T", args.dir], capture_output=True, text=True).stdout.splitlines()[-1].split()[1]
    ratios = [a / b for a, b in zip(ref_s, off_s)]
    ratio = statistics.median(ratios)
    params = sum(p.numel() for p in ref.model.parameters())
    row = (
        f"| {args.model} ({params / 1e6:.0f}M) | {batch}x{seq} "
        f"| {'activations moved' if move_acts else f'activations kept (peak {kept_peak / 2**30:.2f} GiB with them)'}, "
        f"{mode_name}{f', {resident_mib} MiB of states kept (largest first), {args.forward_prefetch_mib} MiB read in forward' if mode_name == 'in-backward' else ''}{plan_note} | {fs}, {'O_DIRECT' if direct else 'buffered'} "
        f"| {ref_peak / 2**30:.2f} GiB | {budget / 2**30:.2f} GiB | {off_peak / 2**30:.2f} GiB "
        f"| {'yes' if off_peak <= budget else 'NO'} | {'yes' if identical else 'NO'} ({steps} steps) "
        f"| {statistics.median(ref_s):.2f} ({min(ref_s):.2f}-{max(ref_s):.2f}) "
        f"| {statistics.median(off_s):.2f} ({min(off_s):.2f}-{max(off_s):.2f}) "
        f"| **{ratio:.2f}** | {min(ratios):.2f}-{max(ratios):.2f} "
        f"| {written / 2**30:.1f} / {read / 2**30:.1f} GiB |"
    )
    print(row, file=sys.stderr)
    print(f"{batch}x{seq} pair ratios: " + ", ".join(f"{r:.3f}" for r in ratios), file=sys.stderr)
    return row, ratios


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gpt2-medium")
    parser.add_argument("--shapes", default="1x128,4x256",
                        help="comma-separated BATCHxSEQ shapes, one row each (run one after the other)")
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--dir", default="/var/tmp")
    parser.add_argument("--mode", default="in-backward",
                        help="comma-separated, a row per shape and mode: in-backward: each update runs in backward "
                        "(step_in_backward); streamed: the optimizer step streams gradients and states chunk by chunk "
                        "(streamed_step); planned: in backward, moving what memplan.offload.plan_offload chose for the "
                        "captured step")
    parser.add_argument("--resident-mib", default="0",
                        help="in-backward: MiB of optimizer states that stay in memory (budget permitting); one "
                        "value, or one per shape (comma-separated)")
    parser.add_argument("--forward-prefetch-mib", type=int, default=64,
                        help="in-backward: MiB of states read ahead during the forward (forward_prefetch_nbytes)")
    parser.add_argument("--plan-margin-mib", type=int, default=128,
                        help="planned: MiB the plan leaves below the budget for the runtime's read-ahead (64 MiB of "
                        "states and 64 MiB of activations, where the plan brings each back just in time)")
    parser.add_argument("--no-write", action="store_true", help="print the rows, leave BENCHMARKS.md alone")
    args = parser.parse_args()
    try:
        shapes = [tuple(int(x) for x in shape.split("x")) for shape in args.shapes.split(",")]
        if any(len(shape) != 2 or min(shape) < 1 for shape in shapes):
            raise ValueError
    except ValueError:
        sys.stderr.write(f"bench_offload_runtime: --shapes {args.shapes!r}: give BATCHxSEQ[,BATCHxSEQ...], e.g. 1x128,4x256\n")
        sys.exit(2)
    try:
        resident = [int(x) for x in args.resident_mib.split(",")]
        if len(resident) == 1:
            resident *= len(shapes)
        if len(resident) != len(shapes) or min(resident) < 0:
            raise ValueError
    except ValueError:
        sys.stderr.write(f"bench_offload_runtime: --resident-mib {args.resident_mib!r}: give one MiB figure, "
                         f"or one per shape ({len(shapes)}), e.g. 750,2000\n")
        sys.exit(2)
    modes = args.mode.split(",")
    unknown = [m for m in modes if m not in ("in-backward", "streamed", "planned")]
    if unknown:
        sys.stderr.write(f"bench_offload_runtime: --mode {args.mode!r}: {', '.join(unknown)} is not a mode; "
                         "give in-backward, streamed or planned (comma-separated)\n")
        sys.exit(2)
    rows, all_ratios = [], []
    for (batch, seq), resident_mib in zip(shapes, resident):
        for mode_name in modes:
            row, ratios = measure(args, batch, seq, resident_mib, mode_name)
            rows.append(row)
            all_ratios.append((f"{batch}x{seq} {mode_name}", ratios))
            gc.collect()
    if args.no_write:
        return
    cmd = (f".venv/bin/python benchmarks/bench_offload_runtime.py --model {args.model} --shapes {args.shapes} "
           f"--pairs {args.pairs} --dir {args.dir} --mode {args.mode} --resident-mib {args.resident_mib} "
           f"--forward-prefetch-mib {args.forward_prefetch_mib}"
           + (f" --plan-margin-mib {args.plan_margin_mib}" if "planned" in modes else ""))
    section = "\n".join([
        "<!-- bench:offload_runtime -->",
        "## Offload runtime, real CPU training",
        "",
        f"Reproduce: `{cmd}` (one run; 2 shared CPU cores).",
        "",
        "fp32, AdamW (per-parameter kernels). A = no offloading, B = `memplan.offload.run(...)`: activations (by "
        "storage, each written once, read back 64 MiB ahead in backward; only where the budget needs them: B's "
        "peak is measured first with them kept, `engine.paused()`) and "
        "optimizer states to files, and either each parameter's update run in backward as soon as its gradient "
        "is ready (`step_in_backward=True`, mode in-backward: gradients never leave, states prefetched 64 MiB "
        "ahead in backward's order, `--forward-prefetch-mib` of them already during the forward; the states of the "
        "largest parameters, `--resident-mib` of them, stay; refilled states are page-aligned, so O_DIRECT moves "
        "them with no bounce copy) or gradients to files too and the optimizer step streamed in 64 MiB chunks "
        "(`streamed_step=True`, mode streamed). Mode planned: B's step (updates in backward) is captured on real "
        "tensors, with each op's measured time, and planned by `memplan.offload.plan_offload` for this disk (its bandwidth "
        "measured through the runtime's store, medians of three 512 MiB writes and reads) and the budget less "
        "`--plan-margin-mib` (the runtime reads states and activations 64 MiB ahead each, where the plan brings "
        "them back just in time), among optimizer states alone, or states and saved activations where a plan of "
        "states alone cannot fit (what this runtime mode moves, activations last as in its own rules); "
        "`run(model, optimizer, plan, RunOptions(step_in_backward=True, ...))` then moves exactly the states and saved storages "
        "the plan moves, and keeps the rest. "
        "Both are built side by side in one process and their steps interleaved: one untimed warm-up step each, "
        "one profiled step each (peak; where B's activations must move, a second profiled step of B and an "
        "untimed one of A), then timed pairs in alternating order (AB, BA, ...). "
        "Peaks: resident parameters, gradients and states + the running sum of the profiler's allocation records "
        "over the profiled step (I/O bounce buffers for O_DIRECT are mmap'd, not tensors, and not counted); "
        "budget = 50% of the no-offload peak. Step times: median (min-max) over the pairs; "
        "time ratio = median over pairs of A's step time / B's (target >= 0.85), with the range of the pair ratios. "
        "Bit-identical: every parameter after every step and every optimizer state at the end. "
        "Load: other jobs on these 2 cores slow compute, not the disk (O_DIRECT here: 1.0-1.6 GB/s read, "
        "1.5-2.6 GB/s write), so a loaded pair flatters offloading; unloaded, a no-offload step takes ~3.5 s at 1x128 and ~20 s at "
        "4x256. The I/O threads' CPU time (O_DIRECT system time, ~1 s per 4 GB moved) comes out of the same two "
        "cores as the compute, so the ratio rises with the compute per byte moved (the batch); on a GPU the "
        "copies are DMA.",
        "",
        "Pair ratios of this run: " + "; ".join(f"{shape}: {', '.join(f'{r:.3f}' for r in ratios)}"
                                                for shape, ratios in all_ratios) + ".",
        "",
        "| model | batch x seq | offload mode | files | no-offload peak | budget (50%) | offload peak | within budget "
        "| bit-identical | no-offload step s | offload step s | time ratio (median of pairs) | pair ratio range "
        "| written / read per step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "<!-- /bench:offload_runtime -->",
    ])
    write_section("offload_runtime", section)


if __name__ == "__main__":
    main()
