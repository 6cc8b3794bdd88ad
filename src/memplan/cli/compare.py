"""`memplan compare MEASURED ESTIMATE [--json]`: a measured step beside memplan's estimate of it."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from memplan.cli import SUBCOMMANDS, print_json
from memplan.errors import UserError
from memplan.units import format_bytes

if TYPE_CHECKING:  # imported where they are used: parsing the command line needs none of them
    pass


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "compare",
        help=SUBCOMMANDS["compare"],
        description="Compare a measured step (a .memtrace, e.g. the stepN.memtrace memplan.watch writes, or a "
                    "PyTorch memory snapshot pickle) with an estimate of it (the JSON of memplan estimate --json, "
                    "the estimate.json memplan.watch writes, or an estimate's .memtrace): peak allocated, reserved "
                    "and device used side by side, the difference per category at the peak, the phase of each "
                    "peak, and the largest buffers one side has at its peak and the other lacks.",
    )
    p.add_argument("measured", metavar="MEASURED")
    p.add_argument("estimate", metavar="ESTIMATE")
    p.add_argument("--top", type=int, default=5, help="unmatched buffers to list per side (default 5)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _size(value: Any) -> str:
    return "-" if value is None else format_bytes(int(value))


def _difference(entry: dict[str, Any]) -> str:
    if entry["difference_bytes"] is None:
        return "-"
    sign = "+" if entry["difference_bytes"] >= 0 else "-"
    rel = "" if entry["difference"] is None else f" ({100 * entry['difference']:+.2f}%)"
    return f"{sign}{format_bytes(abs(entry['difference_bytes']))}{rel}"


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from memplan.estimation.compare import compare_files

    if args.top < 0:
        raise UserError("--top must be >= 0")
    doc = compare_files(args.measured, args.estimate, top=args.top)
    if args.json:
        print_json(doc)
        return 0
    console = Console()
    table = Table(title=f"{args.measured} (measured) vs {args.estimate} (estimated)")
    for col in ("", "measured", "estimated", "estimate - measured"):
        table.add_column(col, justify="left" if not col else "right")
    for name, entry in doc["figures"].items():
        table.add_row(name.removesuffix("_bytes").replace("_", " "), _size(entry["measured"]),
                      _size(entry["estimated"]), _difference(entry))
    table.add_section()
    for name, entry in doc["breakdown"].items():
        if entry["measured"] or entry["estimated"]:
            table.add_row(f"  {name} at the peak", _size(entry["measured"]), _size(entry["estimated"]),
                          _difference(entry))
    table.add_section()
    table.add_row("phase of the peak", doc["peak_phase"]["measured"], doc["peak_phase"]["estimated"], "")
    console.print(table)
    for key, title in (("only_measured", "measured only"), ("only_estimated", "estimated only")):
        rows = doc[key]
        if rows is None:
            continue
        console.print(f"[bold]{title}[/bold] (live at its peak, not at the other side's): "
                      + ("none" if not rows else ""))
        for b in rows:
            console.print(f"  {format_bytes(b['nbytes']):>10}  {b['category']:<12} {b['phase']:<10} {b['name']}")
    for side in ("measured", "estimated"):
        for note in doc[side]["notes"]:
            console.print(f"[dim]{side}: {note}[/dim]")
    return 0
