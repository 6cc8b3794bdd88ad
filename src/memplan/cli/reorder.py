"""`memplan reorder MODEL [setup flags] [--time-limit S] [--json]`: a lower-peak operator order.

Traces the whole training step of MODEL on fake tensors as one graph, and compares the
theoretical peak of the program order (eager PyTorch), the best Inductor-style order
(LPMF, BFS, DFS within forward, backward and optimizer) and memplan's order
(`memplan.order.solve`), which the independent validator checks.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING

from memplan.cli import SUBCOMMANDS, print_json
from memplan.cli.flags import add_setup_flags, setup_from_args
from memplan.cli.from_file import from_json
from memplan.cli.inputs import model_arg, refuse_trace
from memplan.cli.table import echo, pairs
from memplan.errors import UserError
from memplan.units import format_bytes

if TYPE_CHECKING:  # imported where they are used: parsing the command line needs none of them
    pass


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "reorder",
        help=SUBCOMMANDS["reorder"],
        description="Trace the whole training step of MODEL (registry name, config.json path, "
        "package.module:factory or Hub id org/name) as one graph on fake tensors and reorder its operators "
        "(forward, backward and optimizer together) to lower the peak memory (ROAM).",
    )
    p.add_argument("model", metavar="MODEL", nargs="?", default=None)
    add_setup_flags(p)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="device the job is for: its optimizer defaults (default cuda: foreach)")
    p.add_argument("--time-limit", type=float, default=60.0, metavar="S",
                   help="seconds for the optimiser, after tracing (default 60)")
    p.add_argument("--node-limit", type=int, default=100, metavar="N",
                   help="operators per exactly-solved subproblem (default 100)")
    p.add_argument("--layout", action="store_true",
                   help="also place the intermediates with the offset solver (layout-aware peak)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    return p


def run(args: argparse.Namespace) -> int:
    from memplan.models.registry import load_config
    from memplan.order import capture_model_step, layout_peak
    from memplan.order.solve import optimize_order

    refuse_trace(args.model, "reorder", "traces the model's step as one operator graph, which a trace does not hold")
    if not args.time_limit or args.time_limit <= 0:
        raise UserError(f"--time-limit must be more than 0 seconds, not {args.time_limit:g}")
    if args.node_limit < 2:
        raise UserError(f"--node-limit must be at least 2, not {args.node_limit}")
    setup = setup_from_args(args)
    spec = model_arg(args)
    if isinstance(spec, str):
        spec = load_config(spec)  # an unknown model fails here, before any progress line
    start = time.perf_counter()
    sys.stderr.write(f"memplan: tracing {args.model} on fake tensors…\n")
    graph = capture_model_step(spec, setup, device=args.device)
    sys.stderr.write(f"memplan: {graph.num_ops} operators; optimising for up to {args.time_limit:g} s…\n")
    result = optimize_order(graph, time_limit_s=args.time_limit, node_limit=args.node_limit)
    out = {
        "model": args.model,
        "setup": setup.to_dict(),
        "baseline_peak_bytes": result.baseline_peak_bytes,
        "inductor_peak_bytes": result.inductor_peak_bytes,
        "optimized_peak_bytes": result.optimized_peak_bytes,
        "lower_bound_bytes": result.lower_bound_bytes,
        "num_nodes": result.num_nodes,
        "elapsed_s": result.elapsed_s,
        "verified": result.verified,
        "reduction_vs_baseline": round(1 - result.optimized_peak_bytes / result.baseline_peak_bytes, 4),
        "persistent_bytes": graph.persistent_bytes,
        "trace_s": graph.meta.get("trace_s"),
        "total_s": None,
        "start_order": result.stats.get("start"),
        "key_points": result.stats.get("key_points"),
        "windows_solved": result.stats.get("windows_solved"),
        "windows_improved": result.stats.get("windows_improved"),
        **from_json(args),
    }
    if args.layout:
        out["layout_peak_bytes"] = layout_peak(graph, result.order, time_limit_s=min(30.0, args.time_limit))
    out["total_s"] = round(time.perf_counter() - start, 3)
    if args.json:
        print_json(out)
        return 0

    base = result.baseline_peak_bytes
    rows = [
        ("program order", format_bytes(base)),
        ("Inductor-style", format_bytes(result.inductor_peak_bytes)),
        ("memplan order", f"{format_bytes(result.optimized_peak_bytes)} "
         f"({100 * (1 - result.optimized_peak_bytes / base):.1f}% below program order; validated)"),
    ]
    if result.lower_bound_bytes:
        rows.append(("lower bound", format_bytes(result.lower_bound_bytes)
                     + (" (memplan's order is optimal)" if result.lower_bound_bytes == result.optimized_peak_bytes
                        else "")))
    if args.layout:
        rows.append(("with layout", format_bytes(out["layout_peak_bytes"])))
    rows.append(("optimised in", f"{result.elapsed_s:.1f} s (total {out['total_s']:.1f} s)"))
    echo(pairs(rows, title=f"{args.model}: {result.num_nodes} operators"))
    return 0
