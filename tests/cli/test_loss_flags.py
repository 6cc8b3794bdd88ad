"""The loss and activation-offloading flags on the command line: estimates, and the
combinations that cannot run refused in one line (exit 2)."""

import json

import pytest

from memplan.cli import main

TINY = ["--batch", "2", "--seq", "16", "--device", "cpu", "--allocator", "none", "--json"]


@pytest.fixture
def config(tmp_path):
    from memplan.models import tiny_config

    path = tmp_path / "config.json"
    tiny_config("llama-2-7b").to_json_file(str(path))
    return str(path)


@pytest.mark.parametrize(("flags", "message"), [
    (["--head", "seq-cls", "--loss", "fused-linear"], "use --loss full"),
    (["--head", "seq-cls", "--loss", "chunked"], "use --loss full"),
    (["--loss", "chunked:x"], "chunked:N"),
    (["--loss", "fused-linear", "--world-size", "2", "--tp", "2"], "use --loss chunked with --tp"),
    (["--activation-offload", "memplan"], "memplan offload"),
])
def test_impossible_loss_and_offload_flags_are_one_line_and_exit_2(config, capsys, flags, message):
    assert main(["estimate", config, *TINY, *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err


def test_an_offloading_estimate_reports_host_memory_apart(config, capsys):
    assert main(["estimate", config, *TINY, "--activation-offload"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["host_peak_bytes"] > 0 and doc["per_rank"][0]["host_pinned_bytes"] == doc["host_peak_bytes"]


@pytest.mark.parametrize(("argv", "message"), [
    (["offload", "{config}", "--gpu", "h100-80gb", "--batch", "1", "--seq", "16", "--activation-offload"],
     "drop --activation-offload"),
    (["reorder", "{config}", "--batch", "1", "--seq", "16", "--loss", "chunked"], "drop --loss"),
    (["estimate", "{config}", *TINY, "--loss", "chunked", "--world-size", "2", "--pp", "2"], "without --pp"),
])
def test_subcommands_that_cannot_take_the_loss_or_offload_refuse_it_in_one_line(config, capsys, argv, message):
    assert main([config if a == "{config}" else a for a in argv]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]  # progress lines aside
    assert len(errors) == 1 and message in errors[0]
