"""A replay model of PyTorch's CUDA caching allocator, expandable segments included.

Follows `c10/cuda/CUDACachingAllocator.cpp` (DeviceCachingAllocator: `malloc`,
`get_free_block`, `alloc_block`, `should_split`, `alloc_found_block`, `free_block`,
`try_merge_blocks`, `release_available_cached_blocks`, `release_cached_blocks`,
`garbage_collect_cached_blocks`, and for `expandable_segments:True`
`find_expandable_block`, `map_block`, `unmap_block`), rule for rule; the rules are
summarised in docs/allocators.md. Request sizes are rounded by `memplan.alloc.conf`
(`round_size`), the one owner of that rule.

Use it as an object when you replay events yourself (the planned replay uses it as
its fallback):

    allocator = CachingAllocator(AllocConf.parse("max_split_size_mb:128"), capacity=80 * 2**30)
    block = allocator.malloc(buffer=7, nbytes=4096, stream=0, event=12)  # raises OutOfMemory
    block.addr, block.size                     # where it went, the (rounded) block size
    allocator.free(buffer=7)
    allocator.allocated_bytes, allocator.reserved_bytes, allocator.peak_reserved_bytes
    allocator.num_cuda_malloc, allocator.num_cuda_free, allocator.segments, allocator.max_segments
    allocator.segment_map()                    # the memory as PyTorch's snapshot shows it

A returned `Block` is the allocator's own record: read `addr` and `size` at once,
because after later frees the same object may describe a merged free block.

Assumptions, where a trace cannot say what the GPU did:
- cudaMalloc succeeds while reserved + the segment size <= `capacity` (no CUDA
  context, no other process, no driver granularity); `capacity=None` is unlimited.
  With `memory_fraction`, the limit is `int(fraction * capacity)` as in
  `torch.cuda.set_per_process_memory_fraction`, and the garbage collector of
  `garbage_collection_threshold` is active.
- Addresses come from a bump pointer (2 MiB aligned, never reused), so among
  equal-size free blocks the older segment wins ties, as it usually does on a GPU.
- There is no cross-stream use (`record_stream`), so a freed block is reusable at
  once; zero-byte requests never reach the allocator (PyTorch returns nullptr).
- Expandable segments reserve 9/8 of `capacity` (of 1 TiB when unlimited) of
  address space per (stream, pool); physical pages are 2 MiB (small pool) or
  20 MiB (large pool). Blocks of expandable segments are never released by
  `max_split_size_mb`'s oversize release or the garbage collector (upstream asserts
  they are not expandable there); they are unmapped by `release_cached_blocks`.
"""

from __future__ import annotations

from typing import Any

from sortedcontainers import SortedList

from memplan.alloc.conf import K_MIN_BLOCK_SIZE, UNLIMITED, AllocConf, round_size_plain

K_SMALL_SIZE = 1 << 20  # largest "small" request
K_SMALL_BUFFER = 2 << 20  # small-pool segment size, small-pool expandable page
K_MIN_LARGE_ALLOC = 10 << 20  # requests below this get a K_LARGE_BUFFER segment
K_ROUND_LARGE = 2 << 20  # larger segments are rounded to this
K_LARGE_BUFFER = 20 << 20  # large-pool segment for 1-10 MiB requests, large-pool expandable page
DEFAULT_DEVICE_BYTES = 1 << 40  # address-space basis for expandable segments with no capacity

# Free blocks sit in one sorted list of int keys per pool: stream, then size, then
# address (PyTorch's BlockComparatorSize). Unmapped expandable ranges: stream, address.
_ADDR_BITS = 56
_ADDR_MASK = (1 << _ADDR_BITS) - 1
_SIZE_SHIFT = _ADDR_BITS
_STREAM_SHIFT = 2 * _ADDR_BITS
_STREAM_OFFSET = 1 << 31  # trace streams are int32; keys must be non-negative
_FIRST_ADDRESS = 1 << 32
_ALIGN = 2 << 20


class OutOfMemory(Exception):
    """A request the allocator could not serve even after releasing its cache."""

    def __init__(self, *, event: int, request_bytes: int, alloc_bytes: int,
                 allocated_bytes: int, reserved_bytes: int, capacity_bytes: int | None) -> None:
        self.event = event
        self.request_bytes = request_bytes
        self.alloc_bytes = alloc_bytes
        self.allocated_bytes = allocated_bytes
        self.reserved_bytes = reserved_bytes
        self.capacity_bytes = capacity_bytes
        super().__init__(
            f"out of memory at event {event}: tried to allocate {request_bytes} bytes "
            f"(a {alloc_bytes}-byte segment) with {reserved_bytes} reserved, "
            f"{allocated_bytes} allocated, capacity {capacity_bytes}"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "event": self.event,
            "request_bytes": self.request_bytes,
            "alloc_bytes": self.alloc_bytes,
            "allocated_bytes": self.allocated_bytes,
            "reserved_bytes": self.reserved_bytes,
            "capacity_bytes": self.capacity_bytes,
        }


class ExpandableSegment:
    """The address range of one growing segment and which of its pages are mapped."""

    __slots__ = ("base", "page_bytes", "num_pages", "stream", "small", "pages")

    def __init__(self, base: int, page_bytes: int, num_pages: int, stream: int, small: bool) -> None:
        self.base = base
        self.page_bytes = page_bytes
        self.num_pages = num_pages
        self.stream = stream
        self.small = small
        self.pages = bytearray(num_pages)  # 1 where a physical page is mapped


class Block:
    """A contiguous range of one segment: allocated, free (cached) or unmapped."""

    __slots__ = ("addr", "size", "stream", "small", "allocated", "mapped", "prev", "next",
                 "requested", "buffer", "gc_base", "segment")

    def __init__(self, addr: int, size: int, stream: int, small: bool,
                 segment: ExpandableSegment | None = None) -> None:
        self.addr = addr
        self.size = size
        self.stream = stream
        self.small = small
        self.allocated = False
        self.mapped = True
        self.prev: Block | None = None
        self.next: Block | None = None
        self.requested = 0
        self.buffer = -1
        self.gc_base = 0
        self.segment = segment

    def __repr__(self) -> str:
        state = "allocated" if self.allocated else "free" if self.mapped else "unmapped"
        return f"Block(addr={self.addr:#x}, size={self.size}, stream={self.stream}, {state})"


def allocation_size(size: int) -> int:
    """Size of the new segment for a rounded request (`get_allocation_size`)."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return -(-size // K_ROUND_LARGE) * K_ROUND_LARGE


def _free_key(block: Block) -> int:
    return ((block.stream + _STREAM_OFFSET) << _STREAM_SHIFT) | (block.size << _SIZE_SHIFT) | block.addr


def _unmapped_key(block: Block) -> int:
    return ((block.stream + _STREAM_OFFSET) << _ADDR_BITS) | block.addr


class CachingAllocator:
    """PyTorch's caching allocator for one device, replayed request by request."""

    def __init__(self, conf: AllocConf | None = None, capacity: int | None = None,
                 memory_fraction: float | None = None) -> None:
        self.conf = conf or AllocConf()
        self.capacity_bytes = capacity
        self.allowed_bytes: int | None = None
        if memory_fraction is not None:
            if capacity is None:
                raise ValueError("a memory fraction needs a capacity")
            if not 0.0 <= memory_fraction <= 1.0:
                raise ValueError(f"memory fraction {memory_fraction} is not in [0, 1]")
            self.allowed_bytes = int(memory_fraction * capacity)
        self._gc = self.allowed_bytes is not None and self.conf.garbage_collection_threshold > 0.0
        self._expandable = self.conf.expandable_segments
        self._max_split = self.conf.max_split_size_bytes
        self._max_non_split_rounding = self.conf.max_non_split_rounding_bytes
        self._plain_rounding = not any(d > 1 for d in self.conf.roundup_power2_divisions)
        # Index 0: large pool, 1: small pool.
        self._free = (SortedList(), SortedList())
        self._unmapped = (SortedList(), SortedList())
        self._gc_calls = [0, 0]
        self._blocks: dict[int, Block] = {}  # address -> every block, allocated, free or unmapped
        self._live: dict[int, Block] = {}  # buffer -> its allocated block
        self._segment_heads: dict[int, bool] = {}  # base address of each cudaMalloc segment
        self._expandable_segments: dict[int, ExpandableSegment] = {}
        self._next_address = _FIRST_ADDRESS
        self._event = -1
        # (event, +1 or -1, address, nbytes, stream, small, expandable segment base or -1):
        # every segment cudaMalloc'ed or freed, every page range mapped or unmapped.
        self.segment_log: list[tuple[int, int, int, int, int, bool, int]] = []

        self.requested_bytes = 0
        self.allocated_bytes = 0
        self.reserved_bytes = 0
        self.peak_requested_bytes = 0
        self.peak_allocated_bytes = 0
        self.peak_reserved_bytes = 0
        self.segments = 0
        self.max_segments = 0
        self.num_cuda_malloc = 0
        self.num_cuda_free = 0
        self.num_alloc_retries = 0
        self.num_ooms = 0

    # --- the two calls a replay makes -------------------------------------------------
    def malloc(self, buffer: int, nbytes: int, stream: int = 0, event: int = -1) -> Block:
        """Serve `buffer`'s request of `nbytes` on `stream`; raise OutOfMemory if impossible."""
        self._event = event
        size = round_size_plain(nbytes) if self._plain_rounding else self.conf.round_size(nbytes)
        small = size <= K_SMALL_SIZE
        pool = 1 if small else 0
        block = self._get_free_block(pool, stream, size)
        if block is None:
            alloc_size = allocation_size(size)
            if self._gc:
                self._garbage_collect()
            block = self._alloc_block(pool, stream, size, alloc_size)
            if block is None and self._release_available_cached_blocks(pool, stream, size):
                block = self._alloc_block(pool, stream, size, alloc_size)
            if block is None:
                self.release_cached_blocks()
                self.num_alloc_retries += 1
                block = self._alloc_block(pool, stream, size, alloc_size)
            if block is None:
                self.num_ooms += 1
                raise OutOfMemory(event=event, request_bytes=nbytes, alloc_bytes=alloc_size,
                                  allocated_bytes=self.allocated_bytes,
                                  reserved_bytes=self.reserved_bytes,
                                  capacity_bytes=self.allowed_bytes if self.allowed_bytes is not None
                                  else self.capacity_bytes)
        remaining = block.size - size
        if small or self._expandable:
            split = remaining >= K_MIN_BLOCK_SIZE
        else:
            split = size < self._max_split and remaining > K_SMALL_SIZE
        if split:
            # The request takes the low-address part; the rest stays cached.
            rest = block
            block = Block(rest.addr, size, stream, small, rest.segment)
            block.prev = rest.prev
            if block.prev is not None:
                block.prev.next = block
            block.next = rest
            rest.prev = block
            rest.addr += size
            rest.size = remaining
            self._blocks[block.addr] = block
            self._blocks[rest.addr] = rest
            self._insert_free(rest)
        block.allocated = True
        block.requested = nbytes
        block.buffer = buffer
        self._live[buffer] = block
        self.allocated_bytes += block.size
        if self.allocated_bytes > self.peak_allocated_bytes:
            self.peak_allocated_bytes = self.allocated_bytes
        self.requested_bytes += nbytes
        if self.requested_bytes > self.peak_requested_bytes:
            self.peak_requested_bytes = self.requested_bytes
        return block

    def free(self, buffer: int) -> None:
        """Return `buffer`'s block to its pool, coalescing with free neighbours."""
        block = self._live.pop(buffer, None)
        if block is None:
            raise KeyError(f"buffer {buffer} is not allocated")
        block.allocated = False
        block.buffer = -1
        self.allocated_bytes -= block.size
        self.requested_bytes -= block.requested
        block.requested = 0
        prev = block.prev
        if prev is not None and not prev.allocated and prev.mapped:
            self._merge(block, prev)
        nxt = block.next
        if nxt is not None and not nxt.allocated and nxt.mapped:
            self._merge(block, nxt)
        self._insert_free(block)

    # --- views --------------------------------------------------------------------
    def live_blocks(self) -> list[Block]:
        """Every allocated block, in address order."""
        return sorted(self._live.values(), key=lambda b: b.addr)

    def segment_map(self) -> list[dict[str, Any]]:
        """Segments and their blocks, by address, as `torch.cuda.memory_snapshot()` lists them."""
        segments: list[dict[str, Any]] = []
        for base in self._segment_heads:
            segments.append(self._describe_segment(self._blocks[base], expandable=False))
        for seg in self._expandable_segments.values():
            block: Block | None = self._blocks[seg.base]
            while block is not None:
                if block.mapped:
                    segments.append(self._describe_segment(block, expandable=True))
                    while block is not None and block.mapped:
                        block = block.next
                else:
                    block = block.next
        segments.sort(key=lambda s: s["address"])
        return segments

    @staticmethod
    def _describe_segment(head: Block, expandable: bool) -> dict[str, Any]:
        blocks = []
        block: Block | None = head
        while block is not None and block.mapped:
            blocks.append({
                "address": block.addr,
                "nbytes": block.size,
                "allocated": block.allocated,
                "buffer": block.buffer if block.allocated else None,
                "requested_bytes": block.requested if block.allocated else 0,
            })
            block = block.next
        return {
            "address": head.addr,
            "nbytes": sum(b["nbytes"] for b in blocks),
            "stream": head.stream,
            "pool": "small" if head.small else "large",
            "expandable": expandable,
            "blocks": blocks,
        }

    # --- cache management ------------------------------------------------------------
    def release_cached_blocks(self) -> None:
        """cudaFree every cached block that is a whole segment; unmap free expandable pages."""
        for pool in (0, 1):
            to_unmap = []
            for key in list(self._free[pool]):
                block = self._blocks[key & _ADDR_MASK]
                if block.segment is not None:
                    to_unmap.append(block)
                elif block.prev is None and block.next is None:
                    self._release_block(block)
            for block in to_unmap:
                self._unmap_block(block)
                if block.prev is None and block.next is None:
                    self._release_expandable_segment(block)

    empty_cache = release_cached_blocks

    # --- internals, one per upstream function --------------------------------------------
    def _insert_free(self, block: Block) -> None:
        if self._gc:
            block.gc_base = self._gc_calls[1 if block.small else 0]
        self._free[1 if block.small else 0].add(_free_key(block))

    def _merge(self, dst: Block, src: Block | None) -> None:
        """try_merge_blocks: absorb the free neighbour `src` (same mapped state) into `dst`."""
        if src is None or src.allocated or src.mapped != dst.mapped:
            return
        pool = 1 if src.small else 0
        if src.mapped:
            self._free[pool].remove(_free_key(src))
        else:
            self._unmapped[pool].remove(_unmapped_key(src))
        blocks = self._blocks
        if dst.prev is src:
            del blocks[dst.addr]
            dst.addr = src.addr
            blocks[dst.addr] = dst
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            del blocks[src.addr]
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size

    def _get_free_block(self, pool: int, stream: int, size: int) -> Block | None:
        if self._gc:
            self._gc_calls[pool] += 1
        free = self._free[pool]
        stream_key = stream + _STREAM_OFFSET
        i = free.bisect_left((stream_key << _STREAM_SHIFT) | (size << _SIZE_SHIFT))
        if i == len(free):
            return None
        key = free[i]
        if key >> _STREAM_SHIFT != stream_key:
            return None
        block = self._blocks[key & _ADDR_MASK]
        if block.segment is not None:
            # An expandable tail counts as big as it can grow: prefer smaller blocks.
            def expandable_size(b: Block) -> int:
                nxt = b.next
                return b.size + (nxt.size if nxt is not None and not nxt.mapped else 0)

            j = i + 1
            while block.segment is not None and j < len(free):
                next_key = free[j]
                if next_key >> _STREAM_SHIFT != stream_key:
                    break
                candidate = self._blocks[next_key & _ADDR_MASK]
                if expandable_size(candidate) >= expandable_size(block):
                    break
                block, i = candidate, j
                j += 1
        max_split = self._max_split
        if size < max_split and block.size >= max_split:
            return None  # never split an oversize block for a small request
        if size >= max_split and block.size >= size + self._max_non_split_rounding:
            return None  # nor hand out an oversize block much larger than asked
        del free[i]
        return block

    def _alloc_block(self, pool: int, stream: int, size: int, alloc_size: int) -> Block | None:
        if self.allowed_bytes is not None and self.reserved_bytes + alloc_size > self.allowed_bytes:
            return None
        if self._expandable:
            return self._try_allocate_expandable_block(pool, stream, size)
        if self.capacity_bytes is not None and self.reserved_bytes + alloc_size > self.capacity_bytes:
            return None
        addr = self._next_address
        self._next_address += -(-alloc_size // _ALIGN) * _ALIGN
        block = Block(addr, alloc_size, stream, pool == 1)
        self._blocks[addr] = block
        self._segment_heads[addr] = True
        self.segment_log.append((self._event, 1, addr, alloc_size, stream, pool == 1, -1))
        self.reserved_bytes += alloc_size
        if self.reserved_bytes > self.peak_reserved_bytes:
            self.peak_reserved_bytes = self.reserved_bytes
        self.segments += 1
        if self.segments > self.max_segments:
            self.max_segments = self.segments
        self.num_cuda_malloc += 1
        return block

    def _release_block(self, block: Block) -> None:
        """cudaFree a cached block that is a whole segment."""
        self._free[1 if block.small else 0].remove(_free_key(block))
        del self._blocks[block.addr]
        del self._segment_heads[block.addr]
        self.segment_log.append((self._event, -1, block.addr, block.size, block.stream, block.small, -1))
        self.reserved_bytes -= block.size
        self.segments -= 1
        self.num_cuda_free += 1

    def _release_available_cached_blocks(self, pool: int, stream: int, size: int) -> bool:
        """With max_split_size set: cudaFree oversize cached blocks, just enough for `size`."""
        if self._max_split == UNLIMITED or self._expandable:
            return False
        free = self._free[pool]
        stream_key = stream + _STREAM_OFFSET
        key_size = max(size, self._max_split)
        i = free.bisect_left((stream_key << _STREAM_SHIFT) | (key_size << _SIZE_SHIFT))
        if i < len(free) and free[i] >> _STREAM_SHIFT == stream_key:
            self._release_block(self._blocks[free[i] & _ADDR_MASK])
            return True
        # No single block is large enough: free oversize blocks, largest first.
        released = 0
        i -= 1
        while released < key_size and i >= 0:
            key = free[i]
            block = self._blocks[key & _ADDR_MASK]
            if key >> _STREAM_SHIFT != stream_key or block.size < self._max_split:
                break
            released += block.size
            self._release_block(block)
            i -= 1
        return released >= key_size

    def _garbage_collect(self) -> None:
        """garbage_collect_cached_blocks: free old whole large blocks above the threshold."""
        assert self.allowed_bytes is not None
        threshold = int(self.conf.garbage_collection_threshold * self.allowed_bytes)
        if self.reserved_bytes <= threshold:
            return
        target = self.reserved_bytes - threshold
        calls = self._gc_calls[0]
        free = self._free[0]
        blocks = self._blocks

        def freeable() -> list[Block]:
            found = [blocks[k & _ADDR_MASK] for k in free]
            return [b for b in found if b.prev is None and b.next is None and b.segment is None]

        candidates = freeable()
        if not candidates:
            return
        total_age = sum(calls - b.gc_base for b in candidates)
        count = len(candidates)
        reclaimed = 0
        block_freed = True
        while reclaimed < target and block_freed and count > 0:
            age_threshold = total_age / count
            block_freed = False
            for block in freeable():
                age = calls - block.gc_base
                if age >= age_threshold:
                    block_freed = True
                    reclaimed += block.size
                    total_age -= age
                    count -= 1
                    self._release_block(block)

    # --- expandable segments ---------------------------------------------------------
    def _try_allocate_expandable_block(self, pool: int, stream: int, size: int) -> Block | None:
        candidate = self._find_expandable_block(pool, stream, size)
        if not candidate.mapped and not self._map_block(candidate, min(candidate.size, size)):
            return None
        while candidate.size < size:
            # candidate is free and mapped, followed by unmapped space: map some and merge.
            nxt = candidate.next
            assert nxt is not None
            if not self._map_block(nxt, min(size - candidate.size, nxt.size)):
                return None
            candidate = nxt
        self._free[pool].remove(_free_key(candidate))
        return candidate

    def _find_expandable_block(self, pool: int, stream: int, size: int) -> Block:
        """The lowest address with `size` bytes of free or unmapped space, or a new segment."""
        unmapped = self._unmapped[pool]
        stream_key = stream + _STREAM_OFFSET
        i = unmapped.bisect_left(stream_key << _ADDR_BITS)
        while i < len(unmapped):
            key = unmapped[i]
            if key >> _ADDR_BITS != stream_key:
                break
            candidate = self._blocks[key & _ADDR_MASK]
            if candidate.prev is not None and not candidate.prev.allocated:
                candidate = candidate.prev
            room = 0
            block: Block | None = candidate
            while room < size and block is not None and not block.allocated:
                room += block.size
                block = block.next
            if room >= size:
                return candidate
            i += 1
        page = K_SMALL_BUFFER if pool == 1 else K_LARGE_BUFFER
        device = self.capacity_bytes if self.capacity_bytes is not None else DEFAULT_DEVICE_BYTES
        num_pages = -(-(device + device // 8) // page)
        base = self._next_address
        self._next_address += -(-(num_pages * page) // _ALIGN) * _ALIGN
        segment = ExpandableSegment(base, page, num_pages, stream, pool == 1)
        self._expandable_segments[base] = segment
        candidate = Block(base, num_pages * page, stream, pool == 1, segment)
        candidate.mapped = False
        self._blocks[base] = candidate
        unmapped.add(_unmapped_key(candidate))
        return candidate

    def _map_block(self, to_map: Block, size: int) -> bool:
        """Back the first `size` bytes of an unmapped block with whole pages."""
        segment = to_map.segment
        assert segment is not None and not to_map.mapped
        page = segment.page_bytes
        begin = (to_map.addr - segment.base) // page
        end = -(-(to_map.addr + size - segment.base) // page)
        nbytes = (end - begin) * page
        if nbytes == 0:
            return False
        if self.capacity_bytes is not None and self.reserved_bytes + nbytes > self.capacity_bytes:
            return False  # cuMemCreate out of memory
        pool = 1 if to_map.small else 0
        self._unmapped[pool].remove(_unmapped_key(to_map))
        to_map.mapped = True
        if nbytes < to_map.size:
            rest = Block(to_map.addr + nbytes, to_map.size - nbytes, to_map.stream, to_map.small, segment)
            rest.mapped = False
            rest.prev = to_map
            rest.next = to_map.next
            if rest.next is not None:
                rest.next.prev = rest
            to_map.next = rest
            to_map.size = nbytes
            self._blocks[rest.addr] = rest
            self._unmapped[pool].add(_unmapped_key(rest))
        pages = segment.pages
        joins = (begin > 0 and pages[begin - 1]) + (end < segment.num_pages and pages[end])
        pages[begin:end] = b"\x01" * (end - begin)
        self.segment_log.append((self._event, 1, segment.base + begin * page, nbytes, to_map.stream,
                                 to_map.small, segment.base))
        self.segments += 1 - joins
        if self.segments > self.max_segments:
            self.max_segments = self.segments
        self._merge(to_map, to_map.prev)
        self._merge(to_map, to_map.next)
        self._insert_free(to_map)
        self.reserved_bytes += nbytes
        if self.reserved_bytes > self.peak_reserved_bytes:
            self.peak_reserved_bytes = self.reserved_bytes
        self.num_cuda_malloc += 1
        return True

    def _unmap_block(self, block: Block) -> None:
        """Give back the whole pages inside a free expandable block."""
        segment = block.segment
        assert segment is not None
        page = segment.page_bytes
        begin = -(-(block.addr - segment.base) // page)
        end = (block.addr + block.size - segment.base) // page
        if begin >= end:
            return
        pool = 1 if block.small else 0
        self._free[pool].remove(_free_key(block))
        start = segment.base + begin * page
        nbytes = (end - begin) * page
        before = start - block.addr
        after = block.size - before - nbytes
        if before > 0:
            head = Block(block.addr, before, block.stream, block.small, segment)
            head.prev = block.prev
            if head.prev is not None:
                head.prev.next = head
            head.next = block
            block.prev = head
            self._blocks[head.addr] = head
            self._insert_free(head)
        if after > 0:
            tail = Block(start + nbytes, after, block.stream, block.small, segment)
            tail.next = block.next
            if tail.next is not None:
                tail.next.prev = tail
            tail.prev = block
            block.next = tail
            self._blocks[tail.addr] = tail
            self._insert_free(tail)
        block.addr = start
        block.size = nbytes
        block.mapped = False
        self._blocks[start] = block
        pages = segment.pages
        joins = (begin > 0 and pages[begin - 1]) + (end < segment.num_pages and pages[end])
        pages[begin:end] = bytes(end - begin)
        self.segment_log.append((self._event, -1, start, nbytes, block.stream, block.small, segment.base))
        self.segments += joins - 1
        self._merge(block, block.prev)
        self._merge(block, block.next)
        self._unmapped[pool].add(_unmapped_key(block))
        self.reserved_bytes -= nbytes
        self.num_cuda_free += 1

    def _release_expandable_segment(self, block: Block) -> None:
        segment = block.segment
        assert segment is not None and not block.mapped
        self._unmapped[1 if block.small else 0].remove(_unmapped_key(block))
        del self._blocks[block.addr]
        del self._expandable_segments[segment.base]


def segment_map_from_log(
    segment_log: list[tuple[int, int, int, int, int, bool, int]],
    event: int,
    live_buffers: list[int],
    block_addr: list[int],
    block_nbytes: list[int],
    requested_nbytes: list[int],
) -> list[dict[str, Any]]:
    """The segment map just after `event`, rebuilt from a replay's records.

    Segments are the log's cudaMalloc'ed segments and mapped page ranges alive after
    `event` (contiguous mapped pages of one expandable segment form one segment);
    allocated blocks are where the replay placed each buffer live then; every gap
    between them inside a segment is one free block (free neighbours always
    coalesce). This avoids a second replay to the peak.
    """
    plain: dict[int, tuple[int, int, bool]] = {}
    mapped: dict[int, dict[int, tuple[int, int, bool]]] = {}  # expandable base -> page addr -> info
    for logged_event, sign, addr, nbytes, stream, small, base in segment_log:
        if logged_event > event:
            break
        if base < 0:
            if sign > 0:
                plain[addr] = (nbytes, stream, small)
            else:
                del plain[addr]
            continue
        page = K_SMALL_BUFFER if small else K_LARGE_BUFFER
        pages = mapped.setdefault(base, {})
        for page_addr in range(addr, addr + nbytes, page):
            if sign > 0:
                pages[page_addr] = (page, stream, small)
            else:
                del pages[page_addr]
    segments: list[tuple[int, int, int, bool, bool]] = [
        (addr, nbytes, stream, small, False) for addr, (nbytes, stream, small) in plain.items()
    ]
    for pages in mapped.values():
        run_start = run_end = -1
        info = (0, 0, False)
        for page_addr in sorted(pages):
            page, stream, small = pages[page_addr]
            if page_addr != run_end:
                if run_start >= 0:
                    segments.append((run_start, run_end - run_start, info[1], info[2], True))
                run_start = page_addr
            run_end = page_addr + page
            info = (page, stream, small)
        if run_start >= 0:
            segments.append((run_start, run_end - run_start, info[1], info[2], True))
    segments.sort()
    holders = sorted(live_buffers, key=lambda b: block_addr[b])
    out: list[dict[str, Any]] = []
    k = 0
    for addr, nbytes, stream, small, expandable in segments:
        end = addr + nbytes
        blocks: list[dict[str, Any]] = []
        cursor = addr
        while k < len(holders) and block_addr[holders[k]] < end:
            buffer = holders[k]
            start = block_addr[buffer]
            if start > cursor:
                blocks.append({"address": cursor, "nbytes": start - cursor, "allocated": False,
                               "buffer": None, "requested_bytes": 0})
            blocks.append({"address": start, "nbytes": block_nbytes[buffer], "allocated": True,
                           "buffer": buffer, "requested_bytes": requested_nbytes[buffer]})
            cursor = start + block_nbytes[buffer]
            k += 1
        if cursor < end:
            blocks.append({"address": cursor, "nbytes": end - cursor, "allocated": False,
                           "buffer": None, "requested_bytes": 0})
        out.append({"address": addr, "nbytes": nbytes, "stream": stream,
                    "pool": "small" if small else "large", "expandable": expandable, "blocks": blocks})
    return out
