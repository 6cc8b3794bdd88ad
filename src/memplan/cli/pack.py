"""`memplan pack PROBLEM.csv`: offsets for a minimalloc CSV problem, minimal or within a capacity.

Exit codes: 0 a packing was found (and written with -o); 1 the capacity is proven
infeasible; 4 the time limit ran out before the capacity was decided; 2 bad input
(3 is every subcommand's exit code for a memplan bug).
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from memplan.cli import SUBCOMMANDS, print_json
from memplan.cli.table import echo, paragraph
from memplan.errors import UserError
from memplan.units import format_bytes, parse_size

if TYPE_CHECKING:  # imported where they are used: parsing the command line needs none of them
    pass

UNDECIDED_EXIT_CODE = 4  # the time limit ran out before the capacity was decided


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "pack",
        help=SUBCOMMANDS["pack"],
        description="Give every buffer of a minimalloc CSV problem an offset so that buffers "
        "live at the same time never overlap: the least height (--minimize, the default "
        "without --capacity), or any packing within --capacity (exit 1 if none exists).",
    )
    p.add_argument("problem", metavar="PROBLEM.csv")
    p.add_argument("--capacity", default=None, metavar="SIZE", help="arena size: bytes, or e.g. 12MiB")
    p.add_argument("--minimize", action="store_true", help="minimise the height (default without --capacity)")
    p.add_argument("--time-limit", type=float, default=10.0, metavar="S", help="seconds (default 10)")
    p.add_argument("-o", "--output", default=None, metavar="OUT.csv", help="write the input plus an offset column")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def run(args: argparse.Namespace) -> int:
    from memplan.layout import pack
    from memplan.layout.minimalloc_csv import read_csv, write_csv

    if args.time_limit < 0:
        raise UserError(f"--time-limit {args.time_limit} must be >= 0")
    problem, _ = read_csv(args.problem)
    capacity = parse_size(args.capacity) if args.capacity is not None else None
    minimize = args.minimize or capacity is None
    solution = pack(problem, capacity=capacity, minimize=minimize, time_limit_s=args.time_limit)
    if solution.offsets is not None and args.output:
        write_csv(args.output, problem, solution.offsets)
    doc = {
        "height": solution.height,
        "lower_bound": solution.lower_bound,
        "optimal": solution.optimal,
        "feasible": solution.feasible,
        "status": solution.status,
        "elapsed_s": round(solution.elapsed_s, 6),
        "greedy_height": solution.stats.get("greedy_height"),
        "buffers": problem.num_buffers,
        "capacity": capacity,
        "method": solution.method,
        # the compiled search, or the Python one when no compiler is available (slower)
        "engine": solution.stats.get("engine"),
    }
    if args.json:
        print_json(doc)
    else:
        if solution.height is not None:
            echo(paragraph(
                f"height {format_bytes(solution.height)} ({solution.height} B), lower bound "
                f"{solution.lower_bound} B, {solution.status}, {solution.elapsed_s:.3f} s"
                f"{' (' + str(doc['engine']) + ' search)' if doc['engine'] else ''}"
            ))
        else:
            echo(paragraph(
                f"{solution.status} at capacity {capacity} B (lower bound {solution.lower_bound} B), "
                f"{solution.elapsed_s:.3f} s"
            ))
        if args.output and solution.offsets is not None:
            sys.stderr.write(f"wrote {args.output}\n")
    if solution.status == "infeasible":
        return 1
    if solution.status == "unknown":
        return UNDECIDED_EXIT_CODE
    return 0
