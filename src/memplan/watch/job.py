"""What `memplan.watch` learns about the live job, and how it spells it as flags.

The model's identity, its training setup (as memplan's `TrainingSetup`) and the model's
config are read from the live objects and from the forward calls of the measured step by
`memplan.models.live` (field by field: docs/watch.md lists each); a `setup=` given to the
watch replaces all of it. `setup_flags` and `layout_flags` spell a setup and a layout as
`memplan estimate` flags, for the out-of-memory answer's commands.
"""

from __future__ import annotations

from memplan.models.fields import flags_of
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
    """`setup` as `memplan estimate` flags: every field that differs from its default, spelled
    as the declaration spells it (`memplan.models.fields`)."""
    return flags_of(setup)


def layout_flags(layout: Layout) -> list[str]:
    """`layout` as `memplan estimate` flags: every field that differs from its default
    (the world size always), spelled as the declaration spells it."""
    return flags_of(layout, always=("world_size",))
