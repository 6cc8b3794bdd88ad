"""Offset solvers: greedy, exact search, pack(), the independent validator, the CLI."""

import itertools
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memplan.cli import main
from memplan.errors import UserError
from memplan.layout import LayoutBug, Problem, check_offsets, greedy_offsets, pack
from memplan.layout.generate import tight_instance

EXAMPLE = [(0, 3, 4), (3, 9, 4), (0, 9, 4), (9, 21, 4), (0, 21, 4)]


def brute_force_height(lower, upper, nbytes):
    """Optimum by trying every offset tuple, height by height (tiny problems only)."""
    n = len(nbytes)
    live = max(sum(s for lo, up, s in zip(lower, upper, nbytes) if lo <= t < up) for t in range(max(upper)))
    for height in range(live, sum(nbytes) + 1):
        for offsets in itertools.product(*[range(height - s + 1) for s in nbytes]):
            ok = all(
                not (lower[i] < upper[j] and lower[j] < upper[i])
                or offsets[i] + nbytes[i] <= offsets[j]
                or offsets[j] + nbytes[j] <= offsets[i]
                for i in range(n)
                for j in range(i + 1, n)
            )
            if ok:
                return height
    raise AssertionError("unreachable")


def test_minimalloc_example_packs_into_capacity_12():
    solution = pack(EXAMPLE, capacity=12, minimize=False)
    assert solution.feasible
    lower, upper, nbytes = zip(*EXAMPLE)
    assert check_offsets(lower, upper, nbytes, solution.offsets, capacity=12) <= 12


def test_minimalloc_example_minimum_height_is_12_and_proven():
    solution = pack(EXAMPLE)
    assert (solution.height, solution.lower_bound, solution.status) == (12, 12, "optimal")


def test_capacity_below_the_live_peak_is_proven_infeasible():
    solution = pack(EXAMPLE, capacity=11, minimize=False)
    assert solution.status == "infeasible" and solution.feasible is False
    assert solution.lower_bound == 12 and solution.offsets is None


def test_infeasible_capacity_above_the_live_peak_is_proven_by_search():
    # Every pair overlaps except (a, c); live peak 3, but sizes 2,1,2 in a chain need 4.
    buffers = [(0, 2, 2), (1, 3, 1), (2, 4, 2), (0, 4, 1)]
    solution = pack(buffers, capacity=4, minimize=False)
    assert solution.lower_bound <= 4
    lower, upper, nbytes = zip(*buffers)
    assert solution.feasible == (brute_force_height(lower, upper, nbytes) <= 4)


def test_validator_catches_two_live_buffers_that_overlap():
    with pytest.raises(LayoutBug, match="overlap"):
        check_offsets([0, 1], [2, 3], [4, 4], [0, 2])


def test_validator_accepts_buffers_that_touch_in_time_or_space():
    assert check_offsets([0, 2, 0], [2, 4, 4], [4, 4, 2], [0, 0, 4]) == 6


def test_validator_catches_a_broken_alignment_and_capacity():
    with pytest.raises(LayoutBug, match="alignment"):
        check_offsets([0], [1], [4], [2], alignment=[4])
    with pytest.raises(LayoutBug, match="capacity"):
        check_offsets([0], [1], [4], [2], capacity=5)


def test_alignment_is_honoured():
    solution = pack([(0, 2, 3, 1), (0, 2, 4, 8)])
    assert solution.offsets[1] % 8 == 0
    assert solution.height == 12 or solution.offsets[0] >= 4


def test_greedy_places_largest_first_into_the_best_gap():
    # 8 bytes live [0,10), 4 bytes [0,5): greedy puts 8 at 0 and 4 on top at 8.
    assert greedy_offsets([0, 0], [10, 5], [4, 8]).tolist() == [8, 0]


small_problems = st.lists(
    st.tuples(st.integers(0, 5), st.integers(1, 4), st.integers(1, 3)), min_size=1, max_size=4
).map(lambda rows: [(lo, lo + length, size) for lo, length, size in rows])


@settings(max_examples=40, deadline=None)
@given(small_problems)
def test_exact_height_equals_brute_force_optimum(buffers):
    lower, upper, nbytes = zip(*buffers)
    solution = pack(buffers, time_limit_s=5)
    assert solution.status == "optimal"
    assert solution.height == brute_force_height(lower, upper, nbytes)


problems = st.lists(
    st.tuples(st.integers(0, 30), st.integers(1, 12), st.integers(1, 64), st.sampled_from([1, 1, 4, 16])),
    min_size=1,
    max_size=25,
).map(lambda rows: [(lo, lo + length, size, a) for lo, length, size, a in rows])


@settings(max_examples=60, deadline=None)
@given(problems)
def test_pack_is_valid_bounded_and_no_worse_than_greedy(buffers):
    lower, upper, nbytes, align = (np.array(c) for c in zip(*buffers))
    solution = pack(buffers, time_limit_s=2)
    height = check_offsets(lower, upper, nbytes, solution.offsets, alignment=align)
    assert solution.lower_bound <= height == solution.height
    assert solution.height <= solution.stats["greedy_height"]
    if solution.optimal:
        assert solution.lower_bound == solution.height


@pytest.mark.parametrize("seed", range(4))
def test_exact_proves_the_constructed_optimum_of_tight_instances(seed):
    problem, construction = tight_instance(80, seed=seed)
    check_offsets(problem.lower, problem.upper, problem.nbytes, construction, capacity=problem.capacity)
    solution = pack(problem, time_limit_s=20)
    assert solution.status == "optimal"
    assert solution.height == problem.capacity == solution.lower_bound


def test_at_the_time_limit_the_best_packing_and_a_lower_bound_come_back():
    problem, _ = tight_instance(200, seed=3)
    problem.capacity = None
    solution = pack(problem, time_limit_s=0)
    assert solution.status == "feasible"
    assert solution.height == solution.stats["greedy_height"]
    assert solution.lower_bound == problem.live_lower_bound() < solution.height


def test_deciding_needs_a_capacity():
    with pytest.raises(UserError, match="capacity"):
        pack(EXAMPLE, minimize=False)


def test_bad_rows_are_user_errors():
    with pytest.raises(UserError, match="must be non-empty"):
        pack([(3, 3, 1)])
    with pytest.raises(UserError, match="must be positive"):
        pack([(0, 3, 0)])
    with pytest.raises(UserError, match="power of two"):
        Problem.from_arrays([0], [1], [4], [3])


# -- CLI -------------------------------------------------------------------------------
@pytest.fixture
def example_csv(tmp_path):
    path = tmp_path / "p.csv"
    path.write_text("id,lower,upper,size\n" + "".join(f"b{i},{lo},{up},{s}\n" for i, (lo, up, s) in enumerate(EXAMPLE)))
    return path


def test_cli_pack_prints_the_json_keys_and_writes_offsets(example_csv, tmp_path, capsys):
    out = tmp_path / "out.csv"
    assert main(["pack", str(example_csv), "--json", "-o", str(out)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {"height", "lower_bound", "optimal", "feasible", "elapsed_s"} <= set(doc)
    assert (doc["height"], doc["optimal"], doc["feasible"]) == (12, True, True)
    assert out.read_text().splitlines()[0] == "id,lower,upper,size,offset"


def test_cli_pack_infeasible_capacity_exits_1(example_csv, capsys):
    assert main(["pack", str(example_csv), "--capacity", "11", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["feasible"] is False and doc["lower_bound"] == 12


def test_cli_pack_feasible_capacity_exits_0(example_csv, capsys):
    assert main(["pack", str(example_csv), "--capacity", "12", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["feasible"] is True


def test_cli_pack_bad_csv_exits_2_with_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.csv"
    bad.write_text("id,lower,upper,size\na,0,3,4\na,1,2,4\n")
    assert main(["pack", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "duplicate id" in err and err.count("\n") == 1
