"""Recording a step's allocator requests, and the steady-state plan made from them."""

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import memplan
from memplan.layout.plan import LONG_LIVED
from memplan.runtime import plan_steady_state, record_step, trace_from_recording

A, F = 0, 1


def recording(events, parallel=()):
    """events: (kind, buffer, nbytes, iteration) tuples; parallel: indices of parallel events."""
    kinds, buffers, nbytes, iteration = (np.asarray(c) for c in zip(*events, strict=True))
    flags = np.zeros(len(events), np.int8)
    flags[list(parallel)] = 1
    return trace_from_recording(kinds, buffers, nbytes, iteration, flags)


def test_recording_logs_each_request_and_free_in_order(ext):
    def step():
        a = torch.empty(100, dtype=torch.uint8)
        b = torch.empty(300, dtype=torch.uint8)
        del a, b

    trace = record_step(step, 2)
    assert trace.buffers["nbytes"].tolist() == [100, 300, 100, 300]
    assert trace.buffers["iteration"].tolist() == [0, 0, 1, 1]
    assert trace.events["kind"].tolist() == [A, A, F, F, A, A, F, F]
    assert trace.meta["iteration_first_event"] == [0, 4, 8]


def test_recording_restores_the_cpu_allocator_when_the_step_raises(ext):
    before = ext.cpu_allocator_address()

    def step():
        raise KeyError("boom")

    try:
        record_step(step, 1)
    except KeyError:
        pass
    assert ext.cpu_allocator_address() == before


def test_steady_state_plan_covers_the_last_iteration_only():
    trace = recording([(A, 0, 64, 0), (F, 0, 64, 0), (A, 1, 128, 1), (F, 1, 128, 1)])
    plan = plan_steady_state(trace)
    assert plan.groups == [1]
    assert plan.iterations[0].nbytes.tolist() == [128]
    assert plan.arena_bytes == 128


def test_requests_live_at_once_get_disjoint_offsets_and_freed_ones_are_reused():
    # a [0,3), b [1,2), c [3,4): a and b overlap in time; c may reuse a's bytes.
    trace = recording([(A, 0, 64, 0), (A, 1, 64, 0), (F, 1, 64, 0), (F, 0, 64, 0), (A, 2, 64, 0), (F, 2, 64, 0)])
    offsets = plan_steady_state(trace).iterations[0].offset.tolist()
    assert offsets[0] != offsets[1]
    assert plan_steady_state(trace).arena_bytes == 128


def test_never_freed_requests_are_long_lived():
    trace = recording([(A, 0, 64, 0), (A, 1, 64, 0), (F, 1, 64, 0)])
    plan = plan_steady_state(trace)
    assert plan.iterations[0].offset.tolist() == [LONG_LIVED, 0]
    assert plan.stats["long_lived"] == 1


def test_request_freed_after_its_next_instance_is_made_is_long_lived():
    # `self.last = new` in the step: x of iteration 0 is freed after x of iteration 1 is
    # made, so two instances live at once; one periodic offset cannot hold both.
    events = [(A, 0, 64, 0), (A, 1, 64, 1), (F, 0, 64, 1)]
    plan = plan_steady_state(recording(events))
    assert plan.iterations[0].offset.tolist() == [LONG_LIVED]
    assert plan.stats["wrapping"] == 0


def test_what_the_step_returns_is_recorded_as_never_freed(ext):
    def step():
        scratch = torch.empty(100, dtype=torch.uint8)
        del scratch
        return torch.empty(64, dtype=torch.uint8)  # a loss the loop may keep

    trace = record_step(step, 2)
    assert trace.buffers["free_event"].tolist() == [1, -1, 4, -1]
    assert plan_steady_state(trace).iterations[0].offset.tolist() == [0, LONG_LIVED]


def test_request_freed_in_the_next_iteration_wraps_around():
    # Each iteration: y is allocated and freed; x is allocated and lives into the next
    # iteration, where it is freed after the next y is allocated. In the steady state y
    # must not share x's offset, since the wrapped x is still there when y comes.
    events = [
        (A, 0, 64, 0), (F, 0, 64, 0), (A, 1, 64, 0),
        (A, 2, 64, 1), (F, 1, 64, 1), (F, 2, 64, 1), (A, 3, 64, 1),
    ]  # fmt: skip
    plan = plan_steady_state(trace := recording(events))
    y, x = plan.iterations[0].offset.tolist()
    assert x >= 0 and y >= 0 and x != y
    assert plan.stats["wrapping"] == 1
    assert trace.num_buffers == 4


def test_parallel_region_requests_get_distinct_offsets_whatever_their_order():
    # Two threads' scratch, recorded as alloc/free/alloc/free, may run as alloc/alloc/free/free.
    events = [(A, 0, 128, 0), (F, 0, 128, 0), (A, 1, 128, 0), (F, 1, 128, 0)]
    serial = plan_steady_state(recording(events)).iterations[0].offset.tolist()
    parallel = plan_steady_state(recording(events, parallel=[0, 1, 2, 3])).iterations[0].offset.tolist()
    assert serial[0] == serial[1]
    assert parallel[0] != parallel[1]


@st.composite
def periodic_recordings(draw):
    """Random allocs and frees, the same each iteration; a free placed before its alloc
    frees the previous iteration's tensor (it wraps around)."""
    n = draw(st.integers(1, 12))
    sizes = draw(st.lists(st.sampled_from([64, 128, 192, 1000]), min_size=n, max_size=n))
    order = draw(st.permutations(list(range(2 * n))))  # positions of allocs (i) and frees (n + i)
    return sizes, order


@settings(max_examples=30, deadline=None)
@given(periodic_recordings())
def test_replaying_a_steady_state_plan_serves_every_request(ext, case):
    sizes, order = case
    n = len(sizes)

    def step(tensors={}):  # noqa: B006 - the dict carries tensors across iterations
        for e in order:
            if e < n:
                tensors[e] = torch.empty(sizes[e], dtype=torch.uint8)
            else:
                tensors.pop(e - n, None)

    trace = record_step(step, 2)
    plan = plan_steady_state(trace)
    with memplan.planned_allocator(plan, first_iteration=plan.periodic_iteration + 1) as pa:
        for _ in range(3):
            step()
            pa.next_iteration()
    stats = pa.stats
    assert stats["conflicts"] == 0
    assert stats["fallbacks"] == 0
    assert stats["served_planned"] == 3 * n
