"""Measured peak tensor memory of one real training step, robust to offloading.

Used to check the offload runtime against its budget in a real run (tests/offload,
benchmarks/bench_offload_runtime.py). Method: the
bytes resident when the step starts plus the highest running sum of the allocation
records of `torch.profiler` (`profile_memory=True`) during it, in time order.

Assumption: what is resident at the start is the parameters, their gradients and the
optimizer states (the input batch, a few KiB, is not counted).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile


def step_peak_bytes(step: Any) -> int:
    """Peak tensor bytes over one step: what is resident when it starts (parameters, gradients and
    optimizer states, by storage size: an offloaded one has none) plus the highest running sum of
    the allocations and frees the profiler records during it.

    The profiler's `MemoryProfileTimeline` (torch/profiler/_memory_profiler.py; `capture.groundtruth.profiler_peak_bytes`) cannot be
    used for an offloaded step: its data-flow pass asserts on storages that are released and refilled in place. On a
    step without offloading both measures agree to the bytes of the input batch.
    """
    tensors = [p for p in step.model.parameters()] + [p.grad for p in step.model.parameters() if p.grad is not None]
    tensors += [t for state in step.optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    resident = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step.run()
    allocations = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        if event.typed[0] == _EventType.Allocation:
            allocations.append((event.start_time_ns, event.typed[1].alloc_size))
        stack.extend(event.children)
    allocations.sort()
    running = np.cumsum([nbytes for _, nbytes in allocations]) if allocations else np.zeros(1)
    return int(resident + max(int(running.max()), 0))
