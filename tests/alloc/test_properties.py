"""Invariants of every replay, on random event sequences (hypothesis)."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memplan.alloc import AllocConf, CachingAllocator, OutOfMemory, replay
from memplan.alloc.caching import segment_map_from_log
from memplan.trace import ALLOC, FREE, from_events

MiB = 1 << 20
CONFS = [
    "",
    "max_split_size_mb:20",
    "roundup_power2_divisions:[1:4,8:2,>:1]",
    "expandable_segments:True",
    "garbage_collection_threshold:0.5",
]
SIZES = st.one_of(
    st.integers(1, 4096),
    st.integers(1, 2 * MiB),
    st.integers(MiB, 12 * MiB),
    st.integers(10 * MiB, 70 * MiB),
)


@st.composite
def event_sequences(draw):
    """(kinds, sizes, buffers, streams): a random valid alloc/free order."""
    num_buffers = draw(st.integers(1, 30))
    sizes = [draw(SIZES) for _ in range(num_buffers)]
    streams = [draw(st.integers(0, 1)) for _ in range(num_buffers)]
    kinds: list[int] = []
    buffers: list[int] = []
    live: list[int] = []
    next_buffer = 0
    while next_buffer < num_buffers or live:
        if next_buffer < num_buffers and (not live or draw(st.booleans())):
            kinds.append(ALLOC)
            buffers.append(next_buffer)
            live.append(next_buffer)
            next_buffer += 1
        else:
            kinds.append(FREE)
            buffers.append(live.pop(draw(st.integers(0, len(live) - 1))))
    if draw(st.booleans()):  # leave some buffers live at the end
        cut = draw(st.integers(1, len(kinds)))
        kinds, buffers = kinds[:cut], buffers[:cut]
        sizes = sizes[: max(buffers) + 1]
        streams = streams[: len(sizes)]
    return kinds, sizes, buffers, streams


def make_trace(seq):
    kinds, sizes, buffers, streams = seq
    return from_events(np.array(kinds), np.array(sizes), np.array(buffers), streams=np.array(streams))


FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(event_sequences(), st.sampled_from(CONFS), st.sampled_from([None, 60 * MiB, 150 * MiB]))
def test_live_blocks_never_overlap_and_counters_are_ordered(seq, conf_text, capacity) -> None:
    kinds, sizes, buffers, streams = seq
    fraction = 0.8 if capacity is not None and "garbage" in conf_text else None
    allocator = CachingAllocator(AllocConf.parse(conf_text), capacity, fraction)
    for event, (kind, buffer) in enumerate(zip(kinds, buffers)):
        try:
            if kind == ALLOC:
                allocator.malloc(buffer, sizes[buffer], streams[buffer], event)
            else:
                allocator.free(buffer)
        except OutOfMemory:
            break
        blocks = allocator.live_blocks()
        for left, right in zip(blocks, blocks[1:]):
            assert left.addr + left.size <= right.addr
        assert allocator.reserved_bytes >= allocator.allocated_bytes >= allocator.requested_bytes
        assert sum(s["nbytes"] for s in allocator.segment_map()) == allocator.reserved_bytes


@FAST
@given(event_sequences(), st.sampled_from(CONFS), st.sampled_from([None, 60 * MiB]))
def test_replays_are_deterministic_and_pass_the_independent_check(seq, conf_text, capacity) -> None:
    trace = make_trace(seq)
    first = replay(trace, "caching", alloc_conf=conf_text, capacity=capacity)  # runs check_replay
    second = replay(trace, "caching", alloc_conf=conf_text, capacity=capacity)
    assert first.to_json() == second.to_json()
    assert np.array_equal(first.reserved_bytes, second.reserved_bytes)
    assert first.segment_map == second.segment_map
    assert np.all(first.reserved_bytes >= first.allocated_bytes)
    assert np.all(first.allocated_bytes >= first.requested_bytes)


@FAST
@given(event_sequences(), st.sampled_from(CONFS))
def test_segment_map_rebuilt_from_the_log_equals_the_live_one(seq, conf_text) -> None:
    kinds, sizes, buffers, streams = seq
    allocator = CachingAllocator(AllocConf.parse(conf_text))
    addr, nbytes = [0] * len(sizes), [0] * len(sizes)
    live = set()
    for event, (kind, buffer) in enumerate(zip(kinds, buffers)):
        if kind == ALLOC:
            block = allocator.malloc(buffer, sizes[buffer], streams[buffer], event)
            addr[buffer], nbytes[buffer] = block.addr, block.size
            live.add(buffer)
        else:
            allocator.free(buffer)
            live.discard(buffer)
    rebuilt = segment_map_from_log(allocator.segment_log, len(kinds), sorted(live), addr, nbytes, sizes)
    assert rebuilt == allocator.segment_map()


@FAST
@given(event_sequences())
def test_no_allocator_reserves_less_than_the_ideal_one(seq) -> None:
    trace = make_trace(seq)
    ideal = replay(trace, "ideal").peak_reserved_bytes
    assert replay(trace, "caching").peak_reserved_bytes >= ideal
    assert replay(trace, "expandable").peak_reserved_bytes >= ideal
