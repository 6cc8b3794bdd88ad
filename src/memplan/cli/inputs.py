"""What a subcommand's MODEL argument is: a model to trace, or a trace already taken.

A trace is an existing file that is a `.memtrace` (a zip archive), a pickle (a PyTorch
memory snapshot) or named like one; anything else is a model spec (a registry name,
a config.json path, `package.module:factory` or a Hub id `org/name`, resolved by
`memplan.models.load_config`; `--trust-remote-code` lets it run a repository's code). A trace
fixes the model, the training setup and the parallel layout it was recorded under, so
flags asking for another setup or layout are refused rather than ignored.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from memplan.cli.flags import layout_from_args, setup_from_args
from memplan.errors import UserError
from memplan.models.setup import TrainingSetup
from memplan.parallel.layout import Layout

if TYPE_CHECKING:  # imported where they are used: parsing the command line needs none of them
    from transformers import PretrainedConfig

    from memplan.models.registry import FactorySpec
    from memplan.trace.model import Trace

TRACE_SUFFIXES = (".memtrace", ".pickle", ".pkl")


def trace_path(spec: str) -> Path | None:
    """`spec` as a path when it names a trace file, else None (a model spec)."""
    path = Path(spec).expanduser()
    if not path.is_file() or path.suffix == ".json":
        return None
    from memplan.trace.io import file_kind

    try:
        kind = file_kind(path)
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror or exc}") from None
    return path if kind is not None or path.suffix in TRACE_SUFFIXES else None


def model_arg(args: argparse.Namespace) -> str | PretrainedConfig | FactorySpec:
    """The MODEL to hand the library: the spec as typed, or, with `--trust-remote-code`,
    the config loaded with the repository's own code (the library never runs remote code
    unless asked: a spec string is resolved with `trust_remote_code=False`)."""
    if getattr(args, "trust_remote_code", False):
        from memplan.models.registry import load_config

        return load_config(args.model, trust_remote_code=True)
    return args.model


def refuse_trace(spec: str, command: str, why: str) -> None:
    """UserError when `spec` is a trace file and `command` needs the model itself."""
    if trace_path(spec) is not None:
        raise UserError(f"{spec} is a trace; memplan {command} {why}: pass the model (a registry name, "
                        "a config.json path or package.module:factory) instead")


def refuse_retracing(spec: str, trace: Trace, args: argparse.Namespace, *, layout_flags: bool = False) -> None:
    """UserError (one line) when the setup flags (and, with `layout_flags`, the parallel
    layout flags) ask for a step other than the one `trace` recorded.

    A setup flag counts as asked for when its value differs from the flag's default; it
    is refused unless it equals the setup in the trace's metadata.
    """
    recorded = trace.meta.get("setup")
    defaults = TrainingSetup().to_dict()  # what the setup flags give when none is typed
    for key, value in setup_from_args(args).to_dict().items():
        if value == defaults.get(key) or (isinstance(recorded, dict) and recorded.get(key) == value):
            continue
        had = f"the trace has {recorded.get(key)}" if isinstance(recorded, dict) else "the trace records no setup"
        raise UserError(f"{spec} is a trace: it cannot be re-traced under another setup (`{key}={value}`; "
                        f"{had}): pass the model instead of the trace")
    if layout_flags and layout_from_args(args).to_dict() != Layout().to_dict():
        raise UserError(f"{spec} is a trace of one device: it cannot be re-traced under another parallel layout "
                        "(`world_size`, `zero`, `tp`, `pp`, `cp`): pass the model instead of the trace")
