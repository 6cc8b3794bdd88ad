"""`memplan trace MODEL [setup flags] [--real] -o step.memtrace`: capture a training step."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from memplan.cli import SUBCOMMANDS, print_json
from memplan.cli.flags import add_setup_flags, setup_from_args
from memplan.cli.from_file import from_json
from memplan.cli.inputs import model_arg, refuse_trace
from memplan.cli.table import echo, paragraph
from memplan.errors import UserError
from memplan.units import format_bytes

if TYPE_CHECKING:  # imported where they are used: parsing the command line needs none of them
    pass


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "trace",
        help=SUBCOMMANDS["trace"],
        description="Capture every storage allocation and free of a training step of MODEL "
        "(a registry name, a config.json path, package.module:factory or a Hub id org/name). By default the "
        "step runs on fake tensors (no memory, any size); --real runs it on this CPU.",
    )
    p.add_argument("model", metavar="MODEL", nargs="?", default=None)
    add_setup_flags(p)
    p.add_argument("--real", action="store_true", help="run the step for real on this CPU")
    p.add_argument(
        "--device",
        default=None,
        help="device the fake step runs on: cuda (default for fake) or cpu; --real is always cpu",
    )
    p.add_argument("--iterations", type=int, default=1, help="training steps to record (default 1)")
    p.add_argument(
        "--warmup", type=int, default=1, help="untraced steps first, so optimizer state exists (default 1)"
    )
    p.add_argument("-o", "--output", required=True, help="the .memtrace file to write")
    p.add_argument("--json", action="store_true", help="print the trace summary as JSON")
    return p


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from memplan.capture import capture_model
    from memplan.trace import save

    refuse_trace(args.model, "trace", "captures a model's step")
    if args.iterations < 1 or args.warmup < 0:
        raise UserError("--iterations must be >= 1 and --warmup >= 0")
    out = Path(args.output)
    if not out.parent.exists():
        raise UserError(f"cannot write {out}: directory {out.parent} does not exist")
    device = "cpu" if args.real else (args.device or "cuda")
    if device not in ("cpu", "cuda"):
        raise UserError(f"unknown device {device!r}: use cpu or cuda")
    setup = setup_from_args(args)
    console = Console(stderr=True)
    with console.status(f"tracing {args.model} ({'real cpu' if args.real else 'fake ' + device})…"):
        trace = capture_model(
            model_arg(args),
            setup,
            fake=not args.real,
            device=device,
            iterations=args.iterations,
            warmup=args.warmup,
        )
        save(trace, out)
    summary = trace.summary(top=0)
    if args.json:
        print_json(
            {
                "output": str(out),
                "peak_bytes": summary["peak_bytes"],
                "peak_phase": summary["peak_phase"],
                "num_buffers": summary["num_buffers"],
                "num_ops": summary["num_ops"],
                "capture_s": trace.meta.get("capture_s"),
                **from_json(args),
            }
        )
    else:
        echo(paragraph(
            f"wrote {out}: {summary['num_ops']} ops, {summary['num_buffers']} buffers, "
            f"peak {format_bytes(summary['peak_bytes'])} in {summary['peak_phase']} "
            f"(captured in {trace.meta.get('capture_s')} s)"
        ))
    return 0
