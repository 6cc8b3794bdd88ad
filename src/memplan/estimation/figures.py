"""A rank's figures from its trace: the one way a trace becomes a `RankEstimate`.

`rank_estimate(view, ...)` is what `memplan.estimate` does with each rank's view (traced at
full depth or unrolled from two depths, `memplan.estimation.unroll`), what
`memplan.estimation.from_trace` does with each device of a recorded trace, and what the
watch does with the live job's fake step (`memplan.watch.estimate`):

1. **replay** the device's buffers (host memory left out) through the allocator simulator
   (`memplan.alloc`) with no limit: peak allocated (`torch.cuda.max_memory_allocated`) and
   peak reserved (`torch.cuda.max_memory_reserved`) of the step's demand;
2. **within the usable memory**, capacity x (1 - margin) less what the device holds
   outside PyTorch's allocator (CUDA context, NCCL buffers), where that demand's reserved
   memory does not fit it: replayed again with that limit. PyTorch's caching allocator
   frees its cached blocks and retries a cudaMalloc that fails before it raises
   out-of-memory (`c10/cuda/CUDACachingAllocator.cpp`, `DeviceCachingAllocator::malloc`:
   `release_cached_blocks()` then `alloc_block` again; docs/allocators.md), so a step
   whose tensors fit never holds more reserved memory than the device allows. If the
   replay runs out of memory even so, the step does not fit: the figures are the demand
   (the unlimited replay) and `oom` says which request failed;
3. **device used** = reserved + context + NCCL; a step fits when device used <= usable
   (`Estimate.fits`).

The breakdown charges each buffer the block the allocator reserves for it (512-byte
multiples or `roundup_power2_divisions`, `memplan.alloc.conf.AllocConf.round_size`), at the
allocated peak; the allocator's unsplit tails go to "other".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from memplan.alloc import AllocConf, replay
from memplan.estimation.margin import DEFAULT_MARGIN, check_margin, usable_bytes_of  # noqa: F401 - re-exported
from memplan.layout import plan_addresses
from memplan.trace import edit as trace_edit
from memplan.trace.model import CATEGORIES, CATEGORY, HOST_KINDS, PHASE, Trace

LIMITED_ALLOCATORS = ("caching", "expandable")  # the ones that free their cache and retry at the limit
BREAKDOWN_KEYS = ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "other")
_CATEGORY_TO_KEY = {
    CATEGORY["parameter"]: 0, CATEGORY["gradient"]: 1, CATEGORY["optimizer_state"]: 2,
    CATEGORY["activation"]: 3, CATEGORY["temporary"]: 4, CATEGORY["input"]: 5, CATEGORY["other"]: 5,
}


@dataclass
class HostFigures:
    """Host memory a rank's step keeps (memplan.models.tracing: offloaded optimizer state,
    parameters and gradients, bitsandbytes' paged state): the peak of its live bytes and,
    at that peak, how much is pinned (page-locked), pageable, and CUDA managed (unified
    memory the driver migrates between host and GPU; backed by the host, outside the
    caching allocator). None of it is in the device figures."""

    peak_bytes: int = 0
    pinned_bytes: int = 0
    pageable_bytes: int = 0
    managed_bytes: int = 0


@dataclass
class RankEstimate:
    """One rank's figures (bytes). `oom`: the request the allocator could not serve within
    the usable memory (None: it fits, or no capacity was given); the figures are then the
    step's demand."""

    rank: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    device_used_bytes: int
    breakdown: dict[str, int]
    peak_phase: str
    ranks: list[int] = field(default_factory=list)  # the ranks this one stands for
    host: HostFigures = field(default_factory=HostFigures)
    oom: dict[str, Any] | None = None
    phase_peaks: dict[str, int] = field(default_factory=dict)  # peak allocated in each phase of the step

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "device_used_bytes": self.device_used_bytes,
            "breakdown": dict(self.breakdown),
            "peak_phase": self.peak_phase,
            "host_peak_bytes": self.host.peak_bytes,
            "host_pinned_bytes": self.host.pinned_bytes,
            "host_pageable_bytes": self.host.pageable_bytes,
            "host_managed_bytes": self.host.managed_bytes,
            "same_as_ranks": self.ranks,
            "oom": self.oom,
            "phase_peaks": dict(self.phase_peaks),
        }


@dataclass
class Counters:
    """Series of one replay: allocated and reserved bytes after each event, the per-buffer
    sizes the allocator charges (for the breakdown), and the request that ran out of
    memory (None: every event was replayed)."""

    allocated: np.ndarray
    reserved: np.ndarray
    charged_nbytes: np.ndarray
    oom: dict[str, Any] | None = None


def charged_bytes(nbytes: np.ndarray, alloc_conf: str | None) -> np.ndarray:
    """Per buffer, the block size the caching allocator reserves for it under
    `alloc_conf` (`memplan.alloc.conf.AllocConf.round_size`; 0 for an empty buffer)."""
    conf = AllocConf.parse(alloc_conf)
    sizes, inverse = np.unique(nbytes, return_inverse=True)
    rounded = np.array([conf.round_size(int(n)) if n > 0 else 0 for n in sizes], dtype=np.int64)
    return rounded[inverse.reshape(-1)]


def replay_counters(trace: Trace, allocator: str, alloc_conf: str | None, capacity: int | None = None) -> Counters:
    """Allocated and reserved series of `trace` under `allocator`, within `capacity`
    bytes (None: unlimited)."""
    nbytes = trace.buffers["nbytes"]
    if allocator == "none":
        live = trace.live_bytes()
        return Counters(live, live, nbytes)
    if allocator == "planned":
        # STWeaver plan of this very step (validated by the layout work's independent
        # checker before it is returned), replayed with its caching fallback.
        result = replay(trace, "planned", alloc_conf=alloc_conf, plan=plan_addresses(trace), segment_map=False,
                        capacity=capacity)
    else:
        result = replay(trace, allocator, alloc_conf=alloc_conf, segment_map=False, capacity=capacity)
    return Counters(result.allocated_bytes, result.reserved_bytes, charged_bytes(nbytes, alloc_conf), result.oom)


def breakdown_of(vector: np.ndarray, total: float) -> dict[str, int]:
    """Trace categories -> the report's six keys; the allocator's unsplit tails go to other."""
    out = np.zeros(len(BREAKDOWN_KEYS))
    for cat, key in _CATEGORY_TO_KEY.items():
        out[key] += vector[cat]
    out = np.maximum(np.rint(out), 0)
    out[5] += max(0.0, round(total) - out.sum())
    return {k: int(v) for k, v in zip(BREAKDOWN_KEYS, out)}


@dataclass
class Figures:
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    breakdown: dict[str, int]
    peak_phase: str
    host: HostFigures = field(default_factory=HostFigures)
    phase_peaks: dict[str, int] = field(default_factory=dict)
    # the event of the allocated peak in each trace the figures come from (one trace, or
    # the k- and (k+1)-block pair of `memplan.estimation.layers`), for a caller that reads more at the peak
    peak_events: tuple[int, ...] = ()


def figures_full(trace: Trace, counters: Counters) -> Figures:
    """Peaks of a full-depth trace: the device's from `counters` (a replay of the trace's
    device buffers), the host memory's from its host buffers."""
    event = int(np.argmax(counters.allocated)) if counters.allocated.shape[0] else -1
    peak = int(counters.allocated[event]) if event >= 0 else 0
    device = trace_edit.without_host(trace)
    vector = breakdown_vector(device, event, counters.charged_nbytes) if event >= 0 else np.zeros(len(CATEGORIES))
    return Figures(peak, int(counters.reserved.max()) if counters.reserved.shape[0] else 0,
                   breakdown_of(vector, peak), trace.phase_at(event), host_figures(trace),
                   phase_peaks(trace, counters.allocated), (event,))


def phase_peaks(trace: Trace, allocated: np.ndarray) -> dict[str, int]:
    """The peak of `allocated` (one value per event, maybe fewer) in each phase of the step:
    forward, backward (recompute included), optimizer and other."""
    n = allocated.shape[0]
    if not n:
        return {}
    op = trace.events["op"][:n]
    phase = np.where(op >= 0, trace.ops["phase"][np.maximum(op, 0)] if trace.num_ops else PHASE["other"],
                     trace.buffers["phase"][trace.events["buffer"][:n]])
    phase = np.where(phase == PHASE["recompute"], PHASE["backward"], phase)
    return {name: int(allocated[phase == PHASE[name]].max()) for name in ("forward", "backward", "optimizer", "other")
            if (phase == PHASE[name]).any()}


def breakdown_vector(trace: Trace, event: int, nbytes: np.ndarray | None = None) -> np.ndarray:
    """Live bytes per category just after `event` (optionally with other per-buffer sizes)."""
    sizes = trace.buffers["nbytes"] if nbytes is None else nbytes
    mask = trace.live_at(event)
    return np.bincount(trace.buffers["category"][mask], weights=sizes[mask], minlength=len(CATEGORIES))


def host_figures(trace: Trace) -> HostFigures:
    """The host memory of a full-depth trace: its peak, and the kinds at the peak."""
    series = host_series(trace)
    total = series.sum(axis=0)
    if not total.shape[0]:
        return HostFigures()
    return host_at(series[:, int(np.argmax(total))])


def host_series(trace: Trace) -> np.ndarray:
    """Live host bytes after each event, one row per kind of `HOST_KINDS`."""
    return np.stack([trace.live_bytes(trace.host_mask(kind)) for kind in HOST_KINDS]).reshape(len(HOST_KINDS), -1)


def host_at(by_kind: np.ndarray) -> HostFigures:
    """`HostFigures` from the live bytes per kind (`HOST_KINDS` order) at the host peak."""
    pinned, pageable, managed = (int(round(max(float(v), 0.0))) for v in by_kind)
    return HostFigures(pinned + pageable + managed, pinned, pageable, managed)


def rank_estimate(view: Trace, *, rank: int, allocator: str, alloc_conf: str | None, overhead_bytes: int,
                  usable_bytes: int | None, same_as: list[int] | None = None,
                  host: HostFigures | None = None) -> RankEstimate:
    """The figures of `view`, one rank's (or device's) trace with everything its device
    adds (module docstring). `overhead_bytes`: what the device holds outside PyTorch's
    allocator (CUDA context, NCCL buffers); `usable_bytes`: capacity x (1 - margin), None
    for no limit; `host`: the host figures when `view`'s host buffers do not hold them."""
    device = trace_edit.without_host(view)
    fig = figures_full(view, replay_counters(device, allocator, alloc_conf))
    oom = None
    limit = None if usable_bytes is None else usable_bytes - overhead_bytes
    if limit is not None and allocator in LIMITED_ALLOCATORS and fig.peak_reserved_bytes > limit:
        within = replay_counters(device, allocator, alloc_conf, capacity=max(limit, 0))
        if within.oom is None:
            fig = figures_full(view, within)
        else:
            oom = {key: int(value) for key, value in within.oom.items() if value is not None}
    return RankEstimate(rank, fig.peak_allocated_bytes, fig.peak_reserved_bytes,
                        fig.peak_reserved_bytes + overhead_bytes, fig.breakdown, fig.peak_phase,
                        same_as if same_as is not None else [rank], host if host is not None else fig.host, oom,
                        fig.phase_peaks)
