"""`memplan estimate` on the command line: JSON keys, and one-line errors with exit code 2."""

import json
import shlex

import pytest

from memplan.cli import main

TINY = ["--seq", "32"]


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_estimate_json_has_the_issue_keys(capsys):
    code, out, _ = run_cli(capsys, "estimate", "gpt2", *TINY, "--gpu", "t4", "--json")
    assert code == 0
    data = json.loads(out)
    for key in ("model", "parameters", "setup", "per_rank", "peak_allocated_bytes", "peak_reserved_bytes",
                "device_used_bytes", "capacity_bytes", "fits", "elapsed_s"):
        assert key in data
    rank = data["per_rank"][0]
    assert set(rank) >= {"rank", "peak_allocated_bytes", "peak_reserved_bytes", "device_used_bytes", "breakdown",
                         "peak_phase"}
    assert set(rank["breakdown"]) == {"parameters", "gradients", "optimizer_state", "activations", "temporaries",
                                      "other"}
    assert sum(rank["breakdown"].values()) == rank["peak_allocated_bytes"]
    assert data["peak_allocated_bytes"] <= data["peak_reserved_bytes"] < data["device_used_bytes"]
    assert data["fits"] is True and data["parameters"] == 124439808


@pytest.mark.parametrize(("argv", "message"), [
    (["--world-size", "6", "--tp", "4"], "not divisible by tp"),
    (["--tp", "5"], "does not divide the 12 attention heads"),
    (["--gpu", "h1000"], "unknown GPU 'h1000': did you mean h100-80gb"),
    (["--capacity", "80 parsecs"], "cannot read size"),
    (["--zero", "4"], "invalid choice: 4"),
    (["--allocator", "buddy"], "unknown allocator"),
    (["--cuda-context", "lots"], "cannot read size"),
    (["--quant", "nf4"], "full fine-tuning cannot train nf4-quantised weights: add --lora-rank R"),
    (["--quant", "int8", "--lora-rank", "4"], "--quant int8 is estimated for --device cpu only"),
    (["--quant", "int8", "--lora-rank", "4", "--lora-targets", "c_attn", "--dora", "--device", "cpu"],
     "--dora with --quant int8"),
    (["--quant", "nf4", "--lora-rank", "4", "--world-size", "2", "--zero", "3"], "not traced over bitsandbytes"),
    (["--lora-rank", "4", "--lora-targets", "all-linear,c_attn"], "all-linear is peft's name"),
    (["--cpu-offload", "params", "--world-size", "2"], "add --zero 3"),
    (["--cpu-offload", "optimizer", "--world-size", "2"], "add --zero 2 or 3"),
    (["--optimizer-in-backward", "--grad-accum", "2"], "use --grad-accum 1"),
    (["--optimizer", "paged-adamw8bit", "--device", "cpu"], "use --optimizer adamw8bit with --device cpu"),
])
def test_bad_input_is_one_line_on_stderr_and_exit_code_2(capsys, argv, message):
    import re

    code, out, err = run_cli(capsys, "estimate", "gpt2", *TINY, *argv)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and re.search(message, err)


def test_kv_heads_that_tp_does_not_divide_are_refused(capsys):
    code, _, err = run_cli(capsys, "estimate", "llama-3-8b", "--seq", "32", "--tp", "16")
    assert code == 2 and "8 key/value heads" in err


def test_capacity_below_the_estimate_does_not_fit(capsys):
    code, out, _ = run_cli(capsys, "estimate", "gpt2", *TINY, "--capacity", "1GiB", "--json")
    data = json.loads(out)
    assert code == 0 and data["capacity_bytes"] == 2**30 and data["fits"] is False


def test_estimate_json_says_whether_the_layout_was_traced_or_modelled(capsys):
    code, out, _ = run_cli(capsys, "estimate", "llama-2-7b", *TINY, "--world-size", "2", "--zero", "3",
                           "--device", "cpu", "--json")
    assert code == 0 and json.loads(out)["parallel"] == "traced"
    code, out, _ = run_cli(capsys, "estimate", "llama-2-7b", *TINY, "--world-size", "2", "--zero", "3",
                           "--device", "cpu", "--modelled-layout", "--json")
    assert code == 0 and json.loads(out)["parallel"] == "modelled"


def test_a_given_cuda_context_replaces_the_profile_s_in_device_used(capsys):
    _, out, _ = run_cli(capsys, "estimate", "gpt2", *TINY, "--gpu", "v100-16gb", "--json")
    profile = json.loads(out)
    _, out, _ = run_cli(capsys, "estimate", "gpt2", *TINY, "--gpu", "v100-16gb", "--cuda-context", "1343MiB", "--json")
    eager = json.loads(out)
    from memplan.hardware.devices import device_profile

    context = device_profile("v100-16gb").cuda_context_bytes
    assert eager["device_used_bytes"] - profile["device_used_bytes"] == 1343 * 2**20 - context
    assert eager["peak_reserved_bytes"] == profile["peak_reserved_bytes"]


def test_a_quantised_factory_model_is_refused_in_one_line(capsys, tmp_path, monkeypatch):
    (tmp_path / "memplan_cli_quant_factory.py").write_text(
        "import torch\ndef make():\n    return torch.nn.Sequential(torch.nn.Linear(4, 4))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code, out, err = run_cli(capsys, "estimate", "memplan_cli_quant_factory:make", "--quant", "nf4",
                             "--lora-rank", "4", "--lora-targets", "0")
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "the factory 'memplan_cli_quant_factory:make'" in err


def test_lora_targets_that_match_nothing_are_refused_before_anything_is_quantised(capsys):
    code, out, err = run_cli(capsys, "estimate", "gpt2", *TINY, "--quant", "nf4", "--lora-rank", "4",
                             "--lora-targets", "q_proj")
    assert code == 2 and out == ""
    assert "LoRA target q_proj matches no module of GPT2LMHeadModel" in err.strip().splitlines()[-1]


def test_host_memory_is_reported_apart_from_the_device_in_json_and_in_the_table(capsys):
    """torchao's CPUOffloadOptimizer on one GPU: the offloaded state is host memory."""
    from memplan import models
    from memplan.cli.estimate import render
    from memplan.estimation import estimate

    result = estimate("llama-2-7b", models.TrainingSetup(precision="32-true", seq=32, cpu_offload="optimizer"))
    data = result.to_json()
    rank = data["per_rank"][0]
    assert data["host_peak_bytes"] == rank["host_peak_bytes"] > 0
    assert rank["host_peak_bytes"] == sum(rank[f"host_{k}_bytes"] for k in ("pinned", "pageable", "managed"))
    assert rank["host_pinned_bytes"] > 0 and rank["host_managed_bytes"] == 0
    render(result)
    assert "host memory (not in the device figures)" in capsys.readouterr().out


def test_a_job_that_does_not_fit_ends_with_the_cheapest_change_that_does_and_its_command(tmp_path, capsys):
    path = tmp_path / "tiny-llama.json"
    from memplan import models

    models.tiny_config("llama-2-7b").to_json_file(str(path))
    argv = ["estimate", str(path), "--seq", "64", "--batch", "16", "--gpu", "t4", "--capacity", "360MiB"]
    code, out, _ = run_cli(capsys, *argv, "--suggest", "4")
    assert code == 0 and "does NOT fit: needs " in out and "usable (360 MiB, 5% margin)" in out
    assert "cheapest change that fits: " in out and "memplan estimate " in out
    code, out, _ = run_cli(capsys, *argv, "--suggest", "4", "--json")
    suggestion = json.loads(out)["suggestion"]
    assert suggestion["found"] and suggestion["estimates"] <= 4
    assert suggestion["device_used_bytes"] <= suggestion["usable_bytes"]
    command = shlex.split(suggestion["command"])
    code, out, _ = run_cli(capsys, *command[1:], "--json", "--suggest", "0")
    again = json.loads(out)
    assert again["fits"] and again["device_used_bytes"] == suggestion["device_used_bytes"]
    assert again["suggestion"] is None
