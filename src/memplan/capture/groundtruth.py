"""Ground truth for real CPU runs: torch.profiler's memory timeline.

`profiler_peak_bytes(step_fn)` runs the step once under
`torch.profiler.profile(profile_memory=True, record_shapes=True, with_stack=True)`
and returns the peak of the total of `MemoryProfileTimeline` (every category,
pre-existing tensors included) on the device, which is what
`prof.export_memory_timeline` plots. memplan's captures are tested against it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch


def profiler_peak_bytes(step_fn: Callable[..., Any], *args: Any, device: str = "cpu", carried: Any = None,
                        **kwargs: Any) -> int:
    """Peak bytes of the profiler's memory timeline over one call of `step_fn`.

    `carried`: tensors (any nesting) alive before the call that no op of the step reads,
    such as the previous step's logits a training loop still holds until its next forward
    returns (`memplan.models.build.carried_between_steps`). The profiler learns a
    pre-existing storage's size only from an op that takes it ("Memory block of unknown
    size was allocated before the profiling started"), so each gets one view, which
    allocates nothing, at the start of the profile."""
    from torch.utils._pytree import tree_flatten

    with memory_profiler() as prof:
        for tensor in tree_flatten(carried)[0]:
            if isinstance(tensor, torch.Tensor):
                tensor.view_as(tensor)
        step_fn(*args, **kwargs)
    return timeline_peak_bytes(prof, device)


def memory_profiler() -> Any:
    """The profiler the ground truth runs under (not started): a context manager, or
    `start()` / `stop()` for a step that begins and ends in two different calls."""
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True)


def timeline_peak_bytes(prof: Any, device: str = "cpu") -> int:
    """Peak of the total of the memory timeline of a stopped `memory_profiler()`."""
    from torch.profiler._memory_profiler import MemoryProfileTimeline

    timeline = MemoryProfileTimeline(prof._memory_profile())
    _times, sizes = timeline._coalesce_timeline(torch.device(device))
    totals = np.asarray(sizes, dtype=np.int64).sum(axis=1)
    return int(totals.max()) if totals.size else 0
