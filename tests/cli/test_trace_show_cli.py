"""`memplan trace` and `memplan show` from the command line: output, JSON, bad input."""

import json
import subprocess
import sys

import pytest

from memplan.cli import main


def run_cli(*argv):
    return subprocess.run(
        [sys.executable, "-m", "memplan", *argv], capture_output=True, text=True, timeout=600
    )


@pytest.fixture(scope="module")
def gpt2_trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("t") / "step.memtrace"
    assert main(["trace", "gpt2", "--batch", "1", "--seq", "64", "-o", str(path)]) == 0
    return path


def test_trace_writes_a_memtrace_and_reports_json(tmp_path):
    out = tmp_path / "s.memtrace"
    proc = run_cli("trace", "opt-125m", "--seq", "32", "--checkpointing", "full", "-o", str(out), "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["output"] == str(out) and doc["peak_bytes"] > 0 and out.is_file()


def test_show_json_has_the_documented_keys(gpt2_trace, capsys):
    assert main(["show", str(gpt2_trace), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    for key in ("peak_bytes", "peak_event", "peak_phase", "breakdown", "num_buffers", "num_ops"):
        assert key in doc
    assert set(doc["breakdown"]) == {
        "parameter", "gradient", "optimizer_state", "activation", "temporary", "input", "other",
    }
    # gpt2 has 124M parameters: fp32 weights alone are ~475 MiB, all live at the peak
    assert doc["breakdown"]["parameter"] == 124_439_808 * 4


def test_show_prints_tables(gpt2_trace, capsys):
    assert main(["show", str(gpt2_trace)]) == 0
    out = capsys.readouterr().out
    assert "at the peak" in out and "largest buffers" in out


def test_unknown_model_is_one_line_with_close_matches_and_writes_nothing(tmp_path):
    out = tmp_path / "x.memtrace"
    proc = run_cli("trace", "lama-2-7b", "-o", str(out))
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "llama-2-7b" in proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()


def test_too_long_sequence_is_refused(tmp_path):
    out = tmp_path / "x.memtrace"
    proc = run_cli("trace", "gpt2", "--seq", "4096", "-o", str(out))
    assert proc.returncode == 2 and "1024" in proc.stderr and not out.exists()


def test_lora_rank_on_targets_that_match_nothing_is_refused(tmp_path, monkeypatch):
    from memplan.errors import UserError
    from memplan.models import TrainingSetup, build_model, tiny_config

    with pytest.raises(UserError):
        build_model(tiny_config("gpt2"), TrainingSetup(precision="32-true", lora_rank=4, lora_targets=("no_such_module",)))


def test_show_of_a_file_that_is_not_a_trace_is_one_line(tmp_path):
    bad = tmp_path / "bad.memtrace"
    bad.write_bytes(b"\x00\x01garbage")
    proc = run_cli("show", str(bad))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


def test_show_of_a_missing_file_is_one_line(tmp_path):
    proc = run_cli("show", str(tmp_path / "nope.memtrace"))
    assert proc.returncode == 2 and "does not exist" in proc.stderr


def test_output_into_a_missing_directory_is_refused(tmp_path):
    proc = run_cli("trace", "gpt2", "--seq", "16", "-o", str(tmp_path / "no" / "x.memtrace"))
    assert proc.returncode == 2 and "does not exist" in proc.stderr
