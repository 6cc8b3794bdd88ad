"""The one declaration of a job's fields, and what is derived from it.

Each field of `TrainingSetup`, `Layout` and `DeepSpeedConfig` is declared once, on the
dataclass itself, by `option(...)`: its type (a `Literal` names its choices), its default,
its help, its section and, where it is not `--name-with-dashes`, its flag. Everything that
spells a job is derived from that declaration: the command-line flags and their `--help`
(`memplan.cli.flags`), docs/cli.md (`memplan.cli.reference`), the watch's spelling of a job
as flags (`memplan.watch.job`), the fields a trainer's file may set (`memplan.trainers`),
and the flags the CLI prints where a library error names a field (`flags_in_message`).

The shape follows torchtitan's `JobConfig` (torchtitan/config/job_config.py at commit
6404b93: one dataclass per section, each field with its type, default and help, from which
its `ConfigManager` derives the command line). Here the sections are a field's attribute,
not nested classes, so that the hundreds of reads of a setup stay flat (`setup.dtype`);
only `Layout.deepspeed` nests, a `DeepSpeedConfig` whose fields keep their `--ds-*` flags.

Assumes: a declared field's type is built from `int`, `float`, `bool`, `str`, `Literal[...]`,
`tuple[str, ...]` and `None`, or is a declared dataclass (a nested section). Library errors
name fields in backquotes (`` `lora_rank` must be ...``, `` add `zero=3` ``); the CLI prints
them as flags (`flags_in_message`), so that Python callers read the names they pass.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, cast, get_args, get_origin

from memplan.errors import UserError

METADATA_KEY = "memplan"

# Section -> its title in --help and docs/cli.md, in the order they are shown.
SECTIONS = {
    "model": "model and batch",
    "precision": "precision",
    "optimizer": "optimizer",
    "activations": "activations and compilation",
    "adapters": "adapters and quantisation",
    "loss": "loss",
    "parallelism": "parallelism",
    "deepspeed": "DeepSpeed ZeRO (with engine deepspeed; sizes in elements)",
}


@dataclass(frozen=True)
class Option:
    """How one field is spelled and explained (`option` makes the dataclass field)."""

    help: str
    section: str
    flag: str = ""  # the flag when it is not --name-with-dashes (or --no-name for a True default)
    metavar: str = ""
    bare: Any = None  # the value of the flag given without one (an optional value); None: a value is required
    default_text: str = ""  # how the help states a default the value alone does not explain
    cli: bool = True  # False: a field no flag sets (the seed of real-tensor weights)
    class_checks: bool = False  # the class, not the parser, refuses a value outside the choices (with a hint)


def option(default: Any = dataclasses.MISSING, help: str = "", section: str = "", *,
           factory: Any = dataclasses.MISSING, **spelling: Any) -> Any:
    """A dataclass field declared with its help, section and spelling (`Option`)."""
    if section not in SECTIONS:
        raise ValueError(f"unknown section {section!r}: one of {', '.join(SECTIONS)}")
    meta = {METADATA_KEY: Option(help, section, **spelling)}
    if factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclass(frozen=True)
class Declared:
    """One declared field, resolved: its type, choices, default and spelling."""

    name: str
    path: tuple[str, ...]  # attribute names from the root object (("deepspeed", "overlap_comm"))
    kind: type  # int, float, str, bool or tuple
    choices: tuple[Any, ...] | None  # a Literal's values
    optional: bool  # None is allowed (and, as a default, means "not given")
    default: Any
    option: Option

    @property
    def dotted(self) -> str:
        """The field as a library error names it: `lora_rank`, `deepspeed.overlap_comm`."""
        return ".".join(self.path)

    @property
    def flag(self) -> str:
        if self.option.flag:
            return self.option.flag
        negated = self.kind is bool and self.default is True
        return ("--no-" if negated else "--") + self.name.replace("_", "-")

    @property
    def dest(self) -> str:
        """The attribute argparse stores the flag's value under."""
        return "_".join(self.path) if len(self.path) == 1 else self.flag.removeprefix("--").replace("-", "_")

    @property
    def section(self) -> str:
        return self.option.section

    def parse(self, text: str) -> Any:
        """A flag's text as the field's value (`UserError` for text that is none of its values)."""
        if self.kind is tuple:
            return split_names(text)
        if self.choices is not None:
            value = next((c for c in self.choices if str(c) == text), None)
            if value is None:
                raise UserError(f"`{self.dotted}` must be one of {', '.join(map(str, self.choices))}, not {text!r}")
            return value
        if self.kind is int:
            return whole_number(text)
        if self.kind is float:
            return float(text)
        return text

    def format(self, value: Any) -> str:
        """The field's value as its flag takes it (the inverse of `parse`)."""
        if isinstance(value, (tuple, list)):
            return ",".join(value)
        if isinstance(value, float):
            return f"{value:g}"
        return str(value)

    def argv(self, value: Any) -> list[str]:
        """The flag (and its value) that gives `value`."""
        if self.kind is bool:
            if value == self.default:
                return []
            return [self.flag]
        return [self.flag, self.format(value)]

    def default_text(self) -> str:
        """The default as --help states it."""
        if self.option.default_text:
            return self.option.default_text
        if self.kind is bool:
            return "on" if self.default else "off"
        return "not set" if self.default is None else self.format(self.default)


def whole_number(text: str) -> int:
    """`1024`, `5e8` or `500_000_000` as an int (a ValueError for anything else)."""
    try:
        return int(text)
    except ValueError:
        value = float(text)
        if not value.is_integer():
            raise
        return int(value)


whole_number.__name__ = "int"  # argparse names the type in "invalid int value: 'x'"


def split_names(text: str) -> tuple[str, ...]:
    """`q_proj, v_proj` -> ("q_proj", "v_proj")."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _kind(hint: Any) -> tuple[type, tuple[Any, ...] | None, bool]:
    """(the base type, a Literal's choices, whether None is allowed) of a field's type."""
    args = get_args(hint)
    optional = False
    if get_origin(hint) in (typing.Union, types.UnionType):
        optional = type(None) in args
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1:
            raise TypeError(f"a declared field has one type besides None, not {hint}")
        hint, args = rest[0], get_args(rest[0])
    if get_origin(hint) is Literal:
        return type(args[0]), tuple(args), optional
    if get_origin(hint) is tuple:
        return tuple, None, optional
    if hint in (int, float, bool, str):
        return hint, None, optional
    raise TypeError(f"a declared field is int, float, bool, str, a Literal or tuple[str, ...], not {hint}")


@functools.cache
def declared(cls: type) -> tuple[Declared, ...]:
    """Every declared field of `cls`, nested sections included, in declaration order."""
    return _declared(cls, ())


def _declared(cls: type, prefix: tuple[str, ...]) -> tuple[Declared, ...]:
    hints = typing.get_type_hints(cls)
    out: list[Declared] = []
    for f in dataclasses.fields(cls):
        meta = f.metadata.get(METADATA_KEY)
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            out += _declared(hint, (*prefix, f.name))
            continue
        if meta is None:
            continue
        kind, choices, optional = _kind(hint)
        factory = cast(Callable[[], Any], f.default_factory)
        default = f.default if f.default is not dataclasses.MISSING else factory()
        out.append(Declared(f.name, (*prefix, f.name), kind, choices, optional, default, meta))
    return tuple(out)


def nested(cls: type) -> dict[str, type]:
    """The nested sections of `cls`: field name -> its declared dataclass."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if dataclasses.is_dataclass(hints[f.name])}


def value_at(obj: Any, field: Declared) -> Any:
    for name in field.path:
        obj = getattr(obj, name)
    return obj


def flags_of(obj: Any, *, always: tuple[str, ...] = ()) -> list[str]:
    """The flags that give `obj`: each declared field whose value is not its default (and
    the fields named in `always`), as the CLI's parser of the same declaration reads them."""
    argv: list[str] = []
    for field in declared(type(obj)):
        value = value_at(obj, field)
        if not field.option.cli or (value == field.default and field.dotted not in always):
            continue
        argv += field.argv(value)
    return argv


def check_choices(obj: Any) -> None:
    """`UserError` for a field outside its `Literal` choices (nested sections included)."""
    for field in declared(type(obj)):
        value = value_at(obj, field)
        if field.choices is None or value in field.choices or (value is None and field.optional):
            continue
        raise UserError(f"`{field.dotted}` must be one of {', '.join(map(str, field.choices))}, not {value!r}")


def choices(cls: type, name: str) -> tuple[Any, ...]:
    """The choices of `cls`'s field `name` (dotted for a nested one)."""
    found = next(f for f in declared(cls) if f.dotted == name)
    assert found.choices is not None, f"{name} is not a Literal"
    return found.choices


def flags_by_name(*classes: type) -> dict[str, Declared]:
    """Dotted field name -> its declaration, over `classes` (the names a library error uses)."""
    return {f.dotted: f for cls in classes for f in declared(cls)}


FIELD_IN_MESSAGE = re.compile(r"`([a-z_][a-z0-9_.]*)(?:=([^`]*))?`")


def flags_in_message(message: str, *classes: type) -> str:
    """`message` with each backquoted field of `classes` written as its flag:
    `` `lora_rank` `` -> `--lora-rank`, `` `zero=3` `` -> `--zero 3`, `` `frozen_base=True` ``
    -> `--frozen-base`. Backquoted names that are no field are left as they are."""
    names = flags_by_name(*classes)

    def spelled(match: re.Match[str]) -> str:
        field = names.get(match.group(1))
        if field is None or not field.option.cli:
            return match.group(0)
        value = match.group(2)
        if value is None:
            return field.flag
        if field.kind is bool:
            return field.flag
        return f"{field.flag} {value}"

    return FIELD_IN_MESSAGE.sub(spelled, message)
