"""`memplan SUBCOMMAND`: one thin front end over the library.

Each subcommand lives in its own module of this package with two functions,
`add_parser(subparsers)` and `run(args) -> int`. Parsing and rendering happen here;
the work is done by library functions of the same names. `--json` prints exactly one
JSON object on stdout; progress and logs go to stderr. Bad input (`UserError`) is
one line on stderr and exit code 2, with nothing written. A mistake of memplan's own
caught by one of its validators (`MemplanBug`) is exit code 3, with the message, a
request to report it and the input the command was working on.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Any

from memplan.errors import BUG_EXIT_CODE, MemplanBug, UserError

# Subcommand -> its one-line help, in the order `memplan --help` lists them; each lives in
# the module of the same name (its parser and `run`).
SUBCOMMANDS = {
    "run": "run your own training command on fake weights and real data, and trace its memory (no GPU needed)",
    "trace": "capture the lifetime trace of one training step",
    "show": "summarise a trace: peak live bytes, breakdown at the peak, largest buffers",
    "simulate": "replay a trace through an allocator: peak reserved memory and fragmentation",
    "pack": "solve a minimalloc CSV offset problem (exact, with greedy as the start)",
    "plan": "plan the addresses of a training step ahead (STWeaver): a periodic plan file",
    "reorder": "find an operator order of the whole training step with a lower peak",
    "estimate": "predict per-GPU peak memory of a training step (no GPU needed)",
    "fit": "what fits: layouts on N GPUs, the fewest GPUs, the largest seq/batch, the changes that make a job fit",
    "generate": "predict the peak memory of a transformers generate() call (no GPU needed)",
    "serve": "how much KV cache a vLLM / SGLang server gets, and whether it starts (no GPU needed)",
    "rl": "the memory of an RL post-training step (GRPO, PPO, DPO, RLOO), phase by phase (no GPU needed)",
    "compare": "a measured step beside memplan's estimate: peaks, categories at the peak, phases, unmatched buffers",
    "calibrate": "fit a device profile (CUDA context, cuBLAS workspace, NCCL buffers, capacity) to a measured step",
    "offload": "plan lifetime-aware offloading to NVMe and host memory (TERAIO) and simulate the step",
    "report": "write an offline HTML report (index.html, PNGs, an interactive timeline) from traces, plans and results",
    "demo": "run the main job on the embedded default (a GPT-2 step) and write a report",
}


class _Parser(argparse.ArgumentParser):
    """argparse that reports usage errors as one line and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"memplan: error: {message} (see '{self.prog} --help')\n")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The argument parser, one sub-parser per subcommand; with `only`, that subcommand's
    alone is built in full (its module imported; "": none), the others named with their help,
    so that `memplan --help` and a bad flag answer without importing what the work needs."""
    parser = _Parser(prog="memplan", description=__doc__.splitlines()[0])
    parser.add_argument("--verbose", action="store_true", help="show the libraries' warnings as they come")
    subparsers = parser.add_subparsers(dest="command", metavar="SUBCOMMAND", parser_class=_Parser)
    subparsers.required = True
    for name, text in SUBCOMMANDS.items():
        if only is not None and name != only:
            subparsers.add_parser(name, help=text)
            continue
        module = importlib.import_module(f"memplan.cli.{name}")
        sub = module.add_parser(subparsers)
        sub.add_argument("--verbose", action="store_true", default=argparse.SUPPRESS,
                         help="show the libraries' warnings as they come")
        positionals = [action.dest for action in sub._actions if not action.option_strings]
        sub.set_defaults(_run=module.run, _inputs=positionals, _parser=sub)
    return parser


def _subcommand_of(argv: list[str]) -> str | None:
    """The subcommand `argv` names (None: none, e.g. `memplan --help`)."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def print_json(obj: Any) -> None:
    """Print exactly one JSON object on stdout."""
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False, default=_json_default) + "\n")


def _json_default(obj: Any) -> Any:
    """numpy scalars and arrays as JSON numbers and lists (numpy is imported by whatever made them)."""
    np = sys.modules.get("numpy")
    if np is not None and isinstance(obj, np.integer):
        return int(obj)
    if np is not None and isinstance(obj, np.floating):
        return float(obj)
    if np is not None and isinstance(obj, np.ndarray):
        return obj.tolist()
    raise TypeError(f"{type(obj).__name__} is not JSON serialisable")


def _inputs_of(args: argparse.Namespace) -> str:
    """The positional arguments of the command (its input files or model), as typed."""
    values: list[str] = []
    for dest in args._inputs:
        value = getattr(args, dest, None)
        values.extend(value if isinstance(value, list) else [value])
    return " ".join(str(v) for v in values if v is not None) or "(no input)"


def main(argv: list[str] | None = None) -> int:
    """Console entry point."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    only = _subcommand_of(arguments)
    parser = build_parser(only if only in SUBCOMMANDS else "")
    try:
        args = parser.parse_args(arguments)
    except SystemExit as exc:  # --help, or a usage error argparse has already printed
        return exc.code if isinstance(exc.code, int) else 2
    from memplan.cli.quiet import LibraryWarnings

    with LibraryWarnings(verbose=getattr(args, "verbose", False)) as held:
        code = _run(args, arguments)
        held.summarise = code == 0  # an error stays the one line it is
    return code


def _run(args: argparse.Namespace, arguments: list[str]) -> int:
    """The subcommand, with memplan's errors as exit codes (module docstring)."""
    from memplan.cli.from_file import apply_from_file

    try:
        apply_from_file(args, arguments)
        return int(args._run(args) or 0)
    except UserError as exc:
        from memplan.cli.flags import as_flags

        sys.stderr.write(f"memplan: error: {as_flags(str(exc))}\n")
        return 2
    except MemplanBug as exc:
        sys.stderr.write(f"memplan: internal error (a memplan bug, please report it): {exc}\n"
                         f"memplan: it was working on: {_inputs_of(args)}\n")
        return BUG_EXIT_CODE
    except KeyboardInterrupt:
        sys.stderr.write("memplan: interrupted\n")
        return 130


if __name__ == "__main__":
    sys.exit(main())
