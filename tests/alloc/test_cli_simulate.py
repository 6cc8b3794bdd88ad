"""`memplan simulate`: JSON keys, tables, bad input, snapshot input."""

from __future__ import annotations

import json

import numpy as np
import pytest

from memplan.cli import main
from memplan.trace import ALLOC, FREE, from_events, save

MiB = 1 << 20


@pytest.fixture
def trace_path(tmp_path):
    kinds = np.array([ALLOC, ALLOC, FREE, ALLOC, FREE, FREE])
    trace = from_events(kinds, np.array([4 * MiB, 4 * MiB, 13 * MiB]), np.array([0, 1, 0, 2, 1, 2]))
    path = tmp_path / "step.memtrace"
    save(trace, path)
    return path


def run_json(capsys, *argv: str) -> dict:
    assert main(["simulate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_has_the_documented_keys(trace_path, capsys) -> None:
    out = run_json(capsys, str(trace_path))
    for key in ("peak_requested_bytes", "peak_allocated_bytes", "peak_reserved_bytes",
                "fragmentation", "segments", "oom"):
        assert key in out
    assert out["peak_reserved_bytes"] == 34 * MiB  # 20 MiB segment + 14 MiB segment
    assert out["oom"] is None


def test_capacity_sizes_and_oom_in_json(trace_path, capsys) -> None:
    out = run_json(capsys, str(trace_path), "--capacity", "30MiB")
    assert out["oom"]["event"] == 3 and out["oom"]["request_bytes"] == 13 * MiB


@pytest.mark.parametrize("allocator", ["expandable", "ideal"])
def test_other_allocators(trace_path, capsys, allocator: str) -> None:
    out = run_json(capsys, str(trace_path), "--allocator", allocator)
    assert out["allocator"] == allocator
    assert out["peak_reserved_bytes"] >= out["peak_requested_bytes"] == 17 * MiB


def test_table_output(trace_path, capsys) -> None:
    assert main(["simulate", str(trace_path), "--alloc-conf", "max_split_size_mb:20"]) == 0
    out = capsys.readouterr().out
    assert "peak reserved" in out and "fragmentation" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--alloc-conf", "max_split_size_mb:10"], "max_split_size_mb"),
        (["--allocator", "buddy"], "unknown allocator"),
        (["--capacity", "lots"], "cannot read size"),
        (["--allocator", "planned"], "--plan"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(trace_path, capsys, argv, message) -> None:
    assert main(["simulate", str(trace_path), *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert message in captured.err and captured.err.count("\n") == 1


def test_missing_trace_file_is_exit_2(tmp_path, capsys) -> None:
    assert main(["simulate", str(tmp_path / "nope.memtrace")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_snapshot_pickle_is_accepted(tmp_path, capsys) -> None:
    snapshot = pytest.importorskip("memplan.trace.snapshot")
    kinds = np.array([ALLOC, ALLOC, FREE, FREE])
    trace = from_events(kinds, np.array([1024, 5 * MiB]), np.array([0, 1, 0, 1]))
    trace.devices = ["cuda:0"]
    path = tmp_path / "snap.pickle"
    snapshot.save_snapshot(trace, path)
    out = run_json(capsys, str(path))
    assert out["peak_requested_bytes"] == 1024 + 5 * MiB
    assert out["peak_reserved_bytes"] == 22 * MiB
