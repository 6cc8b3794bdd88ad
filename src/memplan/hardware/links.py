"""Storage tiers and links for offloading, shipped as data (`links.json` beside this module).

A `Hardware` describes what one GPU of a node sees: its device profile (from
`memplan.hardware.devices`), its RAID-0 array of NVMe drives, its share of the host-memory
limit, and its PCIe link. Transfers are modelled on four one-way channels per GPU,
as TERAIO (arXiv 2506.06472, §4) keeps one bandwidth timeline per link:

- `ssd_write` / `ssd_read`: GPU ↔ NVMe (GPUDirect Storage), N drives striped, capped by
  the GPU's PCIe link;
- `host_write` / `host_read`: GPU ↔ pinned host memory over the same PCIe link.

Assumption: SSD and host traffic share the GPU's PCIe link, so the host channels get
only what the SSD channels leave (`pcie - ssd`); this never lets the two together
exceed the link. GPUDirect Storage or not: SSD transfers get the same bandwidths either
way, since the GPU's PCIe link carries each byte once whether it lands in the drive's
buffer (GDS) or in a pinned host bounce buffer; what the bounce adds (host-memory
bandwidth and CPU cores: TERAIO measured > 100 GB/s and > 3 cores for 2 GPUs x 4 SSDs) is
not modelled. Drive figures are the per-drive sequential bandwidths TERAIO measured
(990 PRO 6.7 / 6.5 GB/s) or datasheet numbers; every figure carries its source in the JSON.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any

from memplan.errors import UserError
from memplan.hardware.devices import DeviceProfile, device_profile
from memplan.units import format_bytes, parse_size

LINKS = ("ssd_write", "ssd_read", "host_write", "host_read")


@lru_cache(maxsize=1)
def _raw() -> dict[str, Any]:
    text = (resources.files("memplan.hardware") / "links.json").read_text(encoding="utf-8")
    return json.loads(text)


def nvme_drives() -> list[str]:
    """The drive names a `--nvme` SPEC may use."""
    return sorted(_raw()["nvme"])


def cpu_adam_params_per_s() -> float:
    """Parameters per second a CPU Adam updates (a node-wide figure, for the ZeRO baselines)."""
    return float(_raw()["cpu_adam_params_per_s"])


@dataclass(frozen=True)
class NvmeArray:
    """A RAID-0 of `drives` identical NVMe drives: bandwidths and capacity add up."""

    drives: int
    read_bytes_per_s: float  # whole array
    write_bytes_per_s: float
    capacity_bytes: float  # math.inf where the SPEC gave bandwidth only
    name: str


_SPEC = re.compile(r"^\s*(\d+)\s*[xX×]\s*(.+?)\s*$")


def parse_nvme_spec(spec: str) -> NvmeArray:
    """`4x990pro` (N drives from links.json) or `2x7GB/s` (N drives of that bandwidth each).

    `0` or `none` means no NVMe. A bandwidth-only drive has unlimited capacity.
    """
    text = str(spec).strip().lower()
    if text in ("0", "none", ""):
        return NvmeArray(0, 0.0, 0.0, 0.0, "none")
    match = _SPEC.match(text)
    if match is None:
        count, what = 1, text
    else:
        count, what = int(match.group(1)), match.group(2)
    if count < 1:
        raise UserError(f"--nvme '{spec}': the number of drives must be at least 1")
    drives = _raw()["nvme"]
    if what in drives:
        d = drives[what]
        return NvmeArray(
            count,
            count * float(d["read_bytes_per_s"]),
            count * float(d["write_bytes_per_s"]),
            float(count * int(d["capacity_bytes"])),
            f"{count}x {d['name']}",
        )
    if what.endswith("/s"):
        try:
            per_drive = float(parse_size(what[:-2]))
        except (UserError, ValueError) as exc:
            raise UserError(f"--nvme '{spec}': cannot read the bandwidth '{what}' ({exc})") from None
        if per_drive <= 0:
            raise UserError(f"--nvme '{spec}': the bandwidth must be positive")
        return NvmeArray(count, count * per_drive, count * per_drive, math.inf, f"{count}x {what}")
    raise UserError(
        f"--nvme '{spec}': unknown drive '{what}'; use NxDRIVE with DRIVE one of "
        f"{', '.join(nvme_drives())}, or NxBANDWIDTH such as 2x7GB/s"
    )


@dataclass(frozen=True)
class Hardware:
    """What one GPU of the node has for offloading. Bandwidths in bytes/s, sizes in bytes."""

    gpu: DeviceProfile
    gpus: int
    nvme: NvmeArray  # this GPU's array
    host_capacity_bytes: float  # this GPU's share of the host-memory limit
    pcie_bytes_per_s: float  # per direction

    def link_bytes_per_s(self) -> dict[str, float]:
        """Bandwidth of each of the four channels (see the module docstring)."""
        ssd_w = min(self.nvme.write_bytes_per_s, self.pcie_bytes_per_s)
        ssd_r = min(self.nvme.read_bytes_per_s, self.pcie_bytes_per_s)
        return {
            "ssd_write": ssd_w,
            "ssd_read": ssd_r,
            "host_write": max(self.pcie_bytes_per_s - ssd_w, 0.0),
            "host_read": max(self.pcie_bytes_per_s - ssd_r, 0.0),
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "gpu": self.gpu.key,
            "gpus": self.gpus,
            "nvme": self.nvme.name,
            "nvme_capacity_bytes": None if math.isinf(self.nvme.capacity_bytes) else self.nvme.capacity_bytes,
            "host_capacity_bytes_per_gpu": self.host_capacity_bytes,
            "pcie_bytes_per_s": self.pcie_bytes_per_s,
            "links_bytes_per_s": self.link_bytes_per_s(),
        }


def make_hardware(
    gpu: str,
    *,
    nvme: str = "4x990pro",
    host_mem: str | int = 0,
    gpus: int = 1,
    pcie: str | None = None,
) -> Hardware:
    """The per-GPU view of a node: `nvme` is one GPU's array, `host_mem` the node-wide limit."""
    if gpus < 1:
        raise UserError(f"--gpus must be at least 1, not {gpus}")
    profile = device_profile(gpu)
    links = _raw()["links"]
    if pcie is None:
        pcie_bytes_per_s = float(profile.pcie_bytes_per_s)
    elif pcie in links:
        pcie_bytes_per_s = float(links[pcie]["bytes_per_s"])
    else:
        raise UserError(f"unknown link '{pcie}'; use one of {', '.join(sorted(links))}")
    host_bytes = parse_size(host_mem) if isinstance(host_mem, str) else int(host_mem)
    if host_bytes < 0:
        raise UserError(f"--host-mem must not be negative ({format_bytes(host_bytes)})")
    return Hardware(profile, gpus, parse_nvme_spec(nvme), host_bytes / gpus, pcie_bytes_per_s)
