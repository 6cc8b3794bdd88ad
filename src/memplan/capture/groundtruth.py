"""Ground truth for real CPU runs: torch.profiler's memory timeline.

`profiler_peak_bytes(step_fn)` runs the step once under
`torch.profiler.profile(profile_memory=True, record_shapes=True, with_stack=True)`
and returns the peak of the total of `MemoryProfileTimeline` (every category,
pre-existing tensors included) on the device, which is what
`prof.export_memory_timeline` plots. memplan's captures are tested against it.

`transient_bytes(fn)` measures, from the same profiler's allocation events, how much
more than what it returns one call of `fn` holds at its peak: memory a kernel takes
for itself (copies, scratch buffers) and gives back before it returns. Every
allocation through c10's CPU allocator is an event, a tensor's storage or not.
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


def transient_bytes(fn: Callable[[], Any]) -> int:
    """Peak bytes one call of `fn` holds beyond what it still holds when it returns.

    `fn` runs once unprofiled (first-call set-up is not a step's cost), then once under
    the profiler with memory events on. The events, in time order, give the bytes held
    after each; the answer is their maximum minus the bytes still held at the end (the
    call's outputs), or 0. Make `fn`'s inputs before calling: their storages are not
    the call's."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    fn()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()  # held past the profile's end: the outputs are what the call returns
    del out
    events = [e for e in _all_events(prof.profiler.kineto_results.experimental_event_tree())
              if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu"]
    held = np.cumsum([e.extra_fields.alloc_size for e in sorted(events, key=lambda e: e.start_time_ns)])
    return int(held.max() - held[-1]) if held.size else 0


def _all_events(roots: list[Any]) -> list[Any]:
    """Every node of the profiler's event tree under `roots`."""
    out, stack = [], list(roots)
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children)
    return out


def timeline_peak_bytes(prof: Any, device: str = "cpu") -> int:
    """Peak of the total of the memory timeline of a stopped `memory_profiler()`."""
    from torch.profiler._memory_profiler import MemoryProfileTimeline

    timeline = MemoryProfileTimeline(prof._memory_profile())
    _times, sizes = timeline._coalesce_timeline(torch.device(device))
    totals = np.asarray(sizes, dtype=np.int64).sum(axis=1)
    return int(totals.max()) if totals.size else 0
