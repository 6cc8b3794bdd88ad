"""The caching allocator's rules, one hand-computed case each (docs/sources.md §1)."""

from __future__ import annotations

import numpy as np
import pytest

from memplan.alloc import AllocConf, CachingAllocator, OutOfMemory, allocation_size, replay
from memplan.errors import UserError
from memplan.trace import ALLOC, FREE, from_events

MiB = 1 << 20


def trace_of(steps: list[tuple[str, int]], sizes: list[int], streams: list[int] | None = None):
    """Events ('a'|'f', buffer) over buffers of the given sizes."""
    kinds = np.array([ALLOC if kind == "a" else FREE for kind, _ in steps])
    buffers = np.array([buffer for _, buffer in steps])
    return from_events(kinds, np.array(sizes), buffers,
                       streams=None if streams is None else np.array(streams))


# --- rounding, pools, segment sizes -------------------------------------------------------
@pytest.mark.parametrize(("nbytes", "block_nbytes"), [(1, 512), (512, 512), (513, 1024), (1000, 1024)])
def test_requests_are_rounded_up_to_512_bytes(nbytes: int, block_nbytes: int) -> None:
    allocator = CachingAllocator()
    block = allocator.malloc(0, nbytes)
    assert block.size == block_nbytes
    assert allocator.allocated_bytes == block_nbytes
    assert allocator.requested_bytes == nbytes


def test_one_mib_request_goes_to_the_small_pool_in_a_2_mib_segment() -> None:
    allocator = CachingAllocator()
    block = allocator.malloc(0, MiB)
    assert block.small
    assert allocator.reserved_bytes == 2 * MiB


def test_request_just_over_one_mib_goes_to_the_large_pool_in_a_20_mib_segment() -> None:
    allocator = CachingAllocator()
    block = allocator.malloc(0, MiB + 1)
    assert not block.small
    assert block.size == MiB + 512
    assert allocator.reserved_bytes == 20 * MiB


@pytest.mark.parametrize(
    ("rounded", "segment"),
    [(512, 2 * MiB), (MiB, 2 * MiB), (MiB + 512, 20 * MiB), (10 * MiB - 512, 20 * MiB),
     (10 * MiB, 10 * MiB), (11 * MiB + 512, 12 * MiB), (100 * MiB, 100 * MiB)],
)
def test_new_segment_size(rounded: int, segment: int) -> None:
    assert allocation_size(rounded) == segment


# --- best fit ------------------------------------------------------------------------
def test_best_fit_takes_the_smallest_free_block_that_fits() -> None:
    allocator = CachingAllocator()
    big = allocator.malloc(0, 14 * MiB)
    small = allocator.malloc(1, 12 * MiB)
    allocator.free(0)
    allocator.free(1)
    block = allocator.malloc(2, 11 * MiB)
    assert block.addr == small.addr != big.addr
    assert block.size == 12 * MiB  # remaining 1 MiB is not > 1 MiB: handed out whole
    assert allocator.num_cuda_malloc == 2


def test_best_fit_breaks_a_size_tie_by_lowest_address() -> None:
    allocator = CachingAllocator()
    first = allocator.malloc(0, 12 * MiB)
    second = allocator.malloc(1, 12 * MiB)
    assert first.addr < second.addr
    allocator.free(1)
    allocator.free(0)  # freed last, but at the lower address
    assert allocator.malloc(2, 12 * MiB).addr == first.addr


# --- splitting ------------------------------------------------------------------------
def test_large_block_splits_when_more_than_1_mib_remains() -> None:
    allocator = CachingAllocator()
    allocator.malloc(0, 12 * MiB)
    allocator.free(0)
    block = allocator.malloc(1, 10 * MiB + 512 * 1024)  # remaining 1.5 MiB
    assert block.size == 10 * MiB + 512 * 1024
    assert block.next is not None and block.next.size == 3 * MiB // 2


def test_large_block_is_not_split_when_exactly_1_mib_remains() -> None:
    allocator = CachingAllocator()
    allocator.malloc(0, 12 * MiB)
    allocator.free(0)
    block = allocator.malloc(1, 11 * MiB)
    assert block.size == 12 * MiB and block.next is None
    assert allocator.allocated_bytes == 12 * MiB and allocator.requested_bytes == 11 * MiB


def test_small_block_splits_when_512_bytes_remain_and_request_takes_the_low_part() -> None:
    allocator = CachingAllocator()
    a_addr = allocator.malloc(0, 1024).addr
    allocator.malloc(1, 1024)
    allocator.free(0)
    block = allocator.malloc(2, 512)  # best fit: the freed 1024-byte block, not the big tail
    assert block.addr == a_addr and block.size == 512
    assert block.next is not None and block.next.size == 512 and not block.next.allocated


def test_a_5_mib_request_splits_a_20_mib_segment() -> None:
    allocator = CachingAllocator()
    block = allocator.malloc(0, 5 * MiB)
    assert block.size == 5 * MiB and block.next is not None and block.next.size == 15 * MiB
    second = allocator.malloc(1, 15 * MiB)
    assert second.addr == block.addr + 5 * MiB
    assert allocator.num_cuda_malloc == 1


# --- coalescing, streams --------------------------------------------------------------------
def test_free_coalesces_with_both_neighbours_back_into_one_segment() -> None:
    allocator = CachingAllocator()
    a_addr = allocator.malloc(0, 4 * MiB).addr
    allocator.malloc(1, 4 * MiB)
    allocator.malloc(2, 4 * MiB)
    allocator.free(0)
    allocator.free(2)  # merges with the 8 MiB tail
    allocator.free(1)  # merges with both
    [segment] = allocator.segment_map()
    assert segment["address"] == a_addr
    assert [(b["nbytes"], b["allocated"]) for b in segment["blocks"]] == [(20 * MiB, False)]
    whole = allocator.malloc(3, 20 * MiB)
    assert whole.addr == a_addr and allocator.num_cuda_malloc == 1


def test_a_freed_block_is_reused_only_on_its_own_stream() -> None:
    trace = trace_of([("a", 0), ("f", 0), ("a", 1), ("f", 1), ("a", 2)],
                     [12 * MiB, 12 * MiB, 12 * MiB], streams=[0, 1, 0])
    result = replay(trace, "caching")
    assert result.num_cuda_malloc == 2
    assert result.peak_reserved_bytes == 24 * MiB
    assert result.segments == 2


# --- configuration options ---------------------------------------------------------------
def test_max_split_size_keeps_oversize_blocks_from_small_requests() -> None:
    allocator = CachingAllocator(AllocConf.parse("max_split_size_mb:20"))
    allocator.malloc(0, 24 * MiB)
    allocator.free(0)
    allocator.malloc(1, 12 * MiB)
    assert allocator.reserved_bytes == 36 * MiB
    default = CachingAllocator()
    default.malloc(0, 24 * MiB)
    default.free(0)
    block = default.malloc(1, 12 * MiB)
    assert default.reserved_bytes == 24 * MiB and block.size == 12 * MiB


def test_max_split_size_refuses_an_oversize_block_20_mib_larger_than_the_request() -> None:
    allocator = CachingAllocator(AllocConf.parse("max_split_size_mb:20"))
    allocator.malloc(0, 64 * MiB)
    allocator.free(0)
    allocator.malloc(1, 40 * MiB)  # 64 >= 40 + 20: refused, new segment
    assert allocator.reserved_bytes == 104 * MiB
    allocator.free(1)
    block = allocator.malloc(2, 50 * MiB)  # 40 MiB block too small; 64 < 50 + 20: taken whole
    assert block.size == 64 * MiB and allocator.allocated_bytes == 64 * MiB


def test_max_non_split_rounding_widens_the_oversize_tolerance() -> None:
    allocator = CachingAllocator(AllocConf.parse("max_split_size_mb:20,max_non_split_rounding_mb:40"))
    allocator.malloc(0, 64 * MiB)
    allocator.free(0)
    block = allocator.malloc(1, 40 * MiB)  # 64 < 40 + 40
    assert block.size == 64 * MiB and allocator.reserved_bytes == 64 * MiB


def test_roundup_power2_divisions_rounds_to_the_next_division() -> None:
    allocator = CachingAllocator(AllocConf.parse("roundup_power2_divisions:4"))
    assert allocator.malloc(0, 5000).size == 5120  # [4096, 8192) in steps of 1024
    assert allocator.malloc(1, 1200).size == 1536  # not > 512 * 4: plain 512 rounding
    assert allocator.malloc(2, 3 * MiB + 1).size == 3 * MiB + 512 * 1024  # steps of 512 KiB


def test_roundup_power2_divisions_bracket_syntax_applies_per_interval() -> None:
    allocator = CachingAllocator(AllocConf.parse("roundup_power2_divisions:[64:8,256:4,>:1]"))
    assert allocator.malloc(0, 3 * MiB + 1).size == 3 * MiB + 256 * 1024  # 8 divisions of [2, 4) MiB
    assert allocator.malloc(1, 300 * MiB + 1).size == 300 * MiB + 512  # '>' (1) overrides 256's 4


def test_garbage_collection_frees_the_oldest_whole_blocks_first() -> None:
    # allowed = 0.5 * 100 MiB = 50 MiB; GC once reserved > 0.4 * 50 MiB = 20 MiB.
    conf = AllocConf.parse("garbage_collection_threshold:0.4")
    allocator = CachingAllocator(conf, capacity=100 * MiB, memory_fraction=0.5)
    a_addr = allocator.malloc(0, 12 * MiB).addr
    allocator.malloc(1, 12 * MiB)
    allocator.free(0)
    allocator.free(1)
    allocator.malloc(2, 12 * MiB)  # reuses a's block (lowest address): it becomes younger
    allocator.free(2)
    allocator.malloc(3, 30 * MiB)  # no fit: GC frees b's block only (age 2 >= mean 1.5)
    assert allocator.num_cuda_free == 1
    assert allocator.reserved_bytes == 42 * MiB
    assert a_addr in [s["address"] for s in allocator.segment_map()]
    assert allocator.num_alloc_retries == 0


def test_garbage_collection_is_off_without_a_memory_fraction() -> None:
    allocator = CachingAllocator(AllocConf.parse("garbage_collection_threshold:0.4"), capacity=100 * MiB)
    allocator.malloc(0, 12 * MiB)
    allocator.malloc(1, 12 * MiB)
    allocator.free(0)
    allocator.free(1)
    allocator.malloc(3, 30 * MiB)
    assert allocator.num_cuda_free == 0 and allocator.reserved_bytes == 54 * MiB


# --- capacity -------------------------------------------------------------------------
def test_at_capacity_cached_whole_segments_are_released_and_the_malloc_retried() -> None:
    allocator = CachingAllocator(capacity=40 * MiB)
    allocator.malloc(0, 12 * MiB)
    allocator.malloc(1, 12 * MiB)
    allocator.free(0)
    allocator.malloc(2, 20 * MiB)  # 24 + 20 > 40: free a's 12 MiB segment, retry
    assert allocator.reserved_bytes == 32 * MiB
    assert allocator.num_cuda_free == 1 and allocator.num_alloc_retries == 1


def test_memory_fraction_limits_the_reservation() -> None:
    allocator = CachingAllocator(capacity=100 * MiB, memory_fraction=0.3)  # 30 MiB allowed
    allocator.malloc(0, 20 * MiB)
    with pytest.raises(OutOfMemory):
        allocator.malloc(1, 12 * MiB)


def test_out_of_memory_reports_the_event_and_the_request() -> None:
    # x and y split one 20 MiB segment; freeing x leaves a split (unreleasable) block.
    trace = trace_of([("a", 0), ("a", 1), ("f", 0), ("a", 2), ("f", 1), ("f", 2)],
                     [4 * MiB, 4 * MiB, 13 * MiB])
    result = replay(trace, "caching", capacity=30 * MiB)
    assert result.oom is not None
    assert result.oom["event"] == 3 and result.oom["request_bytes"] == 13 * MiB
    assert result.oom["alloc_bytes"] == 14 * MiB and result.oom["reserved_bytes"] == 20 * MiB
    assert result.events_replayed == 3
    assert result.to_json()["oom"]["event"] == 3


def test_with_enough_capacity_there_is_no_out_of_memory() -> None:
    trace = trace_of([("a", 0), ("a", 1), ("f", 0), ("a", 2), ("f", 1), ("f", 2)],
                     [4 * MiB, 4 * MiB, 13 * MiB])
    result = replay(trace, "caching", capacity=34 * MiB)
    assert result.oom is None and result.peak_reserved_bytes == 34 * MiB


# --- statistics ---------------------------------------------------------------------
def test_statistics_of_a_small_replay() -> None:
    trace = trace_of([("a", 0), ("a", 1), ("f", 0), ("f", 1)], [1000, 5 * MiB])
    result = replay(trace, "caching")
    assert result.requested_bytes.tolist() == [1000, 1000 + 5 * MiB, 5 * MiB, 0]
    assert result.allocated_bytes.tolist() == [1024, 1024 + 5 * MiB, 5 * MiB, 0]
    assert result.reserved_bytes.tolist() == [2 * MiB, 22 * MiB, 22 * MiB, 22 * MiB]
    assert result.peak_reserved_bytes == 22 * MiB
    assert result.fragmentation == pytest.approx(1 - (1024 + 5 * MiB) / (22 * MiB))
    assert result.segments == 2 and result.num_cuda_malloc == 2 and result.num_cuda_free == 0
    assert result.peak_event == 1
    assert [s["nbytes"] for s in result.segment_map] == [2 * MiB, 20 * MiB]
    assert [b["buffer"] for b in result.segment_map[1]["blocks"]] == [1, None]


def test_ideal_allocator_reserves_exactly_the_live_bytes() -> None:
    trace = trace_of([("a", 0), ("a", 1), ("f", 0), ("f", 1)], [1000, 5 * MiB])
    result = replay(trace, "ideal")
    assert result.peak_reserved_bytes == result.peak_allocated_bytes == 1000 + 5 * MiB
    assert result.fragmentation == 0.0


def test_zero_byte_buffers_never_reach_the_allocator() -> None:
    trace = trace_of([("a", 0), ("f", 0)], [0])
    result = replay(trace, "caching")
    assert result.peak_reserved_bytes == 0 and result.num_cuda_malloc == 0


def test_cpu_buffers_are_left_out_of_the_device_allocator() -> None:
    trace = trace_of([("a", 0), ("a", 1), ("f", 0), ("f", 1)], [1000, 5 * MiB])
    trace.devices = ["cpu", "cuda:0"]
    trace.buffers["device"] = np.array([0, 1], np.int16)
    result = replay(trace, "caching")
    assert result.peak_requested_bytes == 5 * MiB and result.peak_reserved_bytes == 20 * MiB
    assert result.events_replayed == 4  # event numbers are kept


def test_several_devices_need_a_choice() -> None:
    trace = trace_of([("a", 0), ("a", 1)], [1000, 5 * MiB])
    trace.devices = ["cuda:0", "cuda:1"]
    trace.buffers["device"] = np.array([0, 1], np.int16)
    with pytest.raises(UserError, match="--device"):
        replay(trace, "caching")
    assert replay(trace, "caching", device="cuda:1").peak_reserved_bytes == 20 * MiB
