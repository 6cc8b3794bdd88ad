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
import logging
import os
import sys
import warnings
from typing import Any

import numpy as np

from memplan.cli.from_file import apply_from_file
from memplan.errors import BUG_EXIT_CODE, MemplanBug, UserError

# Subcommand modules, in the order `memplan --help` lists them.
SUBCOMMANDS = ["trace", "show", "simulate", "pack", "plan", "reorder", "estimate", "fit", "compare", "calibrate", "offload", "report", "demo"]


class _Parser(argparse.ArgumentParser):
    """argparse that reports usage errors as one line and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"memplan: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser, one sub-parser per subcommand."""
    parser = _Parser(prog="memplan", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", metavar="SUBCOMMAND", parser_class=_Parser)
    subparsers.required = True
    for name in SUBCOMMANDS:
        module = importlib.import_module(f"memplan.cli.{name}")
        sub = module.add_parser(subparsers)
        positionals = [action.dest for action in sub._actions if not action.option_strings]
        sub.set_defaults(_run=module.run, _inputs=positionals, _parser=sub)
    return parser


def print_json(obj: Any) -> None:
    """Print exactly one JSON object on stdout."""
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False, default=_json_default) + "\n")


def _json_default(obj: Any) -> Any:
    """numpy scalars and arrays as JSON numbers and lists."""
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise TypeError(f"{type(obj).__name__} is not JSON serialisable")


def _quiet_libraries() -> None:
    """Keep stderr for memplan's own progress: silence library chatter users cannot act on."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="torch")
    # torchao (imported by peft) logs each CUDA-only extension a CPU build cannot load, and
    # its enum registrations make torch.utils._pytree log a deprecation: neither is the user's
    logging.getLogger("torchao").setLevel(logging.ERROR)
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)


def _inputs_of(args: argparse.Namespace) -> str:
    """The positional arguments of the command (its input files or model), as typed."""
    values: list[str] = []
    for dest in args._inputs:
        value = getattr(args, dest, None)
        values.extend(value if isinstance(value, list) else [value])
    return " ".join(str(v) for v in values if v is not None) or "(no input)"


def main(argv: list[str] | None = None) -> int:
    """Console entry point."""
    _quiet_libraries()
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error argparse has already printed
        return exc.code if isinstance(exc.code, int) else 2
    try:
        apply_from_file(args, list(sys.argv[1:] if argv is None else argv))
        return int(args._run(args) or 0)
    except UserError as exc:
        from memplan.cli.flags import user_error_text

        sys.stderr.write(f"memplan: error: {user_error_text(str(exc))}\n")
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
