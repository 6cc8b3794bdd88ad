"""`memplan report INPUTS... -o DIR`: an offline HTML report with figures."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from memplan.cli import SUBCOMMANDS, print_json

if TYPE_CHECKING:  # imported where they are used: parsing the command line needs none of them
    pass


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "report",
        help=SUBCOMMANDS["report"],
        description="Inputs: .memtrace files or PyTorch snapshot pickles, plan files from "
        "'memplan plan', and the --json output of estimate, reorder, offload and rl.",
    )
    p.add_argument("inputs", nargs="+", metavar="INPUT")
    p.add_argument("-o", "--output-dir", required=True, metavar="DIR")
    p.add_argument("--compare", action="append", default=[], metavar="TRACE",
                   help="another step of the same job (e.g. measured against estimated): overlaid on each "
                   "trace's timeline (repeatable)")
    p.add_argument("--json", action="store_true", help="print the page and figure paths as JSON")
    return p


def run(args: argparse.Namespace) -> int:
    # memplan.report draws with matplotlib: imported only when a report is drawn
    from rich.console import Console

    from memplan.report import build_report

    with Console(stderr=True).status("drawing the report…"):
        index = build_report(args.inputs, args.output_dir, compare=args.compare)
    pngs = sorted(str(p) for p in index.parent.glob("*.png"))
    if args.json:
        print_json({"index": str(index), "figures": pngs})
    else:
        sys.stdout.write(f"report: {index} ({len(pngs)} figures)\n")
    return 0
