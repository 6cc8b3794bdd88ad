"""What `memplan.watch` learns about the live job, and how it spells it as flags.

The model's identity, its training setup (as memplan's `TrainingSetup`) and the model's
config are read from the live objects and from the forward calls of the measured step by
`memplan.models.live` (field by field: docs/watch.md lists each); a `setup=` given to the
watch replaces all of it. `setup_flags` and `layout_flags` spell a setup and a layout as
`memplan estimate` flags, for the out-of-memory answer's commands.
"""

from __future__ import annotations

import dataclasses

from memplan.models.live import (  # noqa: F401 - the watch's names for them
    DTYPE_NAMES,
    OPTIMIZER_NAMES,
    infer_setup,
    model_config,
    model_identity,
)
from memplan.models.setup import TrainingSetup
from memplan.parallel.layout import Layout


def setup_flags(setup: TrainingSetup) -> list[str]:
    """`setup` as `memplan estimate` flags: every field that differs from the default, named
    as `memplan.cli.setup_flags` names them (`--field-name`)."""
    default = TrainingSetup()
    flags = []
    for field in dataclasses.fields(TrainingSetup):
        value, base = getattr(setup, field.name), getattr(default, field.name)
        if value == base or field.name in ("seed", "allow_long_seq"):
            continue
        flag = "--" + field.name.replace("_", "-")
        if field.name == "kbit_prep":
            flags.append("--no-kbit-prep")
        elif value is True:
            flags.append(flag)
        elif isinstance(value, tuple):
            flags += [flag, ",".join(value)]
        else:
            flags += [flag, str(value)]
    return flags


def layout_flags(layout: Layout) -> list[str]:
    """`layout` as `memplan estimate` flags: every field given that differs from the default
    (`--world-size` always), named as `memplan.cli.layout_flags` names them."""
    default = Layout()
    flags = ["--world-size", str(layout.world_size)]
    for field in dataclasses.fields(Layout):
        value = getattr(layout, field.name)
        if field.name == "world_size" or value == getattr(default, field.name):
            continue
        flag = "--" + field.name.replace("_", "-")
        flags += [flag] if value is True else [flag, str(value)]
    return flags
