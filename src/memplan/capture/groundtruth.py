"""Ground truth for real CPU runs: torch.profiler's memory timeline and allocation events.

`profiler_peak_bytes(step_fn)` runs the step once under
`torch.profiler.profile(profile_memory=True, record_shapes=True, with_stack=True)`
and returns the peak of the total of `MemoryProfileTimeline` (every category,
pre-existing tensors included) on the device, which is what
`prof.export_memory_timeline` plots. memplan's captures are tested against it.

`events_peak_bytes(prof)` is the same peak read from the profiler's allocation events
alone, without torch's data-flow analysis (`DataFlowGraph`, torch/profiler/_memory_profiler.py
in torch 2.13), which refuses some real distributed runs ("version mismatch" in `DataFlowNode`,
"duplicate outputs" in `DataFlowGraph.validate`). c10's CPU allocator reports no free of a block
allocated before the profile started (c10/core/CPUAllocator.cpp,
`ProfiledCPUMemoryReporter::Delete`: "Memory block of unknown size was allocated before the
profiling started"), nor any allocation or free on a thread the profiler does not follow
(gloo's); the profiler's storage ids (torch/csrc/profiler/data_flow.cpp
`calculateUniqueTensorIDs`) give an address a new id only after a free there, so the next
allocation at the address of a block freed unseen gets that block's id, and the analysis finds
the allocation of a storage it has seen mutated. Lightning's DDP did this on every run: its
reducer rebuilds its buckets after the first step, freeing the flat bucket allocated before the
window, and an activation took its address. `report_every_cpu_free()`, called when the measured
process starts, has c10 report those frees of blocks from before the profile (the DDP run's
timeline then reads too); a block freed on gloo's thread stays unseen, and the analysis still
refuses some FSDP2 and DeepSpeed runs.

`events_peak_bytes` counts what the timeline counts: the storages alive before the profile
that it sees (an op's input, a module's parameter or gradient, an optimizer's state, or a
free with no allocation; sized as torch's `SizeMap` sizes them), then every allocation
and free on the device in time order, totalled per microsecond as the timeline coalesces
them (`held_peak_bytes`). One rule more: an allocation at an address whose block was never
seen freed means that block was freed first (an allocator never hands out an address still
held), and its bytes leave the total there; the timeline keeps the old block's bytes for the
new one, or fails as above. tests/capture/test_groundtruth_events.py and
tests/program/test_groundtruth_events.py show the two peaks equal to the byte wherever the
timeline reads the profile.

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


def report_every_cpu_free() -> None:
    """From now on, c10's CPU allocator keeps the size of every block it hands out, so that a
    profile reports the free of a block allocated before it started (on a thread the profiler
    follows) instead of dropping it ("Memory block of unknown size was allocated before the
    profiling started"): c10/core/CPUAllocator.cpp, `ProfiledCPUMemoryReporter::New` and
    `Delete` keep their table of sizes when the c10 flag `caffe2_report_cpu_memory_usage` is
    set or a profile records memory. The flag's own messages are at INFO, which c10 does not
    print by default. No Python binding sets c10 flags; the flag is libc10's exported global
    (`FLAGS_caffe2_report_cpu_memory_usage`). Call it first in a process measured from the
    middle of its run: blocks allocated before the call stay unknown."""
    import ctypes
    import os

    libc10 = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
    ctypes.c_bool.in_dll(libc10, "FLAGS_caffe2_report_cpu_memory_usage").value = True


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


def events_peak_bytes(prof: Any, device: str = "cpu") -> int:
    """Peak bytes of a stopped `memory_profiler()` from its allocation events (module docstring)."""
    from torch._C._profiler import _EventType

    events = sorted([(e.start_time_ns, e.extra_fields)
                     for e in _all_events(prof.profiler.kineto_results.experimental_event_tree())
                     if e.tag == _EventType.Allocation and e.extra_fields.device == torch.device(device)],
                    key=lambda pair: pair[0])
    held = _preexisting_blocks(prof, [fields for _t, fields in events], torch.device(device))
    return held_peak_bytes(held, [(t, fields.ptr, fields.alloc_size) for t, fields in events])


def c10_total_peak_bytes(prof: Any, device: str = "cpu") -> int:
    """Peak of c10's own running total of the device's allocated bytes over a stopped
    `memory_profiler()`: each allocation event's `total_allocated`
    (c10/core/CPUAllocator.cpp, `ProfiledCPUMemoryReporter::New`). Once
    `report_every_cpu_free()` has run, that total counts every block allocated since, and
    every free on every thread, the frees on gloo's thread included, which the events do not
    report: where a run frees blocks there (DeepSpeed ZeRO-3's gathers), `events_peak_bytes`
    keeps them until their address is reused and reads more, by a different amount from run
    to run; this total does not. It also counts blocks the profile never sees (made before
    the window and untouched in it), so it is the process's peak, equal to the events' when
    every storage alive at the window's start is shown to the profile (`whole_storages`)."""
    from torch._C._profiler import _EventType

    totals = [e.extra_fields.total_allocated
              for e in _all_events(prof.profiler.kineto_results.experimental_event_tree())
              if e.tag == _EventType.Allocation and e.extra_fields.device == torch.device(device)]
    return max(totals) if totals else 0


def held_peak_bytes(preexisting: dict[int, int], events: list[tuple[int, int, int]]) -> int:
    """Peak of the bytes held: `preexisting` (address -> bytes of each block alive at the start),
    then `events` (time in ns, address, bytes: > 0 an allocation, < 0 a free) in time order,
    totalled per microsecond as torch's memory timeline coalesces them. An allocation at an
    address still held replaces the block there (module docstring)."""
    held = dict(preexisting)
    total = peak = sum(held.values())
    microsecond = None
    for time_ns, address, size in events:
        if int(time_ns / 1000) != microsecond:  # the timeline's own rounding (float division)
            peak, microsecond = max(peak, total), int(time_ns / 1000)
        if size > 0:
            total += size - held.get(address, 0)
            held[address] = size
        else:
            total -= held.pop(address, 0)
    return max(peak, total)


def _preexisting_blocks(prof: Any, events: list[Any], device: torch.device) -> dict[int, int]:
    """Address -> bytes of each block on `device` alive when the profile started that the
    profile sees: a storage an op, module or optimizer shows it that no allocation event
    made, sized by torch's `SizeMap` as the timeline sizes it, or a block freed before any
    allocation at its address."""
    from torch.profiler._memory_profiler import OpTree, SizeMap

    allocated_ids = {e.allocation_id for e in events if e.alloc_size > 0}
    held = {key.storage.ptr: size for key, size in SizeMap(OpTree(prof.profiler.kineto_results))._values.items()
            if key.device == device and key.storage.allocation_id not in allocated_ids}
    allocated: set[int] = set()
    for fields in events:
        if fields.alloc_size > 0:
            allocated.add(fields.ptr)
        elif fields.ptr not in allocated and fields.ptr not in held:
            held[fields.ptr] = -fields.alloc_size
    return held


def timeline_peak_bytes(prof: Any, device: str = "cpu") -> int:
    """Peak of the total of the memory timeline of a stopped `memory_profiler()`."""
    from torch.profiler._memory_profiler import MemoryProfileTimeline

    timeline = MemoryProfileTimeline(prof._memory_profile())
    _times, sizes = timeline._coalesce_timeline(torch.device(device))
    totals = np.asarray(sizes, dtype=np.int64).sum(axis=1)
    return int(totals.max()) if totals.size else 0
