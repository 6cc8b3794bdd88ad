"""`calibrate(measured, name)`: a device profile fitted to a step measured on the user's own GPU.

The input is a step `memplan.watch` measured on CUDA (`stepN.memtrace`): its metadata carries
PyTorch's `memory_stats()`, `mem_get_info()` at the watch's start and at the step's end, and
the device's name; its buffers are the tensors memplan's recorder saw. From those, the
constants of the device profile (`memplan.hardware.devices`) that the input measures
(docs/watch.md, "Calibration"):

- `capacity_bytes`: the device's total as `torch.cuda.mem_get_info()` reports it (the total
  PyTorch's out-of-memory messages name; what the driver keeps for itself is already outside it);
- `cuda_context_bytes`: device memory in use outside PyTorch's reserved memory when the watch
  started: the CUDA context and kernel images (and any other process on the device);
- `cublas_workspace_bytes`: PyTorch's peak allocated bytes minus the tensor bytes the trace
  holds at its peak after the caching allocator's rounding: the allocations no tensor of the
  step makes, which on a one-stream job is the cuBLAS workspace (allocated through the caching
  allocator, `CublasHandlePool.cpp`), plus anything else the process keeps allocated outside
  the watched model, optimizer and step;
- NCCL's channels (`nccl.channels`): where the job ran under `torch.distributed` (world size
  above 1), the growth of the memory outside PyTorch's reserved from the watch's start to the
  step's end, over 2 ring peers x `NCCL_BUFFSIZE` of the default process group.

What the input cannot measure keeps the base profile's value and is listed under `kept`:
throughput, bandwidths, the interconnect, `NCCL_BUFFSIZE`, and NCCL's channels on one GPU.
The profile is written under the user's cache directory (`memplan.hardware.devices.
save_local_profile`) and is then a `--gpu` name like the shipped ones.
"""

from __future__ import annotations

import copy
import os
from typing import Any

from memplan.errors import UserError
from memplan.estimation.pipeline import figures_full, replay_counters
from memplan.hardware.devices import (
    device_profile,
    profile_entry,
    profile_of_name,
    save_local_profile,
)
from memplan.trace.io import load

CALIBRATION_FORMAT = "memplan-calibration"
NOT_MEASURED = {
    "tflops": "throughput: the watch measures memory, not speed",
    "memory_bandwidth_gbs": "memory bandwidth: not measured by the watch",
    "interconnect": "the interconnect: not measured by the watch",
    "nccl.buffsize_bytes": "NCCL_BUFFSIZE: set by the environment, not measured",
}


def _base_key(meta: dict[str, Any], base: str | None) -> str:
    if base is not None:
        device_profile(base)  # an unknown name is a UserError
        return base
    found = profile_of_name(str(meta.get("gpu_name", "")))
    if found is None:
        raise UserError(f"no shipped profile is named like {meta.get('gpu_name')!r}: pass --base GPU "
                        "(see `memplan estimate --gpu list`) for the constants the step does not measure")
    return found.key


def measured_constants(trace: Any) -> tuple[dict[str, int], dict[str, str]]:
    """What the measured step gives (module docstring): the constants, and the reasons for those kept."""
    meta = trace.meta
    stats = meta["cuda_memory_stats"]
    out: dict[str, int] = {}
    kept = dict(NOT_MEASURED)
    if meta.get("device_total_bytes"):
        out["capacity_bytes"] = int(meta["device_total_bytes"])
    else:
        kept["capacity_bytes"] = "the step does not carry mem_get_info's total"
    if meta.get("context_bytes") is not None:
        out["cuda_context_bytes"] = int(meta["context_bytes"])
    else:
        kept["cuda_context_bytes"] = "the step does not carry the memory outside PyTorch's at the watch's start"
    tensors = figures_full(trace, replay_counters(trace, "caching", None)).peak_allocated_bytes
    workspace = int(stats["allocated_bytes.all.peak"]) - int(tensors)
    if workspace >= 0:
        out["cublas_workspace_bytes"] = workspace
    else:
        kept["cublas_workspace_bytes"] = (f"the step's tensors ({tensors} B) exceed PyTorch's peak allocated "
                                          f"({stats['allocated_bytes.all.peak']} B): not a step of one stream")
    growth = int(meta.get("outside_reserved_end_bytes", 0)) - int(meta.get("context_bytes") or 0)
    if int(meta.get("world_size", 1)) > 1 and growth > 0:
        out["nccl_bytes"] = growth
    else:
        kept["nccl.channels"] = "one GPU: no NCCL communicator was made"
    return out, kept


def calibrate(measured: str | os.PathLike, name: str, base: str | None = None) -> dict[str, Any]:
    """Fit the device constants to `measured` and store them as the local profile `name`."""
    trace = load(measured)
    meta = trace.meta
    if "cuda_memory_stats" not in meta:
        raise UserError(f"{measured} is not a step measured on CUDA by memplan.watch (no cuda_memory_stats): "
                        "calibrate from the stepN.memtrace a watched CUDA job writes")
    base_key = _base_key(meta, base)
    entry = copy.deepcopy(profile_entry(base_key))
    constants, kept = measured_constants(trace)
    for key in ("capacity_bytes", "cuda_context_bytes", "cublas_workspace_bytes"):
        if key in constants:
            entry[key] = constants[key]
    if "nccl_bytes" in constants:
        per_channel = 2 * int(entry["nccl"]["buffsize_bytes"])
        entry["nccl"]["channels"] = max(1, round(constants["nccl_bytes"] / per_channel))
    entry["name"] = f"{meta.get('gpu_name') or entry['name']} (calibrated: {name})"
    entry["source"] = f"memplan calibrate {os.path.basename(str(measured))}; unmeasured constants from {base_key}"
    entry["calibration"] = {"format": CALIBRATION_FORMAT, "measured_file": str(measured),
                            "gpu_name": meta.get("gpu_name"), "torch_version": meta.get("torch_version"),
                            "base": base_key, "measured": constants, "kept": kept}
    path = save_local_profile(name, entry)
    return {"gpu": name, "path": path, "base": base_key, "measured": constants, "kept": kept,
            "profile": device_profile(name).to_json()}
