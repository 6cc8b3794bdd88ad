"""`memplan reorder`: its JSON report, and one-line errors for bad input."""

from __future__ import annotations

import json

import pytest

from memplan import models
from memplan.cli import main

KEYS = {
    "baseline_peak_bytes", "inductor_peak_bytes", "optimized_peak_bytes", "lower_bound_bytes",
    "num_nodes", "elapsed_s", "verified",
}


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "config.json"
    models.tiny_config("gpt2").to_json_file(str(path))
    return str(path)


def test_reorder_json_has_the_issue_keys_and_a_verified_order(tiny_gpt2, capsys):
    code = main(["reorder", tiny_gpt2, "--seq", "8", "--time-limit", "2", "--layout", "--json"])
    out = capsys.readouterr().out
    assert code == 0
    data = json.loads(out)
    assert KEYS <= set(data)
    assert data["verified"] is True
    assert data["num_nodes"] > 100
    assert data["lower_bound_bytes"] <= data["optimized_peak_bytes"] <= data["inductor_peak_bytes"]
    assert data["optimized_peak_bytes"] <= data["baseline_peak_bytes"]
    assert data["layout_peak_bytes"] >= data["optimized_peak_bytes"]  # a packing is never below the live bytes


@pytest.mark.parametrize("limit", ["0", "-1"])
def test_a_time_limit_that_is_not_positive_is_one_line_and_exit_2(tiny_gpt2, capsys, limit):
    code = main(["reorder", tiny_gpt2, "--time-limit", limit, "--json"])
    captured = capsys.readouterr()
    assert code == 2
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and "--time-limit" in captured.err


def test_an_unknown_model_is_one_line_and_exit_2(capsys):
    code = main(["reorder", "no-such-model", "--json"])
    captured = capsys.readouterr()
    assert code == 2
    assert captured.out == ""
    assert captured.err.startswith("memplan: error:")
