"""The one roofline: how long each op of a trace takes on a GPU profile.

An op takes max(FLOPs / peak matmul FLOP/s, bytes moved / memory bandwidth), as
PyTorch's `torch.distributed._tools.runtime_estimator.RuntimeEstimator` does in its
roofline mode (`_roofline_estimate`). Matmuls run in the autocast dtype when the step
autocasts, else in the parameters' dtype. Unknown FLOPs or bytes count as 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from memplan.hardware.devices import DeviceProfile
from memplan.models.setup import PRECISION_DTYPES
from memplan.trace.model import Trace


def matmul_dtype(setup: Mapping[str, Any] | Any) -> str:
    """The dtype a step's matmuls run in: its autocast dtype, else its parameters' dtype.

    `setup` is a `TrainingSetup` or its dict form (what a trace keeps in `meta["setup"]`,
    before precisions its `dtype` and `autocast`).
    """
    if not isinstance(setup, Mapping):
        return setup.autocast_dtype if setup.autocast_dtype != "none" else setup.dtype
    if "precision" in setup:
        dtype, autocast = PRECISION_DTYPES[setup["precision"]]
        autocast = setup.get("autocast") or autocast
    else:
        dtype, autocast = str(setup.get("dtype", "fp32")), str(setup.get("autocast", "none") or "none")
    return autocast if autocast != "none" else dtype


def op_seconds(trace: Trace, profile: DeviceProfile, dtype: str | None = None) -> np.ndarray:
    """Per-op seconds of `trace` on `profile`; `dtype` defaults to the trace's own setup's
    matmul dtype (`matmul_dtype(trace.meta["setup"])`, fp32 without a setup)."""
    if dtype is None:
        dtype = matmul_dtype(trace.meta.get("setup") or {})
    flops = np.nan_to_num(trace.ops["flops"].astype(np.float64), nan=0.0)
    moved = np.nan_to_num(trace.ops["bytes_moved"].astype(np.float64), nan=0.0)
    compute_s = flops / profile.matmul_flops_per_s(dtype)
    memory_s = moved / profile.memory_bandwidth_bytes_per_s
    return np.maximum(compute_s, memory_s)


def step_seconds(trace: Trace, profile: DeviceProfile, dtype: str | None = None) -> float:
    """The whole step's roofline time: the sum of `op_seconds`."""
    return float(op_seconds(trace, profile, dtype).sum())
