"""`memplan run [options] -- COMMAND...`: the memory of the user's own training program."""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import TYPE_CHECKING

from memplan.cli import SUBCOMMANDS, print_json
from memplan.cli.estimate import render_figures
from memplan.cli.table import echo, pairs, paragraph
from memplan.errors import UserError
from memplan.program.launchers import LAUNCHERS

if TYPE_CHECKING:  # imported where they are used: parsing the command line needs none of them
    from memplan.program import ProgramRun

PROGRAM_FAILED_EXIT_CODE = 1  # the program's own error


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "run",
        help=SUBCOMMANDS["run"],
        description="Run the training COMMAND (" + ", ".join(sorted(LAUNCHERS)) + ") unmodified in memplan's "
        "process: its weights are fake (no memory, any size), its data real, its GPU the --gpu profile and its "
        "process group a fake one of the launcher's world. Its optimizer steps are traced and, per distinct rank, "
        "estimated as `memplan estimate` does (allocator replay, CUDA context, NCCL). Everything after `--` is "
        "the command, as typed.",
    )
    p.add_argument("--gpu", default=None, metavar="NAME", help="device profile the program runs for "
                   "(default h100-80gb; `memplan estimate --gpu list` lists them)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="the device the program is run for (default cuda; cpu: the program as it runs on this CPU)")
    p.add_argument("--steps", type=int, default=2, metavar="N",
                   help="optimizer steps traced after the first (default 2; the first makes the optimizer state)")
    p.add_argument("--ranks", default="distinct", metavar="all|distinct|R",
                   help="ranks traced: distinct (default: one per class of ranks whose shards differ), all, or "
                        "rank numbers (0,7)")
    p.add_argument("--max-seconds", type=float, default=600.0, metavar="S",
                   help="stop a program that takes no optimizer step for this long (default 600)")
    p.add_argument("-o", "--output", default="memplan-run", metavar="DIR",
                   help="where each rank's .memtrace, run.json and the program's own writes go (default memplan-run)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("program", nargs=argparse.REMAINDER, metavar="-- COMMAND", help="the training command")
    return p


def run(args: argparse.Namespace) -> int:
    words = list(args.program)
    if words[:1] == ["--"]:
        words = words[1:]
    if not words:
        raise UserError("give the training command after `--`: memplan run -- python train.py ...")
    from memplan.program import ProgramFailed, run_program

    try:
        with contextlib.redirect_stdout(sys.stderr):  # the program's own prints: stdout is memplan's
            result = run_program(words, device=args.device, gpu=args.gpu, steps=args.steps, ranks=args.ranks,
                                 max_seconds=args.max_seconds, out_dir=args.output, progress=True)
    except ProgramFailed as exc:
        sys.stderr.write(f"memplan run: {exc}; its traceback, without memplan's frames:\n")
        if exc.program_traceback:
            sys.stderr.write(exc.program_traceback)
        return PROGRAM_FAILED_EXIT_CODE
    if args.json:
        print_json(result.to_json())
        return 0
    render(result)
    return 0


def _seen_rows(result: ProgramRun) -> list[tuple[str, str]]:
    seen = result.seen
    model, optimizer, setup = seen["model"], seen["optimizer"], seen["setup"]
    rows = [("model", f"{model.get('class', '?')} ({model.get('parameters', 0) / 1e6:.2f}M parameters)"),
            ("parameters", ", ".join(f"{k} x{v}" for k, v in seen["parameter_dtypes"].items())),
            ("autocast", seen["autocast"] or "none")]
    if optimizer:
        states = ", ".join(f"{k} x{v}" for k, v in optimizer["state_dtypes"].items()) or "none"
        master = ", ".join(optimizer["master_weights"])
        rows += [("optimizer", f"{optimizer['class']} ({optimizer['implementation']}), master weights {master}, "
                               f"states {states}")]
    rows += [("batch", f"{setup.get('batch')} x {setup.get('seq')} (first forward), "
                       f"{max(seen['forward_calls_per_step'] or [1])} forward(s) per step"),
             ("loss", seen["loss"] or "?"),
             ("checkpointing", f"{seen['recomputed_ops']} ops recomputed in backward" if seen["recomputed_ops"]
              else "none (nothing recomputed in backward)"),
             ("layout", ", ".join(f"{k} {v}" for k, v in seen["layout"].items()))]
    rows += [("ran eagerly", f"{name} (its compile failed: {why})") for name, why in seen["compiled_eagerly"].items()]
    rows += [("graph break", f"{count}x {why} (the code between graphs ran eagerly)")
             for why, count in seen["graph_breaks"].items()]
    return rows


def render(result: ProgramRun) -> None:
    """What memplan saw, the per-rank figures, how the program ran."""
    launch = result.launch
    program = launch.args[0] if launch.entry is not None and launch.args else launch.target  # a console script's command
    echo(pairs(_seen_rows(result), title=f"what memplan saw `{launch.launcher} {program}` do"))
    estimate = result.estimate
    count = f"{estimate.parameters / 1e9:.2f}B" if estimate.parameters >= 1e8 else f"{estimate.parameters / 1e6:.2f}M"
    title = (f"{estimate.model} ({count} parameters) on {estimate.gpu or estimate.device}, "
             f"world {launch.world_size}, the program's own code")
    render_figures(estimate, title)
    for run in result.runs:
        ended = "stopped by memplan" if run.ended == "stopped" else "ended on its own"
        echo(paragraph(f"rank {run.rank}: {run.steps} optimizer steps traced, {ended} ({run.elapsed_s:.1f} s); "
                       f"trace {result.files.get(f'rank{run.rank}')}"))
        for site, count in sorted(run.reads.items()):
            echo(paragraph(f"  {site}: read as 0.0 ({count}x; the model's tensors are fake)"))
        for skipped in run.skipped_writes:
            echo(paragraph(f"  not written (fake tensors): {skipped}"))
    if any(r.redirected_writes for r in result.runs):
        echo(paragraph(f"the program's own files were written under {result.files['json'].rsplit('/', 1)[0]}/files/"))
