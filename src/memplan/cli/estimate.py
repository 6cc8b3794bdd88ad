"""`memplan estimate MODEL|TRACE [setup flags] [parallel flags]`: per-GPU peak memory of a training step."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from memplan.cli import SUBCOMMANDS, print_json
from memplan.cli.flags import (
    add_layout_flags,
    add_setup_flags,
    as_flags,
    layout_from_args,
    setup_from_args,
)
from memplan.cli.from_file import from_json
from memplan.cli.inputs import model_arg, refuse_retracing, trace_path
from memplan.cli.table import echo, pairs, paragraph, table
from memplan.errors import UserError
from memplan.units import format_bytes, parse_size

if TYPE_CHECKING:  # imported where they are used: parsing the command line needs none of them
    from memplan.estimation import Estimate
    from memplan.hardware.devices import DeviceProfile

IMPL_NAMES = {"hf": "Hugging Face transformers", "litgpt": "LitGPT"}  # whose model code was traced


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "estimate",
        help=SUBCOMMANDS["estimate"],
        description="Trace one training step on fake tensors (or take the step a TRACE recorded) and predict, "
        "per rank, peak allocated and reserved memory, device memory used, the breakdown and phase at the "
        "peak, and whether it fits.",
    )
    p.add_argument("model", metavar="MODEL|TRACE", nargs="?", default=None,
                   help="registry name, config.json path, package.module:factory, Hub id org/name, or a .memtrace / "
                   "PyTorch snapshot pickle of the step")
    add_setup_flags(p)
    add_layout_flags(p)
    p.add_argument("--gpu", default=None, metavar="NAME", help="device profile, e.g. h100-80gb; --gpu list prints every profile")
    p.add_argument("--capacity", default=None, metavar="SIZE",
                   help="device memory, e.g. 80GiB (with --gpu: in place of the profile's)")
    p.add_argument("--device", default=None, choices=("cuda", "cpu"),
                   help="target device (default cuda; a TRACE's is the one it was captured for)")
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
    from memplan.estimation.from_trace import estimate_trace
    from memplan.hardware.devices import all_profiles
    from memplan.trace import load

    if args.gpu == "list":
        return list_gpus(all_profiles(), as_json=args.json)
    capacity = parse_size(args.capacity) if args.capacity is not None else None
    cuda_context = parse_size(args.cuda_context) if args.cuda_context is not None else None
    path = trace_path(args.model)
    if path is not None:
        trace = load(path)
        refuse_retracing(args.model, trace, args, layout_flags=True)
        if args.device == "cpu":
            raise UserError(f"{args.model} is a trace: it cannot be re-traced for another device (--device cpu): "
                            "pass the model instead of the trace")
        result = estimate_trace(trace, args.gpu, capacity, args.allocator, args.alloc_conf,
                                cuda_context=cuda_context, name=path.name)
    else:
        result = estimate(model_arg(args), setup_from_args(args), layout_from_args(args), device=args.device or "cuda",
                          allocator=args.allocator, alloc_conf=args.alloc_conf, capacity=capacity, gpu=args.gpu,
                          extrapolate=not args.full_depth, parallel_tracing=not args.modelled_layout,
                          cuda_context=cuda_context)
    if args.json:
        print_json({**result.to_json(), **from_json(args)})
        return 0
    render(result)
    return 0


def list_gpus(profiles: list[DeviceProfile], *, as_json: bool) -> int:
    """`--gpu list`: every device profile (name, memory, bandwidth, dense TFLOP/s, source)."""
    rows = [p.listing() for p in profiles]
    if as_json:
        print_json({"gpus": rows})
        return 0
    header = ["gpu", "name", "platform", "memory", "bandwidth", "bf16", "fp16", "fp32", "source"]
    body = []
    for r in rows:
        flops = [("-" if r["tflops"].get(k) is None else f"{r['tflops'][k]:g}") for k in ("bf16", "fp16", "fp32")]
        body.append([r["gpu"], r["name"], r["platform"], format_bytes(r["capacity_bytes"]),
                     f"{r['memory_bandwidth_gbs'] / 1000:g} TB/s", *flops, r["source"]])
    echo(table(header, body, title=f"{len(rows)} GPU profiles (TFLOP/s dense; capacity as PyTorch reports it)",
               right=[c not in ("gpu", "name", "platform", "source") for c in header]))
    return 0


def render_assumptions(assumptions: dict) -> None:
    """What the estimate assumed, in one paragraph, then each large term it explains."""
    if assumptions:
        echo(paragraph(as_flags(assumptions["line"])))
    for note in assumptions.get("notes", []):
        echo(paragraph(f"note: {as_flags(note)}"))


def render(result: Estimate) -> None:
    """The estimate on stdout: one rank as key/value rows, several as a table; then the verdict."""
    layout = result.layout
    code = f"{IMPL_NAMES.get(result.impl, result.impl)}, " if result.impl is not None else ""
    title = (f"{result.model} ({code}{result.parameters / 1e9:.2f}B parameters) on {result.gpu or result.device}, "
             f"world {layout['world_size']} (dp {layout['dp']}, zero {layout['zero']}"
             f"{' ' + layout['engine'] if layout.get('engine') else ''}, tp {layout['tp']}, pp {layout['pp']}"
             + (f", cp {layout['cp']}" if layout.get("cp", 1) > 1 else "")
             + (f", ep {layout['ep']}" if layout.get("ep", 1) > 1 else "") + ")")
    if result.routing is not None:
        title += f", routing {result.routing}"
    host = result.host_peak_bytes > 0
    header = ["rank", "peak allocated", "peak reserved", "device used", "phase", "params", "grads",
              "optimizer", "activations", "temporaries", "other", *(("host",) if host else ())]
    body = []
    for r in result.per_rank:
        b = r.breakdown
        body.append([str(r.rank), format_bytes(r.peak_allocated_bytes), format_bytes(r.peak_reserved_bytes),
                     format_bytes(r.device_used_bytes), r.peak_phase,
                     *(format_bytes(b[k]) for k in ("parameters", "gradients", "optimizer_state",
                                                     "activations", "temporaries", "other")),
                     *((format_bytes(r.host.peak_bytes),) if host else ())])
    if len(body) == 1:
        echo(pairs(list(zip(header[1:], body[0][1:], strict=True)), title=title))
    else:
        echo(table(header, body, title=title))
    if host:
        r = max(result.per_rank, key=lambda r: r.host.peak_bytes)
        echo(paragraph(f"host memory (not in the device figures), peak per rank {format_bytes(r.host.peak_bytes)}: "
                       f"{format_bytes(r.host.pinned_bytes)} pinned, {format_bytes(r.host.pageable_bytes)} pageable, "
                       f"{format_bytes(r.host.managed_bytes)} CUDA managed (paged optimizer state)"))
    if result.routing not in (None, "balanced") and layout.get("ep", 1) > 1:
        echo(paragraph(f"routing {result.routing}: rank 0 holds the experts most tokens go to; its figures bound "
                       "the other ranks'"))
    render_assumptions(result.assumptions)
    if result.capacity_bytes is not None:
        verdict = "fits" if result.fits else "does NOT fit"
        echo(paragraph(f"{verdict}: {format_bytes(result.device_used_bytes)} used of "
                       f"{format_bytes(result.capacity_bytes)} ({result.method}, layout {result.parallel}, "
                       f"{result.elapsed_s:.1f} s)"))
    else:
        echo(paragraph(f"({result.method}, layout {result.parallel}, {result.elapsed_s:.1f} s; "
                       "give --gpu or --capacity to check the fit)"))
