"""minimalloc's CSV format: reading, aliases, writing back, and every bad-input message."""

import numpy as np
import pytest

from memplan.errors import UserError
from memplan.layout.minimalloc_csv import (
    problem_from_trace,
    read_csv,
    read_csv_text,
    to_csv_text,
    write_csv,
)
from memplan.trace import ALLOC, FREE, from_events

EXAMPLE = "id,lower,upper,size\nb1,0,3,4\nb2,3,9,4\nb3,0,9,4\nb4,9,21,4\nb5,0,21,4\n"


def test_reads_the_example_problem():
    problem, offsets = read_csv_text(EXAMPLE)
    assert problem.ids == ["b1", "b2", "b3", "b4", "b5"]
    assert problem.lower.tolist() == [0, 3, 0, 9, 0]
    assert problem.upper.tolist() == [3, 9, 9, 21, 21]
    assert problem.nbytes.tolist() == [4] * 5
    assert offsets is None


def test_end_column_is_an_inclusive_upper_and_aliases_are_accepted():
    problem, _ = read_csv_text("buffer_id,start,end,size\na,0,2,8\n")
    assert problem.ids == ["a"]
    assert (problem.lower[0], problem.upper[0]) == (0, 3)
    problem, _ = read_csv_text("buffer,begin,upper,size\na,5,6,8\n")
    assert (problem.lower[0], problem.upper[0]) == (5, 6)


def test_gaps_are_parsed_and_lower_the_bound():
    problem, _ = read_csv_text("id,lower,upper,size,gaps\na,0,10,8,2-5\nb,3,4,8,\n")
    assert problem.gaps[0][0].lower == 2 and problem.gaps[0][0].upper == 5
    # a is inactive over [2, 5), so a and b never need 16 bytes together
    assert problem.live_lower_bound() == 8


def test_offsets_round_trip_and_unknown_columns_are_kept(tmp_path):
    problem, _ = read_csv_text("id,lower,upper,size,note\na,0,2,8,x\nb,1,3,4,y\n")
    path = tmp_path / "out.csv"
    write_csv(path, problem, np.array([0, 8]))
    again, offsets = read_csv(path)
    assert offsets.tolist() == [0, 8]
    assert again.extra_columns == {"note": ["x", "y"]}
    assert to_csv_text(again, offsets) == path.read_text()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("id,lower,size\na,0,4\n", "missing column.*upper"),
        ("id,lower,upper,size\na,3,3,4\n", r"row 2, column upper: upper 3 <= lower 3"),
        ("id,lower,upper,size\na,0,3,0\n", "row 2, column size: size 0 must be positive"),
        ("id,lower,upper,size\na,0,3,-4\n", "row 2, column size: size -4"),
        ("id,lower,upper,size\na,0,3,4\na,1,2,4\n", "row 3, column id: duplicate id 'a'"),
        ("id,lower,upper,size,alignment\na,0,3,4,3\n", "row 2, column alignment: 3 is not a power of two"),
        ("id,lower,upper,size,alignment,hint\na,0,3,4,4,6\n", "row 2, column hint: 6 is not"),
        ("id,lower,upper,size,alignment,offset\na,0,3,4,8,4\n", "row 2, column offset: 4 is not"),
        ("id,lower,upper,size\na,0,x,4\n", "row 2, column upper: 'x' is not an integer"),
        ("id,lower,upper,size\na,0,3\n", "row 2: 3 fields for 4 columns"),
        ("", "empty"),
    ],
)
def test_bad_input_names_row_and_column(text, message):
    with pytest.raises(UserError, match=message):
        read_csv_text(text)


def test_missing_file_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        read_csv(tmp_path / "nope.csv")


def test_a_trace_becomes_half_open_event_lifetimes():
    # buffer 0 alloc at 0, freed at 2; buffer 1 alloc at 1, never freed (3 events)
    trace = from_events([ALLOC, ALLOC, FREE], [16, 32], [0, 1, 0])
    problem = problem_from_trace(trace)
    assert problem.lower.tolist() == [0, 1]
    assert problem.upper.tolist() == [2, 3]
    assert problem.nbytes.tolist() == [16, 32]
