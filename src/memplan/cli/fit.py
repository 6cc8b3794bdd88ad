"""`memplan fit MODEL --gpu NAME --gpus N|auto`: what fits, and how to make a job fit.

Four questions, one per mode:

- `--gpus N`: the layouts (DP / ZeRO / TP / PP, micro-batch, checkpointing, allocator) that
  fit on N GPUs, fastest first;
- `--gpus auto`: the fewest GPUs that fit, and at what layouts;
- `--max seq|batch`: the largest sequence length or micro-batch of your own setup and
  layout that fits on N GPUs;
- `--what-fits`: for your own job that does not fit, the smallest sets of changes that make
  it fit, fastest first.

Every row shown is a traced estimate, printed with the `memplan estimate` command line that
gives the same figures. fit traces the model, so it takes a model, not a trace.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from memplan.cli import SUBCOMMANDS, print_json
from memplan.cli.answer import (
    DefaultsHelp,
    add_margin_flag,
    estimate_command,
    margin_text,
    parse_margin,
)
from memplan.cli.estimate import render_assumptions
from memplan.cli.flags import (
    add_layout_flags,
    add_setup_flags,
    given_flags,
    layout_from_args,
    setup_from_args,
)
from memplan.cli.from_file import from_json
from memplan.cli.inputs import model_arg, refuse_trace
from memplan.cli.table import command, echo, paragraph, table
from memplan.errors import UserError
from memplan.parallel.layout import Layout
from memplan.units import format_bytes, parse_size

if TYPE_CHECKING:  # imported where they are used: parsing the command line needs none of them
    from memplan.estimation.fit import FitResult
    from memplan.estimation.maxshape import MaxResult
    from memplan.estimation.search import Row


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "fit",
        help=SUBCOMMANDS["fit"],
        formatter_class=DefaultsHelp,
        description="Search layouts, GPU counts, shapes or changes to a job; every row shown is a traced estimate, "
                    "with the memplan estimate command that gives it.",
    )
    p.add_argument("model", metavar="MODEL", nargs="?", default=None,
                   help="registry name, config.json path, package.module:factory or Hub id org/name")
    p.add_argument("--gpu", required=True, metavar="NAME", help="device profile, e.g. h100-80gb")
    p.add_argument("--gpus", required=True, metavar="N|auto", help="number of GPUs, or auto: the fewest that fit")
    p.add_argument("--capacity", default=None, metavar="SIZE", help="device memory in place of the profile's")
    add_margin_flag(p)
    p.add_argument("--allocator", default="caching", metavar="NAME",
                   help="the allocator every estimate replays: caching (default), expandable, planned or none")
    p.add_argument("--top", type=int, default=None, metavar="K", help="show the K fastest (default %(search_top)s)")
    p.add_argument("--max", default=None, metavar="seq|batch",
                   help="the largest sequence length or micro-batch of your setup and layout that fits")
    p.add_argument("--step", type=int, default=None, metavar="N",
                   help="--max granularity (default %(search_step_seq)s for seq, %(search_step_batch)s for batch)")
    p.add_argument("--what-fits", action="store_true",
                   help="the smallest sets of changes to your setup and layout that make the job fit")
    p.add_argument("--allow-quant", action="store_true", help="--what-fits may quantise the base model (QLoRA)")
    p.add_argument("--allow-more-gpus", action="store_true",
                   help="--what-fits may add GPUs (by default it keeps --gpus and changes the job on them)")
    p.add_argument("--max-nodes", type=int, default=None, metavar="N",
                   help="--what-fits: estimate at most N candidates (default %(search_max_nodes)s)")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="processes estimating in parallel (default: the cores this process may use)")
    add_setup_flags(p)
    add_layout_flags(p, world_size=False)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def parse_gpus(text: str) -> int | str:
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise UserError(f"--gpus takes a whole number >= 1 or auto, not {text!r}")
    return int(text)


def check_modes(args: argparse.Namespace, gpus: int | str) -> None:
    """`UserError` for flags that do not go together (one line, with the fix)."""
    from memplan.estimation.maxshape import TARGETS

    if args.max is not None and args.max not in TARGETS:
        raise UserError(f"unknown --max target {args.max!r}: choose {' or '.join(TARGETS)}")
    if args.max is not None and args.what_fits:
        raise UserError("--max and --what-fits are two searches: give one of them")
    if gpus == "auto" and args.max is not None:
        raise UserError("--max finds the largest shape on a given number of GPUs: give --gpus N, not auto")
    if gpus == "auto" and args.what_fits:
        raise UserError("--what-fits starts from your own job on --gpus N (more GPUs is one of the changes it "
                        "tries): give --gpus N, not auto")
    if args.max is None and args.step is not None:
        raise UserError("--step is the granularity of --max: add --max seq|batch, or leave --step out")
    if args.max is not None and args.top is not None:
        raise UserError("--max has one answer: leave --top out")
    if not args.what_fits and (args.allow_quant or args.allow_more_gpus or args.max_nodes is not None):
        raise UserError("--allow-quant, --allow-more-gpus and --max-nodes configure --what-fits: add --what-fits")
    custom = given_flags(Layout, args, leave_out=("world_size",))
    if custom and args.max is None and not args.what_fits:
        raise UserError(f"fit searches ZeRO, TP and PP itself; {', '.join(custom)} describe your own layout for "
                        "--max and --what-fits: leave them out")


def run(args: argparse.Namespace) -> int:
    from memplan.estimation.assumptions import setup_assumptions
    from memplan.estimation.fit import DEFAULT_TOP, fit
    from memplan.estimation.maxshape import MaxResult, max_shape
    from memplan.estimation.whatfits import DEFAULT_MAX_NODES, what_fits

    refuse_trace(args.model, "fit", "searches layouts, micro-batches and checkpointing by re-tracing the model "
                 "(memplan estimate TRACE gives the trace's own memory)")
    gpus = parse_gpus(args.gpus)
    check_modes(args, gpus)
    margin = parse_margin(args.margin)
    capacity = parse_size(args.capacity) if args.capacity is not None else None
    setup = setup_from_args(args)
    model = model_arg(args)
    common: dict[str, Any] = {"margin": margin, "capacity": capacity, "workers": args.workers, "progress": True,
                              "allocator": args.allocator}
    if args.max is not None:
        result: Any = max_shape(model, args.gpu, setup, layout_from_args(args, gpus), args.max, step=args.step,
                                **common)
    elif args.what_fits:
        result = what_fits(model, args.gpu, setup, layout_from_args(args, gpus), allow_quant=args.allow_quant,
                           allow_more_gpus=args.allow_more_gpus, top=args.top or DEFAULT_TOP,
                           max_nodes=args.max_nodes or DEFAULT_MAX_NODES, **common)
    else:
        result = fit(model, args.gpu, gpus, setup, top=args.top or DEFAULT_TOP, **common)
    assumptions = setup_assumptions(model, setup, layout_from_args(args, gpus if isinstance(gpus, int) else 1))
    if args.json:
        print_json({**result_json(result, args), "assumptions": assumptions, **from_json(args)})
        return 0
    if isinstance(result, MaxResult):
        render_max(result, args)
    else:
        render_rows(result, args, margin)
    render_assumptions(assumptions)
    return 0


def row_command(row: Row, args: argparse.Namespace) -> str:
    """The `memplan estimate` command line that estimates `row`'s candidate."""
    return estimate_command(row.candidate, row.allocator, row.margin, args)


def _row_json(row: Row | None, args: argparse.Namespace) -> dict[str, Any] | None:
    return None if row is None else {**row.to_json(), "command": row_command(row, args)}


def result_json(result: FitResult | MaxResult, args: argparse.Namespace) -> dict[str, Any]:
    """The result's JSON object, each row with its `memplan estimate` command."""
    from memplan.estimation.maxshape import MaxResult
    from memplan.estimation.whatfits import WhatFitsResult

    doc = result.to_json()
    if isinstance(result, MaxResult):
        doc["at"], doc["above"] = _row_json(result.at, args), _row_json(result.above, args)
        return doc
    doc["configurations"] = [_row_json(r, args) for r in result.rows]
    doc["below"] = _row_json(result.below, args)
    if isinstance(result, WhatFitsResult):
        doc["base"] = _row_json(result.base, args)
    return doc


def _title(result: FitResult, args: argparse.Namespace) -> str:
    from memplan.estimation.whatfits import WhatFitsResult

    if isinstance(result, WhatFitsResult):
        if result.base is not None and result.base.fits:
            return f"{result.model} fits as it is on {result.gpus} x {args.gpu}"
        return f"{result.model} on {result.gpus} x {args.gpu}: {len(result.rows)} smallest changes that fit"
    if result.gpus is None:
        return f"{result.model} fits on no count of {args.gpu} searched (try --what-fits)"
    fewest = "fewest GPUs: " if args.gpus == "auto" else ""
    return f"{result.model} on {fewest}{result.gpus} x {args.gpu}: the {len(result.rows)} fastest configurations"


def _cells(row: Row, what_fits_mode: bool) -> list[str]:
    c = row.to_json()
    timing = [format_bytes(c["device_used_bytes"]), f"{c['step_s']:.3f}", f"{1000 * c['s_per_token']:.4f}"]
    if what_fits_mode:
        return [", ".join(c["changes"]) or "(none)", *timing]
    accum = c["microbatches"] if c["pp"] > 1 else c["grad_accum"]
    return [str(c["dp"]), str(c["zero"]), str(c["tp"]), str(c["pp"]), str(c["micro_batch"]), str(accum),
            c["checkpointing"], c["allocator"], *timing]


def render_rows(result: FitResult, args: argparse.Namespace, margin: float) -> None:
    """A table of `result`'s rows, then each row's `memplan estimate` command."""
    from memplan.estimation.whatfits import WhatFitsResult

    what_fits_mode = isinstance(result, WhatFitsResult)
    layout = ["dp", "zero", "tp", "pp", "mb", "accum", "ckpt", "allocator"]
    header = ["#", *(["changes"] if what_fits_mode else layout), "device used", "step (s)", "ms/token"]
    rows = [[str(i), *_cells(row, what_fits_mode)] for i, row in enumerate(result.rows, start=1)]
    echo(table(header, rows, title=_title(result, args), right=[h != "changes" for h in header]))
    for i, row in enumerate(result.rows, start=1):
        echo(command(row_command(row, args), prefix=f"{i}: "))
    if result.below is not None:
        b = result.below
        echo(paragraph(f"one step below, {b.candidate.layout.world_size} GPUs: the closest candidate needs "
                       f"{format_bytes(b.device_used_bytes)} of {format_bytes(b.usable_bytes)} usable"))
    usable = format_bytes(result.rows[0].usable_bytes) if result.rows else "-"
    echo(paragraph(f"({result.estimates} estimates; every row traced; usable {usable}: {margin_text(margin)} "
                   "margin)"))


def render_max(result: MaxResult, args: argparse.Namespace) -> None:
    """The largest shape, the probes that bracket it and its `memplan estimate` command."""
    rows = [[str(row.candidate.setup.seq if result.target == "seq" else row.candidate.setup.batch),
             format_bytes(row.device_used_bytes), format_bytes(row.usable_bytes), "yes" if row.fits else "no"]
            for row in result.probes]
    echo(table([result.target, "device used", "usable", "fits"], rows,
               title=f"{result.model} on {args.gpus} x {args.gpu}: the largest {result.target} that fits"))
    if result.value is None:
        echo(f"not even {result.target} {result.step} fits\n")
        return
    above = result.above.candidate.setup if result.above is not None else None
    larger = (above.seq if result.target == "seq" else above.batch) if above is not None else None
    why = {"memory": f"{result.target} {larger} does not fit",
           "positions": "the model's maximum positions", "cap": "the search's upper limit",
           "budget": "the search's estimates ran out before the bracket closed"}[result.limit]
    echo(paragraph(f"largest {result.target}: {result.value} ({why}; {result.estimates} estimates)"))
    echo(command(row_command(result.at, args)))
