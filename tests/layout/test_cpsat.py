"""CP-SAT, the exact portfolio's third engine: its answers, and how the portfolio stops."""

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from layout_cases import README_EXAMPLE, at_live_peak_plus, columns, problems

from memplan.layout import check_offsets, cpsat, exact, native
from memplan.layout.exact import FOUND, NOT_FOUND, OFFSET_ORDER_HEURISTICS, TIMEOUT, solve_exact
from memplan.layout.generate import tight_instance
from memplan.native import missing_build_tools

pytestmark = pytest.mark.skipif(not cpsat.available(), reason="OR-Tools is not installed")
needs_native = pytest.mark.skipif(bool(missing_build_tools()), reason="no C++ compiler or ninja")

def test_cpsat_packs_minimallocs_example_in_12_and_proves_11_infeasible():
    lower, upper, nbytes, align = columns(README_EXAMPLE)
    model = cpsat.Decision(lower, upper, nbytes, align, 12)
    assert model.solve(30) == FOUND
    assert check_offsets(lower, upper, nbytes, model.offsets, capacity=12) == 12
    assert cpsat.Decision(lower, upper, nbytes, align, 11).solve(30) == NOT_FOUND


def test_cpsat_places_aligned_buffers_at_multiples_of_their_alignment():
    # Sizes 3 with alignment 8: two buffers live together need offsets 0 and 8.
    lower, upper, nbytes, align = columns([(0, 2, 3, 8), (1, 3, 3, 8)])
    model = cpsat.Decision(lower, upper, nbytes, align, 11)
    assert model.solve(30) == FOUND
    assert sorted(model.offsets.tolist()) == [0, 8]
    assert cpsat.Decision(lower, upper, nbytes, align, 10).solve(30) == NOT_FOUND


def test_cpsat_works_in_units_of_the_common_divisor_and_returns_bytes():
    problem, _ = tight_instance(60, seed=1)  # sizes in 1 KiB quanta
    model = cpsat.Decision(problem.lower, problem.upper, problem.nbytes, problem.alignment, problem.capacity)
    assert model.unit == 1024
    assert model.solve(30) == FOUND
    check_offsets(problem.lower, problem.upper, problem.nbytes, model.offsets, capacity=problem.capacity)


def test_a_stopped_cpsat_model_does_not_start():
    lower, upper, nbytes, align = columns(README_EXAMPLE)
    model = cpsat.Decision(lower, upper, nbytes, align, 12)
    model.stop()
    assert model.solve(30) == TIMEOUT and model.offsets is None


@needs_native
@settings(max_examples=50, deadline=None)
@given(problems(max_size=12), st.integers(0, 40))
def test_cpsat_answers_as_the_skyline_search_does(buffers, slack):
    # Two unrelated complete methods must agree on feasibility at the live peak plus slack.
    lower, upper, nbytes, align, capacity = at_live_peak_plus(buffers, slack)
    skyline, _, _ = solve_exact(lower, upper, nbytes, align, capacity, deadline=time.monotonic() + 3600,
                                engine="native", max_nodes=200_000)
    if skyline == TIMEOUT:
        return
    model = cpsat.Decision(lower, upper, nbytes, align, capacity)
    status = model.solve(60)
    assert status == skyline
    if status == FOUND:
        check_offsets(lower, upper, nbytes, model.offsets, alignment=align, capacity=capacity)


@needs_native
def test_a_set_stop_token_stops_the_compiled_portfolio_at_once():
    problem, _ = tight_instance(450, seed=6)  # neither compiled search solves it in 5 s
    ext = native.extension()
    token = ext.StopToken()
    token.set()
    status, offsets, nodes, _, engine = ext.solve_portfolio(
        problem.lower.tolist(), problem.upper.tolist(), problem.nbytes.tolist(), problem.alignment.tolist(),
        int(problem.capacity), 60.0, ["WZ"], list(OFFSET_ORDER_HEURISTICS), 1 << 62, token, 60.0, True,
    )
    assert (status, offsets, engine) == (TIMEOUT, [], -1)
    assert nodes <= 2 * 256  # each thread checks the token every 256 nodes


@needs_native
def test_the_portfolio_takes_cpsats_packing_where_the_compiled_searches_stall(monkeypatch):
    # 450 buffers cut from a rectangle: CP-SAT packs it in about a second on one core;
    # the skyline search held to one order (no restarts, no time-reversed run) and the
    # offset-order search do not within 15 s. CP-SAT runs with a core of its own.
    monkeypatch.setattr(exact, "usable_cores", lambda: exact.CPSAT_MIN_CORES)
    problem, _ = tight_instance(450, seed=8)
    status, offsets, stats = solve_exact(
        problem.lower, problem.upper, problem.nbytes, problem.alignment, problem.capacity,
        deadline=time.monotonic() + 60, heuristics=("WZ",), engine="portfolio",
    )
    assert status == FOUND and stats["engine"] == "portfolio: cp-sat"
    check_offsets(problem.lower, problem.upper, problem.nbytes, offsets, capacity=problem.capacity)


@needs_native
@pytest.mark.parametrize("cores, with_cpsat", [(2, False), (3, True)])
def test_cpsat_joins_the_portfolio_only_with_a_core_of_its_own(monkeypatch, cores, with_cpsat):
    monkeypatch.setattr(exact, "usable_cores", lambda: cores)
    problem, _ = tight_instance(150, seed=0)
    status, _, stats = solve_exact(
        problem.lower, problem.upper, problem.nbytes, problem.alignment, problem.capacity,
        deadline=time.monotonic() + 30, engine="portfolio",
    )
    assert status == FOUND
    assert ("cpsat_branches" in stats) is with_cpsat


def test_the_common_unit_keeps_alignments_that_divide_it_and_shrinks_for_others():
    assert cpsat.common_unit([3072, 6144], [1, 1024]) == 3072  # 1024 divides 3072: any multiple is aligned
    assert cpsat.common_unit([3072, 6144], [4096]) == 1024  # 4096 does not: gcd(3072, 4096)
    assert cpsat.common_unit([12, 24], [8]) == 4
    assert cpsat.common_unit([5, 7], [1]) == 1
