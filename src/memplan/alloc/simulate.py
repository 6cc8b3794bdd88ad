"""`replay(trace, allocator=...)`: replay a trace's alloc/free events through an allocator.

Allocators:
- `caching`: PyTorch's CUDA caching allocator (`memplan.alloc.caching`) under the
  given `PYTORCH_CUDA_ALLOC_CONF` string;
- `expandable`: the same with `expandable_segments:True` forced on;
- `ideal`: every byte live is a byte reserved, nothing more: the lower bound of any
  allocator (fragmentation 0);
- `planned`: a static address plan served from one arena, unmatched requests going to
  a caching fallback (`memplan.alloc.planned`).

Each replay runs the events in order and stops at the first request that cannot be
served within `capacity` (as the program would die there). The segment map at the
peak (the event where reserved first peaks) is rebuilt after the replay from the
allocator's log of segments and the recorded block of every buffer, so no second
replay is needed; pass `segment_map=False` to skip it. Every result passes
`check_replay`, which shares no code with the allocators, before it is returned.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from memplan.alloc.caching import CachingAllocator, OutOfMemory, segment_map_from_log
from memplan.alloc.check import check_replay
from memplan.alloc.conf import AllocConf
from memplan.alloc.planned import replay_planned
from memplan.alloc.result import AllocReplay, fragmentation_of
from memplan.errors import UserError
from memplan.trace.edit import device_view
from memplan.trace.model import ALLOC, Trace

ALLOCATORS = ("caching", "expandable", "ideal", "planned")


def replay(
    trace: Trace,
    allocator: str = "caching",
    alloc_conf: str | AllocConf | None = None,
    capacity: int | None = None,
    plan: Any = None,
    *,
    memory_fraction: float | None = None,
    segment_map: bool = True,
    device: str | None = None,
) -> AllocReplay:
    """Replay `trace` through `allocator` and return its statistics (see AllocReplay).

    `capacity` is the device memory in bytes (None: unlimited); `memory_fraction`
    limits the allocator to that share of it, as
    `torch.cuda.set_per_process_memory_fraction` does (and turns on the garbage
    collection of `garbage_collection_threshold`). An allocator serves one device:
    buffers on other devices (and on `cpu`) are left out, keeping the event numbers;
    `device` picks it (by name, e.g. "cuda:0") when the trace has several.
    """
    if allocator not in ALLOCATORS:
        raise UserError(f"unknown allocator {allocator!r}: choose one of {', '.join(ALLOCATORS)}")
    if capacity is not None and capacity < 0:
        raise UserError(f"capacity {capacity} is negative")
    if memory_fraction is not None:
        if capacity is None:
            raise UserError("a memory fraction needs a capacity: give --capacity too")
        if not 0.0 <= memory_fraction <= 1.0:
            raise UserError(f"memory fraction {memory_fraction} must be between 0 and 1")
    conf = alloc_conf if isinstance(alloc_conf, AllocConf) else AllocConf.parse(alloc_conf)
    trace = device_view(trace, device)
    if allocator == "planned":
        if plan is None:
            raise UserError("the planned allocator needs a plan: pass --plan FILE (from `memplan plan`)")
        return replay_planned(trace, plan, alloc_conf=alloc_conf, capacity=capacity)
    if allocator == "ideal":
        result = replay_ideal(trace, capacity=capacity, memory_fraction=memory_fraction)
    else:
        if allocator == "expandable" and not conf.expandable_segments:
            conf = AllocConf(**{**conf.__dict__, "expandable_segments": True})
        result = replay_caching(trace, conf, capacity=capacity, memory_fraction=memory_fraction,
                                segment_map=segment_map, name=allocator)
    check_replay(trace, result)
    return result


def replay_ideal(trace: Trace, capacity: int | None = None,
                 memory_fraction: float | None = None) -> AllocReplay:
    """The ideal allocator: reserved = allocated = requested = live bytes."""
    live = trace.live_bytes()
    limit = capacity if memory_fraction is None or capacity is None else int(memory_fraction * capacity)
    oom = None
    if limit is not None and live.shape[0] and int(live.max()) > limit:
        event = int(np.argmax(live > limit))
        request = int(trace.buffers["nbytes"][trace.events["buffer"][event]])
        before = int(live[event - 1]) if event else 0
        oom = {"event": event, "request_bytes": request, "alloc_bytes": request,
               "allocated_bytes": before, "reserved_bytes": before, "capacity_bytes": limit}
        live = live[:event]
    peak = int(live.max()) if live.shape[0] else 0
    return AllocReplay(
        allocator="ideal",
        peak_requested_bytes=peak,
        peak_allocated_bytes=peak,
        peak_reserved_bytes=peak,
        fragmentation=0.0,
        requested_bytes=live,
        allocated_bytes=live.copy(),
        reserved_bytes=live.copy(),
        peak_event=int(np.argmax(live)) if live.shape[0] else -1,
        oom=oom,
    )


@dataclass
class ReplayRecord:
    """What one pass over the events recorded: the series, placements and any out-of-memory."""

    allocated_bytes: list[int]
    reserved_bytes: list[int]
    block_addr: list[int]  # per buffer: address of its block (0 if never placed)
    block_nbytes: list[int]  # per buffer: size of its block
    oom: OutOfMemory | None


def record_replay(trace: Trace, allocator: CachingAllocator) -> ReplayRecord:
    """Run the trace's events through `allocator`, recording the series and placements.

    Stops at the first out-of-memory, which is returned, not raised; its event gets
    no entry in the series.
    """
    kinds = trace.events["kind"].tolist()
    event_buffers = trace.events["buffer"].tolist()
    nbytes_of = trace.buffers["nbytes"].tolist()
    stream_of = trace.buffers["stream"].tolist()
    block_addr = [0] * len(nbytes_of)
    block_nbytes = [0] * len(nbytes_of)
    allocated: list[int] = []
    reserved: list[int] = []
    add_allocated = allocated.append
    add_reserved = reserved.append
    malloc = allocator.malloc
    free = allocator.free
    oom = None
    try:
        for event in range(len(kinds)):
            buffer = event_buffers[event]
            nbytes = nbytes_of[buffer]
            if nbytes:
                if kinds[event] == ALLOC:
                    block = malloc(buffer, nbytes, stream_of[buffer], event)
                    block_addr[buffer] = block.addr
                    block_nbytes[buffer] = block.size
                else:
                    free(buffer)
            add_allocated(allocator.allocated_bytes)
            add_reserved(allocator.reserved_bytes)
    except OutOfMemory as exc:
        oom = exc
    return ReplayRecord(allocated, reserved, block_addr, block_nbytes, oom)


def replay_caching(trace: Trace, conf: AllocConf, capacity: int | None = None,
                   memory_fraction: float | None = None, segment_map: bool = True,
                   name: str = "caching") -> AllocReplay:
    """Replay through the caching allocator model (expandable when `conf` says so)."""
    allocator = CachingAllocator(conf, capacity, memory_fraction)
    record = record_replay(trace, allocator)
    allocated = np.asarray(record.allocated_bytes, dtype=np.int64)
    reserved = np.asarray(record.reserved_bytes, dtype=np.int64)
    requested = trace.live_bytes()[: reserved.shape[0]]
    peak_event = int(np.argmax(reserved)) if reserved.shape[0] else -1
    segments: list[dict[str, Any]] = []
    if segment_map and peak_event >= 0:
        nbytes = trace.buffers["nbytes"]
        live = (trace.buffers["alloc_event"] <= peak_event) & (trace.free_event_or_end() > peak_event)
        segments = segment_map_from_log(
            allocator.segment_log, peak_event, np.flatnonzero(live & (nbytes > 0)).tolist(),
            record.block_addr, record.block_nbytes, nbytes.tolist(),
        )
    oom = record.oom
    peak_allocated = int(allocated.max()) if allocated.shape[0] else 0
    peak_reserved = int(reserved.max()) if reserved.shape[0] else 0
    return AllocReplay(
        allocator=name,
        peak_requested_bytes=int(requested.max()) if requested.shape[0] else 0,
        peak_allocated_bytes=peak_allocated,
        peak_reserved_bytes=peak_reserved,
        fragmentation=fragmentation_of(peak_allocated, peak_reserved),
        segments=allocator.max_segments,
        num_cuda_malloc=allocator.num_cuda_malloc,
        num_cuda_free=allocator.num_cuda_free,
        requested_bytes=requested,
        allocated_bytes=allocated,
        reserved_bytes=reserved,
        peak_event=peak_event,
        segment_map=segments,
        oom=None if oom is None else oom.as_dict(),
        extra={"num_alloc_retries": allocator.num_alloc_retries},
    )
