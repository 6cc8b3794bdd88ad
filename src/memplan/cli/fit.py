"""`memplan fit MODEL --gpu NAME --gpus N`: the parallel layouts that fit, fastest first.

fit traces the model under every layout, micro-batch and checkpointing policy it
searches, so it takes a model, not a trace (`memplan estimate TRACE` gives a trace's memory).
"""

from __future__ import annotations

import argparse

from memplan.cli import print_json
from memplan.cli.from_file import from_json
from memplan.cli.inputs import model_arg, refuse_trace
from memplan.cli.setup_flags import add_setup_flags, setup_from_args
from memplan.cli.table import echo, table
from memplan.estimation.fit import fit
from memplan.units import format_bytes


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "fit",
        help="search DP / ZeRO / TP / PP, micro-batch, checkpointing and allocator for what fits",
        description="Estimate every layout of N GPUs and list those that fit, ranked by a roofline step time.",
    )
    p.add_argument("model", metavar="MODEL", nargs="?", default=None,
                   help="registry name, config.json path, package.module:factory or Hub id org/name")
    p.add_argument("--gpu", required=True, metavar="NAME", help="device profile, e.g. h100-80gb")
    p.add_argument("--gpus", required=True, type=int, metavar="N", help="number of GPUs")
    p.add_argument("--top", type=int, default=None, metavar="K", help="show the K fastest (default all)")
    add_setup_flags(p)
    p.add_argument("--json", action="store_true", help="print one JSON object (a list of configurations)")
    return p


def run(args: argparse.Namespace) -> int:
    refuse_trace(args.model, "fit", "searches layouts, micro-batches and checkpointing by re-tracing the model "
                 "(memplan estimate TRACE gives the trace's own memory)")
    configs = fit(model_arg(args), args.gpu, args.gpus, setup_from_args(args), progress=True, top=args.top)
    if args.json:
        print_json({"model": args.model, "gpu": args.gpu, "gpus": args.gpus, "configurations": configs,
                    **from_json(args)})
        return 0
    echo(table(["dp", "zero", "tp", "pp", "micro-batch", "ckpt", "allocator", "device used", "step (s)", "ms/token"],
               [[c["dp"], c["zero"], c["tp"], c["pp"], c["micro_batch"], c["checkpointing"], c["allocator"],
                 format_bytes(c["device_used_bytes"]), f"{c['step_s']:.3f}", f"{1000 * c['s_per_token']:.3f}"]
                for c in configs],
               title=f"{args.model} on {args.gpus} x {args.gpu}: {len(configs)} configurations fit"))
    return 0
