"""`estimate_trace(trace, gpu=...)`: the peak memory of the step a trace recorded.

The single-device part of `memplan.estimation.pipeline.estimate`, applied to a trace
that already exists instead of one it captures:

1. a memplan capture of a CUDA job on fake tensors gets the GPU-only terms the capture
   cannot see (`pipeline.gpu_view`: SDPA kernel workspaces, cuBLAS workspace), sized
   from the model and setup its metadata names; a PyTorch memory snapshot of a real GPU
   already holds them and gets nothing;
2. each CUDA device the trace has buffers on becomes a rank's figures the way every
   estimate's does (`memplan.estimation.figures.rank_estimate`: the allocator simulator
   for peak allocated and reserved, within capacity x (1 - margin)), with the profile's
   CUDA context (or `cuda_context`) in device used.

A trace fixes the model, the setup and the parallel layout it was recorded under: to
estimate another one, capture it (`memplan.estimation.estimate` takes the model).
A trace of a CPU job is refused: its code paths (optimizer kernels, attention) are the
CPU's, not a GPU's.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np

from memplan import models
from memplan.capture.step import StepTrace
from memplan.errors import UserError
from memplan.estimation.figures import (
    DEFAULT_MARGIN,
    check_margin,
    host_figures,
    rank_estimate,
    usable_bytes_of,
)
from memplan.estimation.pipeline import Estimate, check_options, gpu_view
from memplan.hardware.devices import device_profile
from memplan.parallel.layout import Layout
from memplan.trace import edit as trace_edit
from memplan.trace.model import Trace


def estimate_trace(
    trace: Trace,
    gpu: str | None = None,
    capacity: int | None = None,
    allocator: str = "caching",
    alloc_conf: str | None = None,
    *,
    cuda_context: int | None = None,
    name: str | None = None,
    margin: float = DEFAULT_MARGIN,
) -> Estimate:
    """Peak allocated, reserved and device used of `trace`'s step, one `RankEstimate`
    per CUDA device it has buffers on (`rank` is the device index).

    `gpu` names a device profile (capacity, CUDA context, cuBLAS workspace);
    `capacity` overrides its capacity; `cuda_context` (bytes) its CUDA context.
    `allocator`: caching, expandable, planned or none (tensor bytes only). `name`
    labels the result when the trace's metadata names no model (a snapshot). `margin`:
    the share of the capacity kept free (`memplan.estimation.figures`).
    """
    start = time.perf_counter()
    check_options("cuda", allocator, alloc_conf, cuda_context)
    margin = check_margin(margin)
    profile = device_profile(gpu) if gpu is not None else None
    if capacity is None and profile is not None:
        capacity = profile.capacity_bytes
    meta = trace.meta
    device = meta.get("device", "cuda")
    if device != "cuda" or not any(d.startswith("cuda") for d in trace.devices):
        raise UserError(f"{name or 'the trace'} records a {device} job: estimate a GPU from a trace captured for "
                        "cuda, or pass the model with --device cpu")
    if profile is not None:
        # a real GPU's snapshot already holds its kernels' buffers: memplan adds no SDPA term
        attn = (meta.get("setup") or {}).get("attn", "sdpa") if meta.get("fake") else None
        refused = profile.unmodelled(attn=attn, world_size=1, context_override=cuda_context)
        if refused is not None:
            raise UserError(refused)
    view = _with_gpu_terms(trace, profile) if meta.get("fake") else trace
    context = profile.context_bytes(cuda_context) if profile is not None else 0
    if cuda_context is not None:
        context = cuda_context
    per_device = [rank_estimate(_one_device(view, index) if len(view.devices) > 1 else view, rank=index,
                                allocator=allocator, alloc_conf=alloc_conf, overhead_bytes=context,
                                usable_bytes=usable_bytes_of(capacity, margin), host=host_figures(view))
                  for index in _cuda_devices(view)]
    return Estimate(
        model=str(meta.get("model") or name or "trace"), parameters=int(meta.get("parameters", 0)),
        setup=dict(meta.get("setup") or {}), layout=Layout().to_dict(), per_rank=per_device,
        capacity_bytes=capacity, device="cuda", allocator=allocator, gpu=gpu, method="trace",
        elapsed_s=time.perf_counter() - start, routing=meta.get("routing"), margin=margin,
    )


def _cuda_devices(trace: Trace) -> list[int]:
    """Indices of the CUDA devices `trace` has buffers on (the first CUDA device if none)."""
    used = np.unique(trace.buffers["device"]).tolist() if trace.num_buffers else []
    cuda = [i for i in used if trace.devices[i].startswith("cuda")]
    return cuda or [next(i for i, d in enumerate(trace.devices) if d.startswith("cuda"))]


def _one_device(trace: Trace, index: int) -> Trace:
    """`trace` as device `index` sees it: every other device's buffers get zero bytes
    (`memplan.trace.edit.device_view`) and that device's index, so that the allocator
    simulator, which serves one device, replays it."""
    view = trace_edit.device_view(trace, trace.devices[index])
    buffers = {**view.buffers, "device": np.full_like(view.buffers["device"], index)}
    return dataclasses.replace(view, buffers=buffers)


def _with_gpu_terms(trace: Trace, profile: Any) -> Trace:
    """A fake capture's trace plus the GPU-only buffers `pipeline.gpu_view` adds, sized
    from the model and setup named in its metadata (as `memplan.capture.step.capture_step` does)."""
    spec = trace.meta.get("model")
    try:
        config = models.load_config(spec)
    except UserError as exc:
        raise UserError(f"the trace's model {spec!r} cannot be found here ({exc}); memplan needs it to size the "
                        "GPU kernels' workspaces: pass the model instead of the trace") from None
    setup = models.TrainingSetup.from_dict(trace.meta.get("setup") or {})
    step = StepTrace.of_model(trace, config, setup, blocks_path="", parameters=int(trace.meta.get("parameters", 0)),
                              layers=0)
    return gpu_view(step, setup, profile)
