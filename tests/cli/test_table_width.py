"""Every subcommand's terminal output stays readable at 80 columns: no line over 80
characters, every header word printed whole, nothing cut with an ellipsis."""

import re

import pytest

from memplan import models
from memplan.cli import main
from memplan.cli.table import pairs, table

TINY = ["--batch", "2", "--seq", "32"]
WIDTH = 80


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("width")
    llama = root / "llama.json"
    models.tiny_config("llama-2-7b").to_json_file(str(llama))
    trace = root / "step.memtrace"
    assert main(["trace", str(llama), *TINY, "-o", str(trace)]) == 0
    csv = root / "problem.csv"
    csv.write_text("id,lower,upper,size\n0,0,2,4\n1,1,3,4\n2,2,4,4\n")
    return root, str(llama), str(trace), str(csv)


def commands(root, llama, trace, csv):
    """(argv, header words the output must show whole) per subcommand."""
    estimate_head = ["allocated", "reserved", "device", "phase", "params", "grads", "optimizer", "activations",
                     "temporaries"]
    return {
        "trace": (["trace", llama, *TINY, "-o", str(root / "again.memtrace")], []),
        "show": (["show", trace, "--top", "5"], ["category", "bytes", "share", "size", "module", "lifetime"]),
        "simulate": (["simulate", trace], ["peak reserved", "fragmentation", "cudaMalloc / cudaFree"]),
        "plan": (["plan", trace, "-o", str(root / "plan.json")], ["arena"]),
        "pack": (["pack", csv, "--time-limit", "1"], ["height"]),
        "reorder": (["reorder", llama, *TINY, "--time-limit", "1"], ["program order", "memplan order"]),
        "estimate one rank": (["estimate", trace, "--gpu", "a100-80gb"], estimate_head),
        "estimate ranks": (["estimate", llama, *TINY, "--pp", "2", "--gpu", "a100-80gb"], ["rank", *estimate_head]),
        "gpu list": (["estimate", "--gpu", "list"], ["gpu", "platform", "memory", "bandwidth", "bf16", "source"]),
        "fit": (["fit", llama, *TINY, "--gpu", "a100-80gb", "--gpus", "1", "--top", "3"],
                ["dp", "zero", "mb", "accum", "ckpt", "allocator", "device used", "step (s)", "ms/token", "memplan estimate"]),
        "offload": (["offload", trace, "--gpu", "h100-80gb", "--nvme", "2x7GB/s", "--budget", "1MiB"],
                    ["ideal step", "memplan", "zero_offload"]),
    }


def assert_readable(text: str, words: list[str]) -> None:
    lines = text.splitlines()
    assert lines, "no output"
    too_long = [line for line in lines if len(line) > WIDTH]
    assert not too_long, too_long
    assert "…" not in text
    tokens = set(re.split(r"\s{2,}|\n", text)) | set(text.split())
    for word in words:
        assert word in text, word
        assert all(part in tokens or part in text for part in word.split()), word


@pytest.mark.parametrize("name", ["trace", "show", "simulate", "plan", "pack", "reorder", "estimate one rank",
                                  "estimate ranks", "gpu list", "fit", "offload"])
def test_every_subcommand_fits_80_columns(inputs, name, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", str(WIDTH))
    argv, words = commands(*inputs)[name]
    capsys.readouterr()
    assert main(argv) == 0
    assert_readable(capsys.readouterr().out, words)


def test_a_single_rank_estimate_is_key_value_rows(inputs, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", str(WIDTH))
    _, _, trace, _ = inputs
    assert main(["estimate", trace, "--gpu", "a100-80gb"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^peak allocated +\d", out, re.M) and re.search(r"^optimizer +\d", out, re.M)


def test_a_wide_table_wraps_into_groups_that_repeat_the_first_column():
    header = ["name", *(f"column number {i}" for i in range(8))]
    rows = [["row-a", *("12.3 GiB" for _ in range(8))], ["row-b", *("4.56 MiB" for _ in range(8))]]
    text = table(header, rows, title="a wide table", width=WIDTH)
    assert all(len(line) <= WIDTH for line in text.splitlines())
    assert text.count("row-a") == text.count("name") > 1  # one group per screenful of columns
    for head in header[1:]:
        assert head in text  # every header whole, on one line
    long_value = pairs([("key", "word " * 40)], width=WIDTH)
    assert all(len(line) <= WIDTH for line in long_value.splitlines()) and long_value.count("word") == 40


def test_a_long_command_wraps_with_continuations_and_still_parses_as_the_same_words():
    import shlex

    from memplan.cli.table import command

    text = shlex.join(["memplan", "estimate", "/a/long path/config.json", *["--batch", "4", "--seq", "32"] * 6])
    wrapped = command(text, prefix="12: ", width=40)
    assert all(len(line) <= 40 for line in wrapped.splitlines())
    assert shlex.split(wrapped.removeprefix("12: ").replace("\\\n", " ")) == shlex.split(text)
