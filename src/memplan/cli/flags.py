"""The job's command-line flags, derived from its declaration (`memplan.models.fields`).

`add_setup_flags` and `add_layout_flags` add one argparse group per section (model and
batch, precision, optimizer, ... parallelism, DeepSpeed) with each field's flag, type,
choices, default and help as `TrainingSetup`, `Layout` and `DeepSpeedConfig` declare them;
`setup_from_args` and `layout_from_args` build the objects back. No flag is spelled here:
`memplan.models.fields.flags_of(obj)` is the inverse (the flags that give `obj`), and
`as_flags` writes the fields library text names (an error, an assumption) as these flags.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from memplan.cli.from_file import add_model_input_flags
from memplan.errors import UserError
from memplan.models.fields import (
    SECTIONS,
    Declared,
    declared,
    flags_in_message,
    nested,
    split_names,
    whole_number,
)
from memplan.models.setup import TrainingSetup
from memplan.parallel.layout import Layout

# A declared field's kind -> the argparse `type` that reads its flag (choices are checked by argparse after it).
ARGPARSE_TYPES = {int: whole_number, float: float, str: str, tuple: split_names}


def add_job_flags(parser: argparse.ArgumentParser, cls: type, *, leave_out: tuple[str, ...] = (),
                  only: tuple[str, ...] | None = None) -> None:
    """One argparse group per section for the declared fields of `cls` (but `leave_out`;
    with `only`, those fields alone: a subcommand that takes a few of the job's fields)."""
    groups: dict[str, Any] = {}
    for field in declared(cls):
        if not field.option.cli or field.dotted in leave_out or (only is not None and field.dotted not in only):
            continue
        if field.section not in groups:
            groups[field.section] = parser.add_argument_group(SECTIONS[field.section])
        groups[field.section].add_argument(field.flag, **_argparse_options(field))


def _argparse_options(field: Declared) -> dict[str, Any]:
    """`add_argument`'s keywords for one declared field."""
    options: dict[str, Any] = {"dest": field.dest, "help": field_help(field).replace("%", "%%")}
    if field.kind is bool:
        options["action"] = "store_false" if field.default else "store_true"
        return options
    options["default"] = field.default
    options["type"] = ARGPARSE_TYPES[field.kind]
    if field.choices is not None and not field.option.class_checks:
        options["choices"] = field.choices
    if field.option.metavar or _long_choices(field):
        options["metavar"] = field.option.metavar or "NAME"
    elif field.option.class_checks:
        options["metavar"] = "{" + ",".join(map(str, field.choices or ())) + "}"
    if field.option.bare is not None:
        options.update(nargs="?", const=field.option.bare)
    return options


def field_help(field: Declared) -> str:
    """A field's help as --help and docs/cli.md show it: what it is, its choices where the
    flag's name does not show them, and its default."""
    if field.kind is bool:
        return f"turn off: {field.option.help} (on by default)" if field.default else field.option.help
    listed = f"; one of {', '.join(map(str, field.choices))}" if _long_choices(field) else ""
    return f"{field.option.help}{listed} (default {field.default_text()})"


def _long_choices(field: Declared) -> bool:
    """Whether a field's choices are too many to show as the flag's value `{a,b,c}`."""
    return field.choices is not None and len(",".join(map(str, field.choices))) > 50


def job_from_args(cls: type, args: argparse.Namespace, **given: Any) -> Any:
    """`cls` built from the parsed flags (a field whose flag the parser lacks keeps its
    default; `given` overrides)."""
    values: dict[str, Any] = {}
    inner: dict[str, dict[str, Any]] = {name: {} for name in nested(cls)}
    for field in declared(cls):
        value = getattr(args, field.dest, field.default)
        if len(field.path) == 1:
            values[field.name] = value
        else:
            inner[field.path[0]][field.name] = value
    values.update({name: nested(cls)[name](**fields) for name, fields in inner.items()})
    return cls(**{**values, **given})


def given_flags(cls: type, args: argparse.Namespace, *, leave_out: tuple[str, ...] = ()) -> list[str]:
    """The flags of `cls` given with other than their default values."""
    return [f.flag for f in declared(cls) if f.option.cli and f.dotted not in leave_out
            and getattr(args, f.dest, f.default) != f.default]


def add_setup_flags(parser: argparse.ArgumentParser, *, model_input: bool = True) -> None:
    """The training-setup flags of every subcommand that takes a model, and `--from`;
    `model_input=False` leaves out `--from` and `--trust-remote-code` (a subcommand that
    reads its own kind of configuration file)."""
    add_job_flags(parser, TrainingSetup)
    if model_input:
        add_model_input_flags(parser)


def add_layout_flags(parser: argparse.ArgumentParser, *, world_size: bool = True) -> None:
    """The layout flags; `world_size=False` leaves the world size out (`memplan fit` takes --gpus)."""
    add_job_flags(parser, Layout, leave_out=() if world_size else ("world_size",))


def setup_from_args(args: argparse.Namespace) -> TrainingSetup:
    """The `TrainingSetup` the flags describe (a routing refused for a model without experts)."""
    setup: TrainingSetup = job_from_args(TrainingSetup, args)
    if setup.routing != TrainingSetup().routing:
        _check_routing(getattr(args, "model", None))
    return setup


def _check_routing(spec: str | None) -> None:
    """`UserError` when a routing is given for a dense model."""
    from memplan.models.moe import experts_of
    from memplan.models.registry import load_config

    is_trace = spec is not None and Path(spec).is_file() and Path(spec).suffix != ".json"
    if spec is not None and not is_trace and experts_of(load_config(spec)) is None:
        raise UserError(f"`routing` describes how a mixture-of-experts model routes its tokens; {spec} has no "
                        "experts: leave `routing` out")


def layout_from_args(args: argparse.Namespace, world_size: int | None = None) -> Layout:
    """The layout the flags describe; `world_size` where the command takes it another way."""
    given = {"world_size": world_size} if world_size is not None else {}
    layout: Layout = job_from_args(Layout, args, **given)
    return layout


def as_flags(message: str) -> str:
    """Library text (an error, an assumption) with the fields it names written as their flags."""
    return flags_in_message(message, TrainingSetup, Layout)
