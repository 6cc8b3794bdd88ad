"""`memplan show TRACE [--json]`: the peak, what it is made of, and the largest buffers."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from memplan.cli import print_json
from memplan.errors import UserError
from memplan.trace import load
from memplan.units import format_bytes


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "show",
        help="summarise a trace: peak live bytes, breakdown at the peak, largest buffers",
        description="Summarise a .memtrace file (or a PyTorch memory snapshot pickle).",
    )
    p.add_argument("trace", metavar="TRACE")
    p.add_argument("--top", type=int, default=10, help="largest buffers to list (default 10)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def run(args: argparse.Namespace) -> int:
    if args.top < 0:
        raise UserError("--top must be >= 0")
    trace = load(args.trace)
    summary = trace.summary(top=args.top)
    if args.json:
        print_json(summary)
        return 0
    console = Console()
    meta = trace.meta
    title = f"{meta.get('model', args.trace)}"
    console.print(
        f"[bold]{title}[/bold]: peak live [bold]{format_bytes(summary['peak_bytes'])}[/bold] "
        f"({summary['peak_bytes']:,} B) at event {summary['peak_event']} in "
        f"[bold]{summary['peak_phase']}[/bold]; {summary['num_ops']:,} ops, "
        f"{summary['num_buffers']:,} buffers"
    )
    table = Table(title="at the peak")
    table.add_column("category")
    table.add_column("bytes", justify="right")
    table.add_column("share", justify="right")
    total = max(summary["peak_bytes"], 1)
    for name, nbytes in sorted(summary["breakdown"].items(), key=lambda kv: -kv[1]):
        if nbytes:
            table.add_row(name, format_bytes(nbytes), f"{100 * nbytes / total:.1f}%")
    console.print(table)
    if summary["largest_buffers"]:
        big = Table(title=f"{len(summary['largest_buffers'])} largest buffers")
        for col in ("size", "category", "phase", "module", "op", "lifetime (events)"):
            big.add_column(col, justify="right" if col == "size" else "left")
        for b in summary["largest_buffers"]:
            end = "end" if b["free_event"] < 0 else str(b["free_event"])
            big.add_row(
                format_bytes(b["nbytes"]),
                b["category"],
                b["phase"],
                b["module"] or "-",
                b["op"] or "-",
                f"{b['alloc_event']}–{end}",
            )
        console.print(big)
    return 0
