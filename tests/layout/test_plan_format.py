"""The plan file: round trip, periodic lookup, fingerprint check, damaged files."""

import json

import numpy as np
import pytest

from memplan.errors import UserError
from memplan.layout.plan import (
    AddressPlan,
    DynamicWindow,
    IterationPlan,
    load_address_plan,
    requests_by_group,
    save_address_plan,
    trace_fingerprint,
)
from memplan.trace import ALLOC, FREE, from_events


def two_iteration_trace(second_size=20):
    # buffer 0: prologue weight; 1: iteration 0; 2: iteration 1
    trace = from_events(
        [ALLOC, ALLOC, FREE, ALLOC, FREE], [8, 20, second_size], [0, 1, 1, 2, 2]
    )
    trace.buffers["iteration"][:] = [-1, 0, 1]
    return trace


def small_plan(trace):
    return AddressPlan(
        trace_fingerprint=trace_fingerprint(trace, [-1, 0, 1]),
        arena_bytes=28,
        alignment_bytes=1,
        iterations=[
            IterationPlan(-1, np.array([8]), np.array([0])),
            IterationPlan(0, np.array([20]), np.array([8])),
            IterationPlan(1, np.array([20]), np.array([8])),
        ],
        dynamic_space=[DynamicWindow(1, 0, 1, [(0, 0)])],
    )


def test_requests_are_grouped_by_iteration_with_prologue_first():
    groups = requests_by_group(two_iteration_trace())
    assert list(groups) == [-1, 0, 1]
    assert groups[0].tolist() == [1]


def test_plan_round_trips_through_a_file(tmp_path):
    trace = two_iteration_trace()
    plan = small_plan(trace)
    save_address_plan(plan, tmp_path / "p.json")
    again = load_address_plan(tmp_path / "p.json")
    assert again.to_json() == plan.to_json()


def test_iterations_beyond_the_last_replay_the_periodic_one():
    plan = small_plan(two_iteration_trace())
    assert plan.for_iteration(7).iteration == 1
    assert plan.for_iteration(0).iteration == 0
    assert plan.for_iteration(-1).iteration == -1


def test_a_plan_for_another_trace_is_refused():
    plan = small_plan(two_iteration_trace())
    plan.check_belongs_to(two_iteration_trace())
    with pytest.raises(UserError, match="another trace"):
        plan.check_belongs_to(two_iteration_trace(second_size=24))


def test_a_file_that_is_not_a_plan_is_refused(tmp_path):
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"format": "something"}))
    with pytest.raises(UserError, match="not a memplan plan"):
        load_address_plan(path)


def test_an_offset_outside_the_arena_is_refused():
    doc = small_plan(two_iteration_trace()).to_json()
    doc["iterations"][1]["offset"] = [100]
    with pytest.raises(UserError, match="outside"):
        AddressPlan.from_json(doc)
