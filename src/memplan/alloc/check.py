"""An independent check of a replay's result against the trace it came from.

Shares no code with the allocator models: it reads only the trace's columns and the
`AllocReplay`, and recomputes what must hold whatever the allocator did:
- the requested series is the trace's live bytes;
- reserved >= allocated >= requested after every event;
- the segment map at the peak: segments do not overlap, blocks tile each segment
  exactly, the allocated blocks hold exactly the buffers the trace has live (with a
  non-zero size) after the peak event, each block at least as large as its buffer,
  and the map's totals equal the series at that event.
A failure is a bug in memplan, so it raises `ReplayBug` (a `MemplanBug`), not `UserError`.
"""

from __future__ import annotations

import numpy as np

from memplan.alloc.result import AllocReplay
from memplan.errors import MemplanBug
from memplan.trace.model import ALLOC, Trace


class ReplayBug(MemplanBug):
    """A replay result that contradicts its trace: an allocator model's mistake."""


def check_replay(trace: Trace, result: AllocReplay) -> None:
    """Raise ReplayBug unless `result` is consistent with `trace`."""
    n = result.events_replayed
    if not (result.requested_bytes.shape[0] == result.allocated_bytes.shape[0] == n):
        raise ReplayBug("the three series have different lengths")
    kinds = trace.events["kind"][:n]
    sizes = trace.buffers["nbytes"][trace.events["buffer"][:n]]
    live = np.cumsum(np.where(kinds == ALLOC, sizes, -sizes), dtype=np.int64)
    if not np.array_equal(live, result.requested_bytes):
        raise ReplayBug("requested bytes differ from the trace's live bytes")
    if np.any(result.allocated_bytes < result.requested_bytes):
        event = int(np.argmax(result.allocated_bytes < result.requested_bytes))
        raise ReplayBug(f"allocated < requested after event {event}")
    if np.any(result.reserved_bytes < result.allocated_bytes):
        event = int(np.argmax(result.reserved_bytes < result.allocated_bytes))
        raise ReplayBug(f"reserved < allocated after event {event}")
    if n and result.peak_reserved_bytes != int(result.reserved_bytes.max()):
        raise ReplayBug("peak reserved is not the maximum of the series")
    if n and result.peak_allocated_bytes != int(result.allocated_bytes.max()):
        raise ReplayBug("peak allocated is not the maximum of the series")
    if result.segment_map:
        _check_segment_map(trace, result)


def _check_segment_map(trace: Trace, result: AllocReplay) -> None:
    event = result.peak_event
    end = -1
    reserved = allocated = 0
    holders: list[int] = []
    for segment in sorted(result.segment_map, key=lambda s: s["address"]):
        if segment["address"] < end:
            raise ReplayBug(f"segment at {segment['address']:#x} overlaps the previous one")
        cursor = segment["address"]
        for block in segment["blocks"]:
            if block["address"] != cursor or block["nbytes"] <= 0:
                raise ReplayBug(f"blocks of segment {segment['address']:#x} do not tile it")
            cursor += block["nbytes"]
            if block["allocated"]:
                allocated += block["nbytes"]
                buffer = int(block["buffer"])
                holders.append(buffer)
                if block["nbytes"] < int(trace.buffers["nbytes"][buffer]):
                    raise ReplayBug(f"buffer {buffer} has a block smaller than itself")
        if cursor != segment["address"] + segment["nbytes"]:
            raise ReplayBug(f"blocks of segment {segment['address']:#x} do not add up to it")
        end = cursor
        reserved += segment["nbytes"]
    if reserved != int(result.reserved_bytes[event]) or allocated != int(result.allocated_bytes[event]):
        raise ReplayBug(f"segment map totals differ from the series at event {event}")
    alloc_event = trace.buffers["alloc_event"]
    free_event = trace.free_event_or_end()
    live = np.flatnonzero((alloc_event <= event) & (free_event > event) & (trace.buffers["nbytes"] > 0))
    if sorted(holders) != live.tolist():
        raise ReplayBug(f"allocated blocks at event {event} are not the trace's live buffers")
