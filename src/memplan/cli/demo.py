"""`memplan demo`: the main job on the embedded default, end to end, in a few minutes.

The default is a GPT-2 (124M) fine-tuning step as it would run on one GPU: batch 8,
sequence 1024, bf16 weights, AdamW (foreach), full activation checkpointing, traced on
fake tensors (no memory, no GPU needed). The demo captures it, summarises the peak,
replays it through PyTorch's caching allocator, expandable segments and the ideal
allocator, and writes the trace and a PyTorch memory snapshot (open it at
pytorch.org/memory_viz) to the output directory.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from memplan.cli import print_json
from memplan.errors import UserError

DEFAULT_MODEL = "gpt2"
DEFAULT_SETUP = {"batch": 8, "seq": 1024, "dtype": "bf16", "checkpointing": "full"}


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "demo",
        help="run the main job on the embedded default (GPT-2 step) and write its outputs",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("-o", "--output-dir", default="memplan-out", help="where outputs go (default memplan-out)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    return p


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from memplan.alloc import simulate
    from memplan.capture import capture_model
    from memplan.models import TrainingSetup
    from memplan.trace import save, save_snapshot
    from memplan.units import format_bytes

    out_dir = Path(args.output_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"{out_dir} exists and is not a directory: choose another --output-dir")
    out_dir.mkdir(parents=True, exist_ok=True)
    setup = TrainingSetup(**DEFAULT_SETUP)
    err = Console(stderr=True)
    steps = ["capture the training step", "replay through the allocators", "write outputs"]
    results = {}
    with Progress(
        TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=err, transient=False
    ) as progress:
        task = progress.add_task(steps[0], total=len(steps))
        trace = capture_model(DEFAULT_MODEL, setup, fake=True, device="cuda")
        progress.update(task, advance=1, description=steps[1])
        for allocator in ("caching", "expandable", "ideal"):
            results[allocator] = simulate(trace, allocator=allocator)
        progress.update(task, advance=1, description=steps[2])
        trace_path = out_dir / f"{DEFAULT_MODEL}-step.memtrace"
        snapshot_path = out_dir / f"{DEFAULT_MODEL}-step.pickle"
        save(trace, trace_path)
        save_snapshot(trace, snapshot_path)
        progress.update(task, advance=1, description="done")

    summary = trace.summary(top=0)
    doc = {
        "model": DEFAULT_MODEL,
        "setup": setup.to_dict(),
        "peak_bytes": summary["peak_bytes"],
        "peak_phase": summary["peak_phase"],
        "breakdown": summary["breakdown"],
        "allocators": {name: r.to_json() for name, r in results.items()},
        "outputs": {"trace": str(trace_path), "snapshot": str(snapshot_path)},
    }
    if args.json:
        print_json(doc)
        return 0
    console = Console()
    console.print(
        f"[bold]{DEFAULT_MODEL}[/bold] training step (batch {setup.batch}, seq {setup.seq}, "
        f"{setup.dtype}, AdamW, checkpointing {setup.checkpointing}, one GPU): peak live "
        f"[bold]{format_bytes(summary['peak_bytes'])}[/bold] in {summary['peak_phase']}"
    )
    breakdown = Table(title="live at the peak")
    breakdown.add_column("category")
    breakdown.add_column("bytes", justify="right")
    for name, nbytes in sorted(summary["breakdown"].items(), key=lambda kv: -kv[1]):
        if nbytes:
            breakdown.add_row(name, format_bytes(nbytes))
    console.print(breakdown)
    alloc = Table(title="what the GPU allocator would reserve")
    for col in ("allocator", "peak allocated", "peak reserved", "fragmentation"):
        alloc.add_column(col, justify="left" if col == "allocator" else "right")
    for name, r in results.items():
        alloc.add_row(
            name,
            format_bytes(r.peak_allocated_bytes),
            format_bytes(r.peak_reserved_bytes),
            f"{100 * r.fragmentation:.1f}%",
        )
    console.print(alloc)
    console.print(f"outputs in [bold]{out_dir}/[/bold]:")
    console.print(f"  {trace_path}   (memplan show / simulate)")
    console.print(f"  {snapshot_path}   (drag onto https://pytorch.org/memory_viz)")
    return 0
