"""`--from FILE` and `--trust-remote-code`, the model-input flags of every subcommand that
takes a model.

`--from FILE` reads a trainer's configuration (`memplan.trainers`: axolotl,
torchtune, torchtitan, accelerate, TrainingArguments) and fills the model, the setup flags
and, where the subcommand has them, the parallel-layout flags. A flag typed on the command
line wins over the file (and the report says so); every key of the file is listed on
stderr as used or left out, and under "from" in `--json` output.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from memplan.errors import UserError
from memplan.models.fields import flags_by_name, flags_in_message
from memplan.models.setup import TrainingSetup
from memplan.parallel.layout import Layout
from memplan.trainers import read_trainer_config
from memplan.trainers.mapping import LAYOUT_FIELDS, TrainerConfig

REPORT = "_from_report"  # the Namespace attribute the report is kept under


def add_model_input_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model input")
    group.add_argument("--from", dest="from_file", default=None, metavar="FILE",
                       help="a trainer's configuration (axolotl or torchtune YAML, torchtitan TOML, accelerate "
                            "config YAML, TrainingArguments JSON): its model, setup and layout; flags given on "
                            "the command line win")
    group.add_argument("--trust-remote-code", action="store_true",
                       help="run the model repository's own code where its config.json's auto_map needs it "
                            "(transformers' trust_remote_code=True)")


def explicit_options(args: argparse.Namespace, argv: list[str]) -> set[str]:
    """The dests of the options typed in `argv` (the subcommand's own flags): argparse is
    run again on the subcommand's arguments with every option preset to a marker, and
    only typed options replace it."""
    parser = getattr(args, "_parser", None)
    if parser is None or args.command not in argv:
        return set()
    marker = object()
    options = [a for a in parser._actions if a.option_strings and a.dest != argparse.SUPPRESS]
    namespace = argparse.Namespace(**{a.dest: marker for a in options})
    parser.parse_known_args(argv[argv.index(args.command) + 1:], namespace)
    return {a.dest for a in options if getattr(namespace, a.dest) is not marker}


def apply_from_file(args: argparse.Namespace, argv: list[str]) -> None:
    """Fill `args` from `--from FILE` (module docstring), then require a model."""
    if "from_file" not in vars(args):
        return
    if args.from_file is not None:
        config = read_trainer_config(args.from_file)
        setattr(args, REPORT, _apply(args, config, explicit_options(args, argv)))
    if args.model is None and getattr(args, "gpu", None) != "list":
        raise UserError("a model is required: give MODEL (a registry name, a config.json path, "
                        "package.module:factory or a Hub id org/name) or --from FILE")


def _apply(args: argparse.Namespace, config: TrainerConfig, explicit: set[str]) -> dict[str, Any]:
    """Set the flags the file gives and the command line does not; the report of it."""
    overridden: dict[str, str] = {}
    has_layout = "tp" in vars(args)
    flags = flags_by_name(TrainingSetup, Layout)
    for name, value in {**config.setup, **(config.layout if has_layout else {})}.items():
        field = flags[name]
        if field.dest in explicit:
            overridden[name] = (f"{field.flag} {field.format(getattr(args, field.dest))} (command line) over "
                                f"{field.format(value)} (file)")
        else:
            setattr(args, field.dest, value)
    if not has_layout:
        _layout_left_out(config, args.command)
    if args.model is None:
        args.model = config.model
    elif config.model is not None and config.model != args.model:
        overridden["model"] = f"{args.model} (command line) over {config.model} (file)"
    for name, message in config.unresolved.items():
        given = args.model is not None if name == "model" else name in explicit
        if not given and (name not in LAYOUT_FIELDS or has_layout):
            raise UserError(message)
    report = {**config.to_json(), "overridden": overridden}
    _write_report(report)
    return report


def _layout_left_out(config: TrainerConfig, command: str) -> None:
    """A subcommand without parallel-layout flags leaves the file's layout out."""
    why = f"memplan {command} has no parallel-layout flags (memplan estimate has)"
    for key, names in config.set_by.items():
        if key in config.used and all(name in LAYOUT_FIELDS for name in names):
            config.ignored[key] = why
            del config.used[key]
    config.layout.clear()


def _write_report(report: dict[str, Any]) -> None:
    """Each key of the file on stderr: what it set, or why it was left out (the fields a
    reason names, as flags)."""
    head = f"memplan: --from {report['file']} ({report['format']})"
    for key, text in report["used"].items():
        sys.stderr.write(f"{head}: used {key}: {text}\n")
    by_reason: dict[str, list[str]] = {}
    for key, why in report["ignored"].items():
        by_reason.setdefault(why, []).append(key)
    for why, keys in by_reason.items():
        sys.stderr.write(f"{head}: ignored {', '.join(keys)}: {flags_in_message(why, TrainingSetup, Layout)}\n")
    for name, text in report["defaults"].items():
        sys.stderr.write(f"{head}: the file names no {name}: {text}\n")
    for name, text in report["overridden"].items():
        sys.stderr.write(f"{head}: {name}: {text}\n")


def from_json(args: argparse.Namespace) -> dict[str, Any]:
    """`{"from": report}` for a subcommand's `--json` object when `--from` was given."""
    report = getattr(args, REPORT, None)
    return {"from": report} if report is not None else {}
