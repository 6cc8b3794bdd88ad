"""`memplan show TRACE [--json]`: the peak, what it is made of, and the largest buffers."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from memplan.cli import SUBCOMMANDS, print_json
from memplan.cli.table import echo, paragraph, table
from memplan.errors import UserError
from memplan.units import format_bytes

if TYPE_CHECKING:  # imported where they are used: parsing the command line needs none of them
    pass


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "show",
        help=SUBCOMMANDS["show"],
        description="Summarise a .memtrace file (or a PyTorch memory snapshot pickle).",
    )
    p.add_argument("trace", metavar="TRACE")
    p.add_argument("--top", type=int, default=10, help="largest buffers to list (default 10)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def run(args: argparse.Namespace) -> int:
    from memplan.trace import load

    if args.top < 0:
        raise UserError("--top must be >= 0")
    trace = load(args.trace)
    summary = trace.summary(top=args.top)
    if args.json:
        print_json(summary)
        return 0
    meta = trace.meta
    echo(paragraph(f"{meta.get('model', args.trace)}: peak live {format_bytes(summary['peak_bytes'])} "
                   f"({summary['peak_bytes']:,} B) at event {summary['peak_event']} in {summary['peak_phase']}; "
                   f"{summary['num_ops']:,} ops, {summary['num_buffers']:,} buffers"))
    total = max(summary["peak_bytes"], 1)
    echo(table(["category", "bytes", "share"],
               [[name, format_bytes(nbytes), f"{100 * nbytes / total:.1f}%"]
                for name, nbytes in sorted(summary["breakdown"].items(), key=lambda kv: -kv[1]) if nbytes],
               title="at the peak"))
    if summary["largest_buffers"]:
        header = ["size", "category", "phase", "module", "op", "lifetime (events)"]
        echo(table(header, [[format_bytes(b["nbytes"]), b["category"], b["phase"], b["module"] or "-", b["op"] or "-",
                             f"{b['alloc_event']}–{'end' if b['free_event'] < 0 else b['free_event']}"]
                            for b in summary["largest_buffers"]],
                   title=f"{len(summary['largest_buffers'])} largest buffers", right=[c == "size" for c in header]))
    return 0
