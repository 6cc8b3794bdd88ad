"""Allocator simulators: replay a trace through PyTorch's caching allocator, expandable
segments, a static address plan or the ideal allocator, and report reserved memory and
fragmentation (`replay`, returning an `AllocReplay`). `CachingAllocator` is the
replayable model itself; `AllocConf` parses `PYTORCH_CUDA_ALLOC_CONF` and owns the
allocator's size rounding (`AllocConf.round_size`)."""

from memplan.alloc.caching import Block, CachingAllocator, OutOfMemory, allocation_size
from memplan.alloc.check import ReplayBug, check_replay
from memplan.alloc.conf import AllocConf
from memplan.alloc.planned import replay_planned
from memplan.alloc.result import AllocReplay, fragmentation_of
from memplan.alloc.simulate import (
    ALLOCATORS,
    ReplayRecord,
    record_replay,
    replay,
    replay_caching,
    replay_ideal,
)

__all__ = [
    "ALLOCATORS",
    "AllocConf",
    "AllocReplay",
    "Block",
    "CachingAllocator",
    "OutOfMemory",
    "ReplayBug",
    "ReplayRecord",
    "allocation_size",
    "check_replay",
    "fragmentation_of",
    "record_replay",
    "replay",
    "replay_caching",
    "replay_ideal",
    "replay_planned",
]
