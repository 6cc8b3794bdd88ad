"""`memplan rl`: the phase table in 80 columns, one JSON object, refusals in one line."""

import json

import pytest

from memplan.cli import main
from memplan.models.registry import tiny_config


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-qwen2")
    config = tiny_config("qwen2.5-0.5b", max_position_embeddings=4096)
    config.save_pretrained(directory)
    return str(directory / "config.json")


def test_the_phase_table_and_verdict_fit_80_columns(tiny, capsys):
    code = main(["rl", tiny, "--prompt-len", "32", "--completion-len", "32", "--num-generations", "1",
                 "--gpu", "h100-80gb"])
    out = capsys.readouterr().out
    assert code == 0 and "rollout (vLLM generate)" in out and "fits:" in out
    assert max(len(line) for line in out.splitlines()) <= 80


def test_json_is_one_object_with_every_phase(tiny, capsys):
    code = main(["rl", tiny, "--prompt-len", "32", "--completion-len", "32", "--num-generations", "1", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["peak_phase"] in {p["name"] for p in result["phases"]}
    assert [p["name"] for p in result["phases"]][0] == "engine start (step 1)"


def test_an_engine_whose_budget_and_the_trainers_residents_exceed_the_gpu_fails_engine_start_exit_0(tiny, capsys):
    code = main(["rl", tiny, "--prompt-len", "32", "--completion-len", "32", "--num-generations", "1",
                 "--vllm-gpu-memory-utilization", "0.999", "--json"])
    result = json.loads(capsys.readouterr().out)
    start = result["phases"][0]
    assert code == 0 and not result["fits"] and result["failing_phase"] == "engine start (step 1)"
    assert start["fails"].startswith("Free memory on device")


def test_a_sleep_level_with_a_server_rollout_is_one_line_and_exit_2(tiny, capsys):
    code = main(["rl", tiny, "--rollout", "vllm-server", "--sleep-level", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--sleep-level applies to a colocated vLLM engine" in err[0]


def test_a_sleep_level_the_trainer_does_not_have_is_refused(tiny, capsys):
    code = main(["rl", tiny, "--trainer", "trl", "--sleep-level", "1"])
    assert code == 2 and "sleeps its engine at level 2" in capsys.readouterr().err


def test_what_fits_finds_the_highest_lower_utilization_that_fits(tiny, capsys):
    code = main(["rl", tiny, "--prompt-len", "32", "--completion-len", "32", "--num-generations", "1",
                 "--vllm-gpu-memory-utilization", "0.95", "--what-fits", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and not result["fits"]
    changes = [c["change"] for c in result["what_fits"]]
    assert "gpu_memory_utilization 0.9" in changes and all(c["fits"] for c in result["what_fits"])
