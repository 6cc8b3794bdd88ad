"""GPU device profiles, shipped as data (`devices.json` beside this module).

Each profile gives what the estimate and fit pipelines need about one GPU model:
memory capacity as PyTorch reports it, dense tensor-core throughput per dtype, memory
and interconnect bandwidth, and the memory that never passes through PyTorch's caching
allocator or that it holds on its own behalf (CUDA context, cuBLAS workspace, NCCL
buffers). Every figure carries its source in the JSON (`_sources` and each device's
`source`); they are vendor datasheet numbers and documented PyTorch/NCCL defaults,
not measurements made by memplan.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any

from memplan.errors import UserError


@dataclass(frozen=True)
class DeviceProfile:
    """One GPU model. Throughput in FLOP/s, bandwidths in bytes/s, sizes in bytes."""

    key: str
    name: str
    generation: str
    capacity_bytes: int
    flops_per_s: dict[str, float | None]
    memory_bandwidth_bytes_per_s: float
    interconnect: str
    interconnect_bytes_per_s: float
    pcie_bytes_per_s: float
    cuda_context_bytes: int
    cublas_workspace_bytes: int
    nccl_buffsize_bytes: int
    nccl_channels: int
    source: str

    def nccl_bytes(self, communicators: int) -> int:
        """NCCL buffers of `communicators` process groups: channels x 2 ring peers x buffsize each."""
        return int(communicators) * self.nccl_channels * 2 * self.nccl_buffsize_bytes

    def matmul_flops_per_s(self, dtype: str) -> float:
        """Dense throughput for `dtype` (fp32 jobs use the fp32 rate; no bf16 falls back to fp16)."""
        value = self.flops_per_s.get(dtype)
        if value is None:
            value = self.flops_per_s.get("fp16") if dtype == "bf16" else None
        if value is None:
            value = self.flops_per_s["fp32"]
        return float(value)

    def to_json(self) -> dict[str, Any]:
        return {
            "gpu": self.key,
            "name": self.name,
            "capacity_bytes": self.capacity_bytes,
            "cuda_context_bytes": self.cuda_context_bytes,
            "cublas_workspace_bytes": self.cublas_workspace_bytes,
        }


@lru_cache(maxsize=1)
def _raw() -> dict[str, Any]:
    text = (resources.files("memplan.hardware") / "devices.json").read_text(encoding="utf-8")
    return json.loads(text)


def list_devices() -> list[str]:
    """The `--gpu` names, sorted."""
    return sorted(_raw()["devices"])


def device_profile(key: str) -> DeviceProfile:
    """The profile of `--gpu key`; an unknown name is a `UserError` listing the known ones."""
    devices = _raw()["devices"]
    entry = devices.get(key) if isinstance(key, str) else None
    if entry is None:
        raise UserError(f"unknown GPU {key!r}: choose one of {', '.join(list_devices())}")
    tflops = entry["tflops"]
    return DeviceProfile(
        key=key,
        name=entry["name"],
        generation=entry["generation"],
        capacity_bytes=int(entry["capacity_bytes"]),
        flops_per_s={k: (None if v is None else float(v) * 1e12) for k, v in tflops.items()},
        memory_bandwidth_bytes_per_s=float(entry["memory_bandwidth_gbs"]) * 1e9,
        interconnect=entry["interconnect"],
        interconnect_bytes_per_s=float(entry["interconnect_gbs"]) * 1e9,
        pcie_bytes_per_s=float(entry["pcie_gbs"]) * 1e9,
        cuda_context_bytes=int(entry["cuda_context_bytes"]),
        cublas_workspace_bytes=int(entry["cublas_workspace_bytes"]),
        nccl_buffsize_bytes=int(entry["nccl"]["buffsize_bytes"]),
        nccl_channels=int(entry["nccl"]["channels"]),
        source=entry["source"],
    )
