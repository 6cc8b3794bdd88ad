"""Expandable segments: pages, lowest-address mapping, unmapping on release."""

from __future__ import annotations

from memplan.alloc import AllocConf, CachingAllocator

MiB = 1 << 20
EXPANDABLE = AllocConf(expandable_segments=True)


def test_small_and_large_pools_map_2_mib_and_20_mib_pages() -> None:
    allocator = CachingAllocator(EXPANDABLE)
    allocator.malloc(0, 1000)
    assert allocator.reserved_bytes == 2 * MiB
    allocator.malloc(1, 5 * MiB)
    assert allocator.reserved_bytes == 22 * MiB
    assert allocator.num_cuda_malloc == 2 and allocator.segments == 2


def test_segment_grows_contiguously_by_whole_pages() -> None:
    allocator = CachingAllocator(EXPANDABLE)
    first = allocator.malloc(0, 15 * MiB)
    first_addr = first.addr
    second = allocator.malloc(1, 15 * MiB)  # 5 MiB free tail + one more 20 MiB page
    assert second.addr == first_addr + 15 * MiB
    assert allocator.reserved_bytes == 40 * MiB
    assert allocator.segments == 1
    [segment] = allocator.segment_map()
    assert segment["nbytes"] == 40 * MiB
    assert [b["nbytes"] for b in segment["blocks"]] == [15 * MiB, 15 * MiB, 10 * MiB]


def test_always_splits_when_512_bytes_remain() -> None:
    allocator = CachingAllocator(EXPANDABLE)
    block = allocator.malloc(0, 19 * MiB)  # 1 MiB remains: the non-expandable large rule would not split
    assert block.size == 19 * MiB and allocator.allocated_bytes == 19 * MiB


def test_release_unmaps_fully_free_pages_and_remaps_at_the_lowest_address() -> None:
    allocator = CachingAllocator(EXPANDABLE)
    a_addr = allocator.malloc(0, 20 * MiB).addr
    allocator.malloc(1, 20 * MiB)
    allocator.free(0)
    allocator.empty_cache()
    assert allocator.reserved_bytes == 20 * MiB and allocator.num_cuda_free == 1
    assert [s["address"] for s in allocator.segment_map()] == [a_addr + 20 * MiB]
    again = allocator.malloc(2, 20 * MiB)
    assert again.addr == a_addr  # the hole below is mapped first
    assert allocator.reserved_bytes == 40 * MiB and allocator.segments == 1


def test_partly_used_pages_stay_mapped_on_release() -> None:
    allocator = CachingAllocator(EXPANDABLE)
    allocator.malloc(0, 15 * MiB)
    allocator.malloc(1, 15 * MiB)
    allocator.free(0)  # [0, 15) free, but page [0, 20) still holds buffer 1
    allocator.empty_cache()
    assert allocator.reserved_bytes == 40 * MiB and allocator.num_cuda_free == 0
    allocator.free(1)
    allocator.empty_cache()
    assert allocator.reserved_bytes == 0 and allocator.segments == 0


def test_at_capacity_free_pages_are_unmapped_and_the_mapping_retried() -> None:
    allocator = CachingAllocator(EXPANDABLE, capacity=60 * MiB)
    a_addr = allocator.malloc(0, 20 * MiB).addr
    allocator.malloc(1, 20 * MiB)
    allocator.free(0)
    block = allocator.malloc(2, 25 * MiB)  # needs 2 pages: 40 + 40 > 60, unmap a's page, retry
    assert block.addr == a_addr + 40 * MiB
    assert allocator.reserved_bytes == 60 * MiB
    assert allocator.num_cuda_free == 1 and allocator.num_alloc_retries == 1


def test_streams_get_their_own_expandable_segments() -> None:
    allocator = CachingAllocator(EXPANDABLE)
    allocator.malloc(0, 5 * MiB, stream=0)
    allocator.free(0)
    allocator.malloc(1, 5 * MiB, stream=1)
    assert allocator.reserved_bytes == 40 * MiB and allocator.segments == 2
