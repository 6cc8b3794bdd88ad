"""`--from FILE`, `--trust-remote-code` and `--gpu list` on the command line.

Models come from a tiny config.json, or by Hub id from a pre-filled offline Hub cache
(tests/models/test_hub.py builds it the same way): tiny configs, batch 2, seq 32.
"""

import json
from pathlib import Path

import pytest
from huggingface_hub import constants

from memplan.cli import build_parser, main
from memplan.hardware import list_devices
from memplan.models import tiny_config

DATA = Path(__file__).resolve().parents[1] / "data" / "trainer_configs"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
SMALL = ["--batch", "2", "--seq", "32"]


@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "tiny-llama.json"
    tiny_config("llama-2-7b").to_json_file(str(path))
    return str(path)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """Offline Hub cache holding a tiny Llama under axolotl's example base model id."""
    folder = tmp_path / "hub" / "models--meta-llama--Llama-3.1-8B-Instruct"
    (folder / "snapshots" / COMMIT).mkdir(parents=True)
    (folder / "snapshots" / COMMIT / "config.json").write_text(json.dumps(tiny_config("llama-3.1-8b").to_dict()))
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(COMMIT)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return tmp_path


def run_json(capsys, argv):
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out), err


def test_every_subcommand_that_takes_a_model_has_the_model_input_flags():
    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command").choices
    for name in ("trace", "reorder", "estimate", "fit", "offload"):
        options = {o for a in subparsers[name]._actions for o in a.option_strings}
        assert {"--from", "--trust-remote-code"} <= options, name


def test_accelerate_fsdp_file_sets_the_layout_and_autocast(capsys, tiny):
    result, err = run_json(capsys, ["estimate", tiny, "--from", str(DATA / "accelerate_fsdp.yaml"), *SMALL,
                                    "--json"])
    assert result["layout"]["world_size"] == 2 and result["layout"]["zero"] == 3
    assert result["setup"]["precision"] == "bf16-mixed" and result["parallel"] == "traced"
    assert result["from"]["format"] == "accelerate"
    assert result["from"]["used"]["num_processes"] == "world_size=2"
    assert "fsdp_config.fsdp_state_dict_type" in result["from"]["ignored"]
    assert "used num_processes: world_size=2" in err and "ignored" in err


def test_a_flag_on_the_command_line_wins_over_the_file_and_says_so(capsys, tiny):
    result, err = run_json(capsys, ["estimate", tiny, "--from", str(DATA / "accelerate_fsdp.yaml"), *SMALL,
                                    "--world-size", "4", "--precision", "32-true", "--json"])
    assert result["layout"]["world_size"] == 4 and result["setup"]["precision"] == "32-true"
    assert set(result["from"]["overridden"]) == {"world_size", "precision"}
    assert "world_size: --world-size 4 (command line) over 2 (file)" in err


def test_axolotl_file_names_the_model_by_hub_id(capsys, hub_cache):
    result, err = run_json(capsys, ["estimate", "--from", str(DATA / "axolotl_fft_fsdp.yml"), "--world-size", "2",
                                    *SMALL, "--json"])
    assert result["model"] == "meta-llama/Llama-3.1-8B-Instruct"
    assert result["layout"]["zero"] == 3 and result["setup"]["precision"] == "bf16-true" and result["setup"]["autocast"] == "bf16"
    assert result["setup"]["attn"] == "flash" and result["setup"]["optimizer"] == "adamw"
    assert result["from"]["overridden"]["seq"].startswith("--seq 32 (command line) over 8192")


def test_what_the_file_leaves_to_the_launcher_must_be_given(capsys, hub_cache):
    code = main(["estimate", "--from", str(DATA / "axolotl_fft_fsdp.yml"), *SMALL])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("memplan: error:") and "give --world-size N" in err[-1]


def test_no_model_anywhere_is_one_line(capsys):
    code = main(["estimate", "--from", str(DATA / "accelerate_fsdp.yaml")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "a model is required" in err[-1]


def test_a_subcommand_without_layout_flags_leaves_the_layout_out(capsys, tiny, tmp_path):
    out = tmp_path / "step.memtrace"
    result, _ = run_json(capsys, ["trace", tiny, "--from", str(DATA / "accelerate_fsdp.yaml"), *SMALL,
                                  "-o", str(out), "--json"])
    assert out.exists()
    report = result["from"]
    assert report["layout"] == {} and "num_processes" in report["ignored"]
    assert "no parallel-layout flags" in report["ignored"]["num_processes"]
    assert report["used"]["mixed_precision"].startswith("autocast=bf16 (traced as FSDP2's MixedPrecisionPolicy")


def test_gpu_list_prints_every_profile(capsys):
    result, _ = run_json(capsys, ["estimate", "--gpu", "list", "--json"])
    assert [g["gpu"] for g in result["gpus"]] == list_devices()
    assert all(g["source"] and g["capacity_bytes"] > 0 for g in result["gpus"])
    assert main(["estimate", "--gpu", "list"]) == 0
    table = capsys.readouterr().out
    for name in list_devices():
        assert name in table


def test_rocm_profile_refuses_sdpa_and_estimates_eager_with_a_context(capsys, tiny):
    code = main(["estimate", tiny, *SMALL, "--gpu", "mi300x"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "--attn eager" in err[-1]
    flags = [tiny, *SMALL, "--attn", "eager", "--cuda-context", "1GiB", "--json"]
    mi300x, _ = run_json(capsys, ["estimate", *flags, "--gpu", "mi300x"])
    a100, _ = run_json(capsys, ["estimate", *flags, "--gpu", "a100-80gb"])
    # the same step; only the BLAS workspace differs: hipBLASLt's 76 MiB against cuBLAS's 8,519,680 B
    assert mi300x["peak_allocated_bytes"] - a100["peak_allocated_bytes"] == 76 * 2**20 - 8_519_680
    assert mi300x["device_used_bytes"] - mi300x["peak_reserved_bytes"] == 2**30
