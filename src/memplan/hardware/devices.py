"""GPU device profiles, shipped as data (`devices.json` beside this module).

Each profile gives what the estimate and fit pipelines need about one GPU model:
memory capacity as PyTorch reports it, dense tensor-core throughput per dtype, memory
and interconnect bandwidth, how many GPUs one NVLink domain joins (where `memplan fit`
searches tensor parallelism), and the memory that never passes through PyTorch's caching
allocator or that it holds on its own behalf (CUDA context, cuBLAS workspace, NCCL
buffers). Every figure carries its source in the JSON (`_sources` and each device's
`source`); they are vendor datasheet numbers and documented PyTorch/NCCL defaults,
not measurements made by memplan.

A profile's `platform` is the PyTorch build that runs on it: `cuda`, or `rocm` (AMD
Instinct). ROCm's PyTorch is the same caching allocator (`c10/cuda/CUDACachingAllocator.cpp`
hipified), with its own BLAS workspace (hipBLASLt's, in the profile) and its own SDPA
kernels, HIP context and RCCL buffers, which memplan does not model:
`DeviceProfile.unmodelled` names what a job asks that the profile cannot answer.

Local profiles. `memplan calibrate` writes a profile measured on the user's own device
(`save_local_profile`) as one JSON file, `<cache>/devices/<name>.json`, in the shipped
entry format plus what was measured; `<cache>` is `$MEMPLAN_CACHE`, else
`$XDG_CACHE_HOME/memplan`, else `~/.cache/memplan` (the XDG Base Directory specification's
default). Local profiles are read on every lookup, listed by `memplan estimate --gpu list`
beside the shipped ones and named by `--gpu` like them; a local name never shadows a
shipped one (`save_local_profile` refuses it).
"""

from __future__ import annotations

import difflib
import json
import os
import re
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any

from memplan.errors import UserError

# How far a device's total memory may be from its profile's capacity and still be that
# product: a capacity is PyTorch's total where public, else nvidia-smi's, which is 0.5-0.7 GiB
# (under 1%) more (devices.json, `capacity_source`); a MIG slice has a fraction of it.
DEVICE_CAPACITY_TOLERANCE = 0.02


@dataclass(frozen=True)
class DeviceProfile:
    """One GPU model. Throughput in FLOP/s, bandwidths in bytes/s, sizes in bytes."""

    key: str
    name: str
    generation: str
    platform: str  # "cuda" or "rocm"
    capacity_bytes: int
    flops_per_s: dict[str, float | None]
    memory_bandwidth_bytes_per_s: float
    interconnect: str
    interconnect_bytes_per_s: float
    pcie_bytes_per_s: float
    cuda_context_bytes: int | None  # None: no public measurement (the HIP context on ROCm)
    cublas_workspace_bytes: int  # the BLAS workspace: cuBLAS's on CUDA, hipBLASLt's on ROCm
    nccl_buffsize_bytes: int
    nccl_channels: int | None  # None: the collective library's buffers are not modelled (RCCL)
    source: str
    capacity_source: str = ""
    nvlink_gpus: int = 1  # GPUs one NVLink domain joins (devices.json `_sources`); tensor parallelism stays within it
    nvlink_source: str = ""

    def nccl_bytes(self, communicators: int) -> int:
        """NCCL buffers of `communicators` process groups: channels x 2 ring peers x buffsize each."""
        if communicators and self.nccl_channels is None:
            raise UserError(f"the collective buffers of {self.name} are not modelled: estimate one GPU")
        return int(communicators) * (self.nccl_channels or 0) * 2 * self.nccl_buffsize_bytes

    def context_bytes(self, override: int | None = None) -> int:
        """The device context (CUDA or HIP) in device-used memory: `override` when given,
        else the profile's; `UserError` where the profile has none."""
        if override is not None:
            return int(override)
        if self.cuda_context_bytes is None:
            raise UserError(self._no_context_message())
        return self.cuda_context_bytes

    def _no_context_message(self) -> str:
        return (f"the {'HIP' if self.platform == 'rocm' else 'CUDA'} context of {self.name} has no public "
                "measurement memplan could use: measure the memory a process holds after torch.cuda.init() "
                "(amd-smi or rocm-smi) and pass --cuda-context SIZE")

    def unmodelled(self, *, attn: str | None, world_size: int, context_override: int | None) -> str | None:
        """One line naming what a job on this device asks that memplan does not model, or None.
        `attn` is the setup's attention (None: no SDPA term is added, as for a real GPU's snapshot).

        On ROCm: SDPA runs AOTriton / Composable Kernel flash attention, whose workspaces
        are not the CUDA kernels' (`memplan.trace.edit.attention_kernel_buffers`); RCCL's
        buffers are not NCCL's; the HIP context has no public figure.
        """
        rocm = self.platform == "rocm"
        if rocm and attn not in (None, "eager"):
            return (f"on {self.name} SDPA runs ROCm's own kernels (AOTriton / Composable Kernel flash "
                    "attention), whose workspaces memplan does not model: use `attn=eager`")
        if rocm and world_size > 1:
            return (f"RCCL's buffers on {self.name} are not modelled (its channels are not NCCL's): "
                    "estimate one GPU (`world_size=1`)")
        if self.cuda_context_bytes is None and context_override is None:
            return self._no_context_message()
        return None

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
            "platform": self.platform,
            "capacity_bytes": self.capacity_bytes,
            "cuda_context_bytes": self.cuda_context_bytes,
            "cublas_workspace_bytes": self.cublas_workspace_bytes,
        }

    def listing(self) -> dict[str, Any]:
        """What `memplan estimate --gpu list` shows of the profile (TFLOP/s dense)."""
        return {
            "gpu": self.key,
            "name": self.name,
            "platform": self.platform,
            "capacity_bytes": self.capacity_bytes,
            "memory_bandwidth_gbs": self.memory_bandwidth_bytes_per_s / 1e9,
            "tflops": {k: (None if v is None else v / 1e12) for k, v in self.flops_per_s.items()},
            "interconnect": self.interconnect,
            "nvlink_gpus": self.nvlink_gpus,
            "source": self.source,
            "capacity_source": self.capacity_source,
        }


@lru_cache(maxsize=1)
def _raw() -> dict[str, Any]:
    text = (resources.files("memplan.hardware") / "devices.json").read_text(encoding="utf-8")
    return json.loads(text)


def cache_dir() -> str:
    """memplan's cache directory (module docstring)."""
    if os.environ.get("MEMPLAN_CACHE"):
        return os.environ["MEMPLAN_CACHE"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "memplan")


def local_profiles_dir() -> str:
    """Where `memplan calibrate` keeps local device profiles."""
    return os.path.join(cache_dir(), "devices")


LOCAL_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")


def _local_entries() -> dict[str, dict[str, Any]]:
    """The local profiles, by name; an unreadable file is a `UserError` naming it."""
    folder = local_profiles_dir()
    if not os.path.isdir(folder):
        return {}
    out = {}
    for fname in sorted(os.listdir(folder)):
        name, ext = os.path.splitext(fname)
        if ext != ".json" or not LOCAL_NAME.match(name):
            continue
        path = os.path.join(folder, fname)
        try:
            with open(path, encoding="utf-8") as f:
                out[name] = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise UserError(f"the local device profile {path} cannot be read ({exc}): run memplan calibrate "
                            "again or delete it") from None
    return out


def _entries() -> dict[str, dict[str, Any]]:
    """Every profile entry: the local ones, then the shipped ones (which win a name clash)."""
    return {**_local_entries(), **_raw()["devices"]}


def save_local_profile(name: str, entry: dict[str, Any]) -> str:
    """Write `entry` (the shipped format) as the local profile `name`; its path."""
    if not isinstance(name, str) or not LOCAL_NAME.match(name):
        raise UserError(f"profile name {name!r}: use lower-case letters, digits, '.', '_' or '-' (e.g. my-a100)")
    if name in _raw()["devices"]:
        raise UserError(f"{name} is a shipped device profile: name the calibrated one differently (e.g. my-{name})")
    folder = local_profiles_dir()
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{name}.json")
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(entry, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)
    return path


def profile_entry(key: str) -> dict[str, Any]:
    """The JSON entry of `--gpu key` (shipped or local), as stored."""
    entry = _entries().get(key) if isinstance(key, str) else None
    if entry is None:
        raise UserError(_unknown_gpu_message(key))
    return entry


def list_devices() -> list[str]:
    """The `--gpu` names (shipped and local), sorted."""
    return sorted(_entries())


def all_profiles() -> list[DeviceProfile]:
    """Every shipped profile, sorted by `--gpu` name."""
    return [device_profile(key) for key in list_devices()]


def _unknown_gpu_message(key: object) -> str:
    """An unknown `--gpu` name, with the closest names (difflib) and where the list is."""
    bare = {name.replace("-", ""): name for name in list_devices()}  # compared without hyphens
    typed = "".join(ch for ch in str(key).lower() if ch.isalnum())
    close = [name for flat, name in bare.items() if typed and flat.startswith(typed)]
    close += [bare[flat] for flat in difflib.get_close_matches(typed, list(bare), n=3, cutoff=0.5)
              if bare[flat] not in close]
    close = close[:3]
    hint = f"did you mean {', '.join(close)}? " if close else ""
    return f"unknown GPU {key!r}: {hint}see every profile with `memplan estimate --gpu list`"


def _named_most_like(gpu_name: str) -> list[DeviceProfile]:
    """The shipped profiles whose names share the most words with `gpu_name` (more than the
    vendor's name alone: "nvidia" matches every profile), sorted by `--gpu` name."""
    words = set(gpu_name.lower().replace("-", " ").split())
    best: list[DeviceProfile] = []
    best_score = 1
    for key in sorted(_raw()["devices"]):
        profile = device_profile(key)
        score = len(words & set(profile.name.lower().replace("-", " ").split()))
        if score > best_score:
            best, best_score = [profile], score
        elif score == best_score and best:
            best.append(profile)
    return best


def profile_of_name(gpu_name: str) -> DeviceProfile | None:
    """The shipped profile named like a CUDA device (`torch.cuda.get_device_name()`, e.g.
    "NVIDIA H100 80GB HBM3"): the one whose name shares the most words with it (the first
    by `--gpu` name on a tie), or None."""
    named = _named_most_like(gpu_name)
    return named[0] if named else None


def profile_of_device(gpu_name: str, total_bytes: int,
                      tolerance: float = DEVICE_CAPACITY_TOLERANCE) -> DeviceProfile | None:
    """The shipped profile of the CUDA device in hand, from its name and its total memory
    (`torch.cuda.mem_get_info()[1]`): among the profiles named most like it, the one whose
    `capacity_bytes` is nearest `total_bytes`, if within `tolerance` (a fraction) of it.
    None for another GPU, or for a partition of one (a MIG slice has a fraction of the memory)."""
    named = _named_most_like(gpu_name)
    if not named or total_bytes <= 0:
        return None
    nearest = min(named, key=lambda p: abs(p.capacity_bytes - total_bytes))
    return nearest if abs(nearest.capacity_bytes - total_bytes) <= tolerance * total_bytes else None


def device_profile(key: str) -> DeviceProfile:
    """The profile of `--gpu key`; an unknown name is a `UserError` naming the closest ones."""
    entry = profile_entry(key)
    tflops = entry["tflops"]
    context = entry["cuda_context_bytes"]
    channels = entry["nccl"]["channels"]
    return DeviceProfile(
        key=key,
        name=entry["name"],
        generation=entry["generation"],
        platform=entry["platform"],
        capacity_bytes=int(entry["capacity_bytes"]),
        flops_per_s={k: (None if v is None else float(v) * 1e12) for k, v in tflops.items()},
        memory_bandwidth_bytes_per_s=float(entry["memory_bandwidth_gbs"]) * 1e9,
        interconnect=entry["interconnect"],
        interconnect_bytes_per_s=float(entry["interconnect_gbs"]) * 1e9,
        pcie_bytes_per_s=float(entry["pcie_gbs"]) * 1e9,
        cuda_context_bytes=None if context is None else int(context),
        cublas_workspace_bytes=int(entry["cublas_workspace_bytes"]),
        nccl_buffsize_bytes=int(entry["nccl"]["buffsize_bytes"]),
        nccl_channels=None if channels is None else int(channels),
        source=entry["source"],
        capacity_source=entry.get("capacity_source", ""),
        # a local profile calibrated before the field existed: no NVLink domain is assumed
        nvlink_gpus=int(entry.get("nvlink_gpus", 1)),
        nvlink_source=entry.get("nvlink_source", ""),
    )
