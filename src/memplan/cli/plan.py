"""`memplan plan TRACE -o plan.json`: a periodic static plan of a training step (STWeaver)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from memplan.cli import SUBCOMMANDS, print_json
from memplan.cli.table import echo, paragraph
from memplan.units import format_bytes

if TYPE_CHECKING:  # imported where they are used: parsing the command line needs none of them
    pass


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "plan",
        help=SUBCOMMANDS["plan"],
        description="Plan every allocation of a trace's first iterations at a fixed offset in "
        "one arena (fixed regions for weights, gradients and optimizer states; cross-phase "
        "activation groups; the rest in the gaps) and write the plan as JSON. Replay it with "
        "'memplan simulate TRACE --allocator planned --plan plan.json'.",
    )
    p.add_argument("trace", metavar="TRACE", help=".memtrace file or PyTorch memory snapshot")
    p.add_argument("-o", "--output", required=True, metavar="plan.json")
    p.add_argument("--alignment", type=int, default=512, metavar="BYTES", help="offset alignment (default 512)")
    p.add_argument("--device", default=None, metavar="NAME", help="which device to plan when the trace has several")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def run(args: argparse.Namespace) -> int:
    from memplan.layout import plan_addresses, save_address_plan
    from memplan.trace import load

    trace = load(args.trace)
    result = plan_addresses(trace, alignment_bytes=args.alignment, device=args.device)
    save_address_plan(result, args.output)
    doc = {
        "arena_bytes": result.arena_bytes,
        "lower_bound_bytes": result.lower_bound_bytes,
        "overhead": result.arena_bytes / result.lower_bound_bytes - 1 if result.lower_bound_bytes else 0.0,
        "iterations": result.groups,
        "periodic_iteration": result.periodic_iteration,
        "dynamic_windows": len(result.dynamic_space),
        "output": args.output,
        **result.stats,
    }
    if args.json:
        print_json(doc)
    else:
        echo(paragraph(
            f"arena {format_bytes(result.arena_bytes)} for a live peak of "
            f"{format_bytes(result.lower_bound_bytes)} ({doc['overhead']:+.2%}), "
            f"iterations {result.groups} (periodic from {result.periodic_iteration}), "
            f"{result.stats['elapsed_s']:.2f} s -> {args.output}"
        ))
    return 0
