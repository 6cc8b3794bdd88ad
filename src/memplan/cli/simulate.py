"""`memplan simulate TRACE --allocator caching|expandable|ideal|planned`: reserved memory and fragmentation."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from memplan.cli import SUBCOMMANDS, print_json
from memplan.cli.table import echo, pairs, paragraph
from memplan.errors import UserError
from memplan.units import format_bytes, parse_size

if TYPE_CHECKING:  # imported where they are used: parsing the command line needs none of them
    from memplan.alloc import AllocReplay


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "simulate",
        help=SUBCOMMANDS["simulate"],
        description="Replay a .memtrace file (or a PyTorch memory snapshot pickle) through "
        "PyTorch's caching allocator, expandable segments, a static plan or the ideal allocator.",
    )
    p.add_argument("trace", metavar="TRACE")
    p.add_argument("--allocator", default="caching", metavar="NAME",
                   help="caching (default), expandable, ideal or planned")
    p.add_argument("--alloc-conf", default=None, metavar="STR",
                   help="a PYTORCH_CUDA_ALLOC_CONF string, e.g. 'max_split_size_mb:128'")
    p.add_argument("--capacity", default=None, metavar="SIZE",
                   help="device memory, e.g. 80GiB, 24GB or bytes (default: unlimited)")
    p.add_argument("--memory-fraction", type=float, default=None, metavar="F",
                   help="as torch.cuda.set_per_process_memory_fraction (needs --capacity)")
    p.add_argument("--plan", default=None, metavar="FILE", help="plan file for --allocator planned")
    p.add_argument("--device", default=None, metavar="NAME",
                   help="which device's buffers to replay when the trace has several (e.g. cuda:0)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def run(args: argparse.Namespace) -> int:
    from memplan.alloc import ALLOCATORS, replay
    from memplan.layout.plan import load_address_plan
    from memplan.trace import load

    if args.allocator not in ALLOCATORS:
        raise UserError(f"unknown allocator {args.allocator!r}: choose one of {', '.join(ALLOCATORS)}")
    capacity = parse_size(args.capacity) if args.capacity is not None else None
    plan = None
    if args.allocator == "planned":
        if args.plan is None:
            raise UserError("--allocator planned needs --plan FILE (make one with 'memplan plan')")
        plan = load_address_plan(args.plan)
    elif args.plan is not None:
        raise UserError("--plan is only used with --allocator planned")
    trace = load(args.trace)
    result = replay(trace, args.allocator, alloc_conf=args.alloc_conf, capacity=capacity, plan=plan,
                    memory_fraction=args.memory_fraction, segment_map=False, device=args.device)
    if args.json:
        print_json(result.to_json())
        return 0
    _render(result, args)
    return 0


def _render(result: AllocReplay, args: argparse.Namespace) -> None:
    """The replay's statistics as a table on stdout."""
    rows = [(label, f"{format_bytes(nbytes)} ({nbytes:,} B)")
            for label, nbytes in (("peak requested", result.peak_requested_bytes),
                                  ("peak allocated", result.peak_allocated_bytes),
                                  ("peak reserved", result.peak_reserved_bytes))]
    rows += [("fragmentation", f"{result.fragmentation:.1%}"), ("segments (max)", f"{result.segments:,}"),
             ("cudaMalloc / cudaFree", f"{result.num_cuda_malloc:,} / {result.num_cuda_free:,}"),
             ("events replayed", f"{result.events_replayed:,}")]
    echo(pairs(rows, title=f"{args.trace} through the {result.allocator} allocator"
               + (f" ({args.alloc_conf})" if args.alloc_conf else "")))
    if result.oom is not None:
        echo(paragraph(f"out of memory at event {result.oom['event']}: "
                       f"{format_bytes(result.oom['request_bytes'])} requested with "
                       f"{format_bytes(result.oom['reserved_bytes'])} reserved of "
                       f"{format_bytes(result.oom['capacity_bytes'])}"))
