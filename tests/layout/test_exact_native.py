"""The compiled exact search against the Python reference it ports, node for node."""

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memplan.layout import check_offsets, native, pack
from memplan.layout.exact import FOUND, NOT_FOUND, TIMEOUT, solve_exact
from memplan.layout.generate import tight_instance

pytestmark = pytest.mark.skipif(bool(native.missing_build_tools()), reason="no C++ compiler or ninja")

problems = st.lists(
    st.tuples(st.integers(0, 20), st.integers(1, 10), st.integers(1, 32), st.sampled_from([1, 1, 2, 8])),
    min_size=1,
    max_size=16,
).map(lambda rows: [(lo, lo + length, size, a) for lo, length, size, a in rows])


def _columns(buffers):
    return tuple(np.array(c, dtype=np.int64) for c in zip(*buffers))


@settings(max_examples=60, deadline=None)
@given(problems, st.integers(0, 40))
def test_native_and_python_engines_agree_on_status_and_nodes(buffers, slack):
    lower, upper, nbytes, align = _columns(buffers)
    live = max(int(nbytes[(lower <= t) & (t < upper)].sum()) for t in range(int(upper.max())))
    capacity = live + slack // 4
    # A node budget, not a clock, bounds the search: a few of these small infeasible
    # instances take half a million nodes to prove, and both engines must stop at the
    # same node however loaded the machine is.
    deadline = time.monotonic() + 3600
    results = {
        engine: solve_exact(
            lower, upper, nbytes, align, capacity, deadline=deadline, heuristics=("WZ",), engine=engine,
            max_nodes=20_000,
        )
        for engine in ("python", "native")
    }
    (py_status, py_offsets, py_stats), (c_status, c_offsets, c_stats) = results["python"], results["native"]
    assert c_status == py_status in (FOUND, NOT_FOUND, TIMEOUT)
    assert c_stats["nodes"] == py_stats["nodes"] <= 20_001
    if c_status == FOUND:
        assert np.array_equal(c_offsets, py_offsets)
        check_offsets(lower, upper, nbytes, c_offsets, alignment=align, capacity=capacity)


def test_a_node_budget_stops_both_engines_at_the_same_node():
    # 12 buffers at exactly their live peak: infeasible, and proving it takes ~514,000 nodes.
    buffers = [(0, 4, 12, 1), (0, 10, 32, 1), (8, 14, 18, 1), (0, 3, 30, 1), (18, 25, 26, 1), (17, 23, 28, 8),
               (17, 24, 6, 8), (11, 19, 18, 8), (10, 11, 1, 1), (0, 6, 28, 1), (14, 20, 19, 8), (14, 19, 1, 1)]
    lower, upper, nbytes, align = _columns(buffers)
    for engine in ("python", "native"):
        status, offsets, stats = solve_exact(
            lower, upper, nbytes, align, 102, deadline=time.monotonic() + 3600, heuristics=("WZ",), engine=engine,
            max_nodes=1000,
        )
        assert (status, offsets, stats["nodes"]) == (TIMEOUT, None, 1001)


def test_native_engine_follows_the_python_search_on_a_tight_instance():
    problem, _ = tight_instance(200, seed=4)
    args = (problem.lower, problem.upper, problem.nbytes, problem.alignment, problem.capacity)
    deadline = time.monotonic() + 60
    _, _, py_stats = solve_exact(*args, deadline=deadline, heuristics=("WZ",), engine="python")
    _, _, c_stats = solve_exact(*args, deadline=deadline, heuristics=("WZ",), engine="native")
    assert c_stats["nodes"] == py_stats["nodes"] > 200


def test_pack_uses_the_native_engine_and_proves_a_350_buffer_tight_instance_within_5_s():
    problem, _ = tight_instance(350, seed=3)
    optimum = problem.capacity
    problem.capacity = None
    solution = pack(problem, time_limit_s=5)
    assert solution.stats["engine"] == "native"
    assert solution.status == "optimal" and solution.height == optimum
