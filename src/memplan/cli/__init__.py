"""`memplan SUBCOMMAND`: one thin front end over the library.

Each subcommand lives in its own module of this package with two functions,
`add_parser(subparsers)` and `run(args) -> int`. Parsing and rendering happen here;
the work is done by library functions of the same names. `--json` prints exactly one
JSON object on stdout; progress and logs go to stderr. Bad input (`UserError`) is
one line on stderr and exit code 2, with nothing written.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Any

from memplan.errors import UserError

# Subcommand modules, in the order `memplan --help` lists them.
SUBCOMMANDS = ["trace", "show", "simulate", "pack", "plan", "reorder", "estimate", "fit", "offload", "report", "demo"]


class _Parser(argparse.ArgumentParser):
    """argparse that reports usage errors as one line and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"memplan: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser, one sub-parser per available subcommand."""
    parser = _Parser(prog="memplan", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", metavar="SUBCOMMAND", parser_class=_Parser)
    subparsers.required = True
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(f"memplan.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"memplan.cli.{name}":
                continue  # that capability has not landed yet
            raise
        sub = module.add_parser(subparsers)
        sub.set_defaults(_run=module.run)
    return parser


def print_json(obj: Any) -> None:
    """Print exactly one JSON object on stdout."""
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False, default=_json_default) + "\n")


def _json_default(obj: Any) -> Any:
    import numpy as np

    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise TypeError(f"{type(obj).__name__} is not JSON serialisable")


def _quiet_libraries() -> None:
    """Keep stderr for memplan's own progress: silence library chatter users cannot act on."""
    import os
    import warnings

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="torch")


def main(argv: list[str] | None = None) -> int:
    """Console entry point."""
    _quiet_libraries()
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except UserError as exc:
        sys.stderr.write(f"memplan: error: {exc}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("memplan: interrupted\n")
        return 130


if __name__ == "__main__":
    sys.exit(main())
