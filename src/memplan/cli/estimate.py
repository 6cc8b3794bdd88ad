"""`memplan estimate MODEL|TRACE [setup flags] [parallel flags]`: per-GPU peak memory of a training step."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from memplan.cli import SUBCOMMANDS, print_json
from memplan.cli.answer import (
    DefaultsHelp,
    add_margin_flag,
    estimate_command,
    parse_margin,
    verdict,
)
from memplan.cli.flags import (
    add_layout_flags,
    add_setup_flags,
    as_flags,
    layout_from_args,
    setup_from_args,
)
from memplan.cli.from_file import from_json
from memplan.cli.inputs import model_arg, refuse_retracing, trace_path
from memplan.cli.table import command, echo, pairs, paragraph, table
from memplan.errors import UserError
from memplan.units import format_bytes, parse_size

if TYPE_CHECKING:  # imported where they are used: parsing the command line needs none of them
    from memplan.estimation import Estimate
    from memplan.hardware.devices import DeviceProfile

IMPL_NAMES = {"hf": "Hugging Face transformers", "litgpt": "LitGPT"}  # whose model code was traced
DEFAULT_SUGGEST = 6  # estimates the search for a change that fits may make (memplan.estimation.whatfits)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "estimate",
        help=SUBCOMMANDS["estimate"],
        formatter_class=DefaultsHelp,
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
    add_margin_flag(p)
    p.add_argument("--suggest", type=int, default=DEFAULT_SUGGEST, metavar="N",
                   help="when the job does not fit, the cheapest change that does, searched within N estimates "
                        f"(memplan fit --what-fits; default {DEFAULT_SUGGEST}, 0: none)")
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
    margin = parse_margin(args.margin)
    if isinstance(args.suggest, bool) or args.suggest < 0:
        raise UserError(f"--suggest takes a number of estimates >= 0, not {args.suggest!r}")
    path = trace_path(args.model)
    suggestion = None
    if path is not None:
        trace = load(path)
        refuse_retracing(args.model, trace, args, layout_flags=True)
        if args.device == "cpu":
            raise UserError(f"{args.model} is a trace: it cannot be re-traced for another device (--device cpu): "
                            "pass the model instead of the trace")
        result = estimate_trace(trace, args.gpu, capacity, args.allocator, args.alloc_conf,
                                cuda_context=cuda_context, name=path.name, margin=margin)
    else:
        cache: dict = {}
        result = estimate(model_arg(args), setup_from_args(args), layout_from_args(args), device=args.device or "cuda",
                          allocator=args.allocator, alloc_conf=args.alloc_conf, capacity=capacity, gpu=args.gpu,
                          extrapolate=not args.full_depth, parallel_tracing=not args.modelled_layout,
                          cuda_context=cuda_context, margin=margin, cache=cache)
        suggestion = suggest(result, args, cache)
    if args.json:
        print_json({**result.to_json(), "suggestion": suggestion, **from_json(args)})
        return 0
    render(result, suggestion)
    return 0


def suggest(result: Estimate, args: argparse.Namespace, cache: dict) -> dict | None:
    """For a job that does not fit, the cheapest change that does: one row of
    `memplan.estimation.whatfits.what_fits`, searched within `--suggest` estimates in this
    process (the job's traces reused), with its `memplan estimate` command. None where it
    fits, where no search was asked for, or where the job has options the search does not
    vary (a CUDA context or allocator string of the user's, the modelled layout, cpu)."""
    if result.fits is not False or args.suggest == 0 or args.gpu is None or result.device != "cuda" or \
            args.cuda_context is not None or args.alloc_conf is not None or args.modelled_layout:
        return None
    from memplan.estimation.search import Candidate, row_of
    from memplan.estimation.whatfits import what_fits

    setup, layout = setup_from_args(args), layout_from_args(args)
    found = what_fits(model_arg(args), args.gpu, setup, layout, top=1, margin=result.margin,
                      capacity=result.capacity_bytes if args.capacity is not None else None,
                      max_nodes=args.suggest, workers=1, progress=True, allocator=args.allocator,
                      base=row_of(Candidate(setup, layout), result), cache=cache,
                      label="memplan estimate: a change that fits")
    if not found.rows:
        return {"found": False, "estimates": found.estimates}
    row = found.rows[0]
    return {"found": True, "estimates": found.estimates, "changes": list(row.candidate.changes),
            "device_used_bytes": row.device_used_bytes, "usable_bytes": row.usable_bytes,
            "command": estimate_command(row.candidate, row.allocator, row.margin, args)}


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


def render(result: Estimate, suggestion: dict | None = None) -> None:
    """The estimate on stdout: one rank as key/value rows, several as a table; then the
    verdict, and for a job that does not fit the change `suggest` found."""
    layout = result.layout
    code = f"{IMPL_NAMES.get(result.impl, result.impl)}, " if result.impl is not None else ""
    title = (f"{result.model} ({code}{result.parameters / 1e9:.2f}B parameters) on {result.gpu or result.device}, "
             f"world {layout['world_size']} (dp {layout['dp']}, zero {layout['zero']}"
             f"{' ' + layout['engine'] if layout.get('engine') else ''}, tp {layout['tp']}, pp {layout['pp']}"
             + (f", cp {layout['cp']}" if layout.get("cp", 1) > 1 else "")
             + (f", ep {layout['ep']}" if layout.get("ep", 1) > 1 else "") + ")")
    if result.routing is not None:
        title += f", routing {result.routing}"
    render_figures(result, title, suggestion)


def render_figures(result: Estimate, title: str, suggestion: dict | None = None) -> None:
    """The per-rank figures under `title` (one rank as key/value rows, several as a table),
    host memory, and the verdict."""
    layout = result.layout
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
        echo(paragraph(f"{verdict(result)} ({result.method}, layout {result.parallel}, {result.elapsed_s:.1f} s)"))
        render_suggestion(suggestion)
    else:
        echo(paragraph(f"({result.method}, layout {result.parallel}, {result.elapsed_s:.1f} s; "
                       "give --gpu or --capacity to check the fit)"))


def render_suggestion(suggestion: dict | None) -> None:
    """The change that fits, with its command, or that none was found within the search."""
    if suggestion is None:
        return
    if not suggestion["found"]:
        echo(paragraph(f"no change that fits was found within {suggestion['estimates']} estimates: "
                       "memplan fit --what-fits searches further (--max-nodes)"))
        return
    echo(paragraph(f"cheapest change that fits: {', '.join(suggestion['changes'])}: "
                   f"{format_bytes(suggestion['device_used_bytes'])} of "
                   f"{format_bytes(suggestion['usable_bytes'])} usable"))
    echo(command(suggestion["command"]))
