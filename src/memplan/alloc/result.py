"""What one allocator replay returns: peaks, fragmentation, counts, series, segment map."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


def _empty_series() -> np.ndarray:
    return np.zeros(0, np.int64)


@dataclass
class AllocReplay:
    """Statistics of one replay of a trace through one allocator.

    - `peak_*_bytes`: maxima over the replayed events of the three counters:
      `requested` (sum of the sizes the program asked for), `allocated` (sum of the
      blocks handed out, rounding and unsplit tails included, as
      `torch.cuda.max_memory_allocated` reports) and `reserved` (sum of the
      segments held from CUDA, as `torch.cuda.max_memory_reserved`).
    - `fragmentation` = 1 - peak_allocated / peak_reserved (0 when nothing was reserved).
    - `segments`: the **largest** number of segments held at any one time (for
      expandable segments: contiguous mapped ranges, as PyTorch's snapshot counts them).
    - `num_cuda_malloc` / `num_cuda_free`: cudaMalloc / cudaFree calls (for
      expandable segments: page-range map / unmap calls).
    - `requested_bytes`, `allocated_bytes`, `reserved_bytes`: the counters just
      after each replayed event (one entry per event; fewer than the trace's events
      when the replay stopped at an out-of-memory).
    - `peak_event`: the event after which `reserved` first reached its peak;
      `segment_map` is the allocator's memory at that moment: a list of segments
      `{address, nbytes, stream, pool, expandable, blocks}`, each block
      `{address, nbytes, allocated, buffer, requested_bytes}` (`buffer` is None for
      a free block), sorted by address.
    - `oom`: None, or `{event, request_bytes, alloc_bytes, allocated_bytes,
      reserved_bytes, capacity_bytes}` for the first request that could not be
      served; the replay stops there, as the program would.
    - `extra`: allocator-specific counts (for example, the planned replay's
      matched and unmatched requests).
    """

    allocator: str
    peak_requested_bytes: int = 0
    peak_allocated_bytes: int = 0
    peak_reserved_bytes: int = 0
    fragmentation: float = 0.0
    segments: int = 0
    num_cuda_malloc: int = 0
    num_cuda_free: int = 0
    requested_bytes: np.ndarray = field(default_factory=_empty_series)
    allocated_bytes: np.ndarray = field(default_factory=_empty_series)
    reserved_bytes: np.ndarray = field(default_factory=_empty_series)
    peak_event: int = -1
    segment_map: list[dict[str, Any]] = field(default_factory=list)
    oom: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def events_replayed(self) -> int:
        return int(self.reserved_bytes.shape[0])

    def to_json(self) -> dict[str, Any]:
        """The `memplan simulate --json` object (no per-event series, no segment map)."""
        return {
            "allocator": self.allocator,
            "peak_requested_bytes": int(self.peak_requested_bytes),
            "peak_allocated_bytes": int(self.peak_allocated_bytes),
            "peak_reserved_bytes": int(self.peak_reserved_bytes),
            "fragmentation": float(self.fragmentation),
            "segments": int(self.segments),
            "num_cuda_malloc": int(self.num_cuda_malloc),
            "num_cuda_free": int(self.num_cuda_free),
            "peak_event": int(self.peak_event),
            "events_replayed": self.events_replayed,
            "oom": None if self.oom is None else dict(self.oom),
            **({"extra": self.extra} if self.extra else {}),
        }


def fragmentation_of(peak_allocated_bytes: int, peak_reserved_bytes: int) -> float:
    """1 - peak_allocated / peak_reserved, the figure STAlloc and GMLake report."""
    if peak_reserved_bytes <= 0:
        return 0.0
    return 1.0 - peak_allocated_bytes / peak_reserved_bytes
