"""`memplan estimate MODEL [setup flags] [parallel flags]`: per-GPU peak memory of a training step."""

from __future__ import annotations

import argparse

from memplan.cli import print_json


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from memplan.models import add_setup_flags
    from memplan.parallel.flags import add_layout_flags

    p = subparsers.add_parser(
        "estimate",
        help="predict per-GPU peak memory of a training step (no GPU needed)",
        description="Trace one training step on fake tensors and predict, per rank, peak allocated and "
        "reserved memory, device memory used, the breakdown and phase at the peak, and whether it fits.",
    )
    p.add_argument("model", metavar="MODEL", help="registry name, config.json path or package.module:factory")
    add_setup_flags(p)
    add_layout_flags(p)
    target = p.add_mutually_exclusive_group()
    target.add_argument("--gpu", default=None, metavar="NAME", help="device profile, e.g. h100-80gb")
    target.add_argument("--capacity", default=None, metavar="SIZE", help="device memory, e.g. 80GiB")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="target device (default cuda)")
    p.add_argument("--allocator", default="caching", metavar="NAME",
                   help="caching (default), expandable, planned or none (tensor bytes only)")
    p.add_argument("--alloc-conf", default=None, metavar="STR", help="a PYTORCH_CUDA_ALLOC_CONF string")
    p.add_argument("--cuda-context", default=None, metavar="SIZE",
                   help="CUDA context size in device used (default: the profile's, CUDA 12 lazy loading; "
                        "eager kernel loading takes about 1 GB more)")
    p.add_argument("--full-depth", action="store_true", help="trace every block instead of extrapolating")
    p.add_argument("--modelled-layout", action="store_true",
                   help="apply the modelled layout rules instead of tracing FSDP2 / TP on a fake process group")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def run(args: argparse.Namespace) -> int:
    from memplan.estimation import estimate
    from memplan.models import setup_from_args
    from memplan.parallel.flags import layout_from_args
    from memplan.units import parse_size

    capacity = parse_size(args.capacity) if args.capacity is not None else None
    cuda_context = parse_size(args.cuda_context) if args.cuda_context is not None else None
    setup = setup_from_args(args)
    layout = layout_from_args(args)
    result = estimate(args.model, setup, layout, device=args.device, allocator=args.allocator,
                      alloc_conf=args.alloc_conf, capacity=capacity, gpu=args.gpu,
                      extrapolate=not args.full_depth, parallel_tracing=not args.modelled_layout,
                      cuda_context=cuda_context)
    if args.json:
        print_json(result.to_json())
        return 0
    render(result)
    return 0


def render(result) -> None:  # noqa: ANN001 - memplan.estimation.Estimate
    from rich.console import Console
    from rich.table import Table

    from memplan.units import format_bytes

    console = Console()
    layout = result.layout
    title = (f"{result.model} ({result.parameters / 1e9:.2f}B parameters) on {result.gpu or result.device}, "
             f"world {layout['world_size']} (dp {layout['dp']}, zero {layout['zero']}, tp {layout['tp']}, pp {layout['pp']})")
    table = Table(title=title)
    for col in ("rank", "peak allocated", "peak reserved", "device used", "phase", "params", "grads",
                "optimizer", "activations", "temporaries", "other"):
        table.add_column(col, justify="right")
    for r in result.per_rank:
        b = r.breakdown
        table.add_row(str(r.rank), format_bytes(r.peak_allocated_bytes), format_bytes(r.peak_reserved_bytes),
                      format_bytes(r.device_used_bytes), r.peak_phase,
                      *(format_bytes(b[k]) for k in ("parameters", "gradients", "optimizer_state",
                                                      "activations", "temporaries", "other")))
    console.print(table)
    if result.capacity_bytes is not None:
        verdict = "fits" if result.fits else "does NOT fit"
        console.print(f"{verdict}: {format_bytes(result.device_used_bytes)} used of "
                      f"{format_bytes(result.capacity_bytes)} ({result.method}, layout {result.parallel}, "
                      f"{result.elapsed_s:.1f} s)")
    else:
        console.print(f"({result.method}, layout {result.parallel}, {result.elapsed_s:.1f} s; "
                      "give --gpu or --capacity to check the fit)")
