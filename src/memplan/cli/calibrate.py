"""`memplan calibrate MEASURED --name NAME [--base GPU] [--json]`: a local device profile fitted
to a step measured on this GPU (`memplan.estimation.calibrate`)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from memplan.cli import SUBCOMMANDS, print_json
from memplan.units import format_bytes

if TYPE_CHECKING:  # imported where they are used: parsing the command line needs none of them
    pass


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "calibrate",
        help=SUBCOMMANDS["calibrate"],
        description="Fit the device constants a measured step shows (the stepN.memtrace memplan.watch writes on "
                    "CUDA) and store them as a local device profile under the cache directory ($MEMPLAN_CACHE, "
                    "else $XDG_CACHE_HOME/memplan, else ~/.cache/memplan). The profile is then listed by "
                    "`memplan estimate --gpu list` and usable as --gpu NAME. Constants the step does not "
                    "measure keep the base profile's value (docs/watch.md).",
    )
    p.add_argument("measured", metavar="MEASURED")
    p.add_argument("--name", required=True, help="the new profile's --gpu name, e.g. my-a100")
    p.add_argument("--base", default=None, metavar="GPU",
                   help="shipped profile for what the step does not measure (default: the one named like the device)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from memplan.estimation.calibrate import calibrate

    result = calibrate(args.measured, args.name, base=args.base)
    if args.json:
        print_json(result)
        return 0
    console = Console()
    console.print(f"[bold]{result['gpu']}[/bold] written to {result['path']} (the rest from {result['base']})")
    for key, value in result["measured"].items():
        console.print(f"  measured {key}: {format_bytes(value)} ({value:,} B)")
    for key, why in result["kept"].items():
        console.print(f"  kept {key}: {why}")
    console.print(f"use it as: memplan estimate MODEL --gpu {result['gpu']}")
    return 0
