"""memplan's estimate of the live job's step, made in the same process as the measurement.

The step runs on fake copies of the live model and optimizer (`memplan.watch.fake.faked`)
under `memplan.capture.capture`, so what is traced is the job's own code; the trace then
becomes an estimate the way every trace does (`memplan.estimation.figures.rank_estimate`),
for the job's device: on cpu, the live tensor bytes (`allocator="none"`, what
torch.profiler's memory timeline shows); on cuda, the cuBLAS workspace the capture cannot
see, PyTorch's caching allocator replayed for allocated and reserved, and the CUDA context
of the device profile (or the one measured by `memplan calibrate`) for device used.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from memplan.capture import capture
from memplan.estimation.figures import DEFAULT_MARGIN, rank_estimate, usable_bytes_of
from memplan.estimation.pipeline import DEFAULT_CUBLAS_WORKSPACE_BYTES, Estimate
from memplan.hardware.devices import DeviceProfile
from memplan.parallel.layout import Layout
from memplan.trace import edit as trace_edit
from memplan.trace.model import Trace
from memplan.watch.fake import faked


def trace_fake_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, mode: FakeTensorMode,
                    step: Callable[[], Any], meta: dict[str, Any]) -> Trace:
    """The trace of `step` run on fake copies of `model` and `optimizer` (see the module docstring)."""
    with faked(model, optimizer, mode), mode:
        return capture(step, model=model, optimizer=optimizer, meta={**meta, "fake": True})


def estimate_of_trace(trace: Trace, *, device: str, setup: dict[str, Any], model: dict[str, Any],
                      capacity_bytes: int | None, profile: DeviceProfile | None,
                      context_bytes: int | None, elapsed_s: float, margin: float = DEFAULT_MARGIN) -> Estimate:
    """The estimate of a step trace for `device` (module docstring); `context_bytes`
    replaces the profile's CUDA context; `margin` is the share of the capacity kept free."""
    start = time.perf_counter()
    if device == "cuda":
        workspace = profile.cublas_workspace_bytes if profile is not None else DEFAULT_CUBLAS_WORKSPACE_BYTES
        view = trace_edit.with_extra_buffers(trace, trace_edit.workspace_buffer(trace, workspace))
        if context_bytes is None:
            context_bytes = profile.context_bytes() if profile is not None else 0
        allocator = "caching"
    else:
        view, context_bytes, allocator = trace, 0, "none"
    rank = rank_estimate(view, rank=0, allocator=allocator, alloc_conf=None, overhead_bytes=context_bytes,
                         usable_bytes=usable_bytes_of(capacity_bytes, margin))
    return Estimate(
        model=str(model.get("name", "model")), parameters=int(model.get("parameters", 0)), setup=setup,
        layout=Layout().to_dict(), per_rank=[rank], capacity_bytes=capacity_bytes, device=device,
        allocator=allocator, gpu=profile.key if profile is not None else None, method="watch",
        elapsed_s=elapsed_s + time.perf_counter() - start,
        flops=float(np.nansum(trace.ops["flops"])) if trace.num_ops else 0.0, margin=margin,
    )

