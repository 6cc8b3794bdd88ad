"""Allocator simulators: replay a trace through PyTorch's caching allocator, expandable
segments, a static plan or the ideal allocator, and report reserved memory and
fragmentation (`simulate`). `CachingAllocator` is the replayable model itself."""

from memplan.alloc.caching import Block, CachingAllocator, OutOfMemory, allocation_size
from memplan.alloc.check import ReplayCheckError, check_replay
from memplan.alloc.conf import AllocConf
from memplan.alloc.result import SimResult, fragmentation_of
from memplan.alloc.simulate import (
    ALLOCATORS,
    Replay,
    replay,
    simulate,
    simulate_caching,
    simulate_ideal,
)

__all__ = [
    "ALLOCATORS",
    "AllocConf",
    "Block",
    "CachingAllocator",
    "OutOfMemory",
    "Replay",
    "ReplayCheckError",
    "SimResult",
    "allocation_size",
    "check_replay",
    "fragmentation_of",
    "replay",
    "simulate",
    "simulate_caching",
    "simulate_ideal",
]
