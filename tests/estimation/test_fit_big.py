"""`memplan fit` on real model sizes: the answer, estimated again with the `memplan estimate`
command fit printed, fits within the margin. Traced on fake tensors with block
extrapolation, these take minutes on two cores (tiny-config round trips of the same
commands are in test_fit.py).

Marked `slow`; they run only where MEMPLAN_BIG_FIT_TESTS=1 is set, because the default
suite (`pytest -q`, which runs slow tests too) must stay within its time on two cores."""

import json
import os
import shlex

import pytest

from memplan.cli import main

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("MEMPLAN_BIG_FIT_TESTS") != "1",
                       reason="minutes on two cores: set MEMPLAN_BIG_FIT_TESTS=1"),
]


def _fit(capsys, *argv):
    code = main(["fit", *argv, "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def _estimate_again(capsys, command):
    argv = shlex.split(command)
    assert argv[:2] == ["memplan", "estimate"]
    assert main([*argv[1:], "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_llama_3_1_8b_lora_max_seq_on_one_rtx4090(capsys):
    # fp32 weights (PyTorch's default dtype, the setup's) are 32 GB: nothing fits a 24 GB card
    doc = _fit(capsys, "llama-3.1-8b", "--gpu", "rtx4090", "--gpus", "1", "--lora-rank", "16", "--max", "seq")
    assert doc["max"] is None and doc["probes"][0]["value"] == doc["step"] and not doc["probes"][0]["fits"]
    # in bf16 the base fits, and the answer round-trips
    doc = _fit(capsys, "llama-3.1-8b", "--gpu", "rtx4090", "--gpus", "1", "--lora-rank", "16", "--precision", "bf16-true",
               "--max", "seq")
    assert doc["max"] is not None and doc["limit"] in ("memory", "positions")
    again = _estimate_again(capsys, doc["at"]["command"])
    assert again["device_used_bytes"] == doc["at"]["device_used_bytes"] <= doc["at"]["usable_bytes"]
    if doc["limit"] == "memory":
        assert not doc["above"]["fits"] and doc["above"]["setup"]["seq"] == doc["max"] + doc["step"]


def test_llama_3_1_70b_fewest_h100s_at_seq_8192(capsys):
    doc = _fit(capsys, "llama-3.1-70b", "--gpu", "h100-80gb", "--gpus", "auto", "--seq", "8192")
    assert doc["gpus"] is not None and doc["configurations"]
    top = doc["configurations"][0]
    again = _estimate_again(capsys, top["command"])
    assert again["device_used_bytes"] == top["device_used_bytes"] <= top["usable_bytes"]
    if doc["below"] is not None:
        assert not doc["below"]["fits"] and doc["below"]["world_size"] < doc["gpus"]


def test_llama_3_1_8b_full_fine_tune_on_one_rtx4090_fits_on_that_gpu_within_a_minute(capsys):
    # before: 224 s, and "8 GPUs, TP 8" first (4090s have no NVLink or peer-to-peer)
    doc = _fit(capsys, "llama-3.1-8b", "--gpu", "rtx4090", "--gpus", "1", "--precision", "bf16-true", "--what-fits")
    assert not doc["base"]["fits"] and doc["configurations"]
    assert all(row["world_size"] == 1 and row["tp"] == 1 for row in doc["configurations"])
    assert doc["search"]["wall_s"] <= 60
    top = doc["configurations"][0]
    again = _estimate_again(capsys, top["command"])
    assert again["device_used_bytes"] == top["device_used_bytes"] <= top["usable_bytes"]
