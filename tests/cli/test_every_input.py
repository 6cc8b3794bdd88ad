"""Every subcommand on every kind of input: it works (exit 0), or it says why in one line
(exit 2), never a traceback.

Inputs: a registry name, a config.json path, `package.module:factory`, a `.memtrace`, a
snapshot pickle memplan wrote, a PyTorch snapshot of two devices (no ops), a plan file,
a minimalloc CSV, and a file of no kind memplan reads. Models are tiny (a 2-block GPT-2
config, a factory returning it); the registry name runs where it stays quick.
"""

import json
import sys

import pytest

from memplan.cli import main
from memplan.models import tiny_config
from memplan.trace import load, save_snapshot

TINY_SETUP = ["--batch", "1", "--seq", "16"]
FACTORY_MODULE = "memplan_test_every_input_factory"
FACTORY_SOURCE = '''
from transformers import GPT2Config, GPT2LMHeadModel


def make():
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=256))
'''
MINIMALLOC_CSV = "id,lower,upper,size\n0,0,2,4\n1,1,3,4\n2,2,4,4\n"
MODEL_KINDS = ("registry", "config", "factory")
TRACE_KINDS = ("memtrace", "snapshot")
ALL_KINDS = (*MODEL_KINDS, *TRACE_KINDS, "torch_snapshot", "plan", "csv", "junk")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("every_input")
    (root / f"{FACTORY_MODULE}.py").write_text(FACTORY_SOURCE)
    sys.path.insert(0, str(root))
    config = root / "config.json"
    tiny_config("gpt2").to_json_file(str(config))
    paths = {"registry": "gpt2", "config": str(config), "factory": f"{FACTORY_MODULE}:make",
             "memtrace": str(root / "step.memtrace"), "snapshot": str(root / "step.pickle"),
             "torch_snapshot": "tests/data/snapshot_two_devices.pickle", "plan": str(root / "plan.json"),
             "csv": str(root / "problem.csv"), "junk": str(root / "junk.bin")}
    assert main(["trace", str(config), *TINY_SETUP, "-o", paths["memtrace"]]) == 0
    save_snapshot(load(paths["memtrace"]), paths["snapshot"])
    assert main(["plan", paths["memtrace"], "-o", paths["plan"]]) == 0
    (root / "problem.csv").write_text(MINIMALLOC_CSV)
    (root / "junk.bin").write_bytes(b"\x00\x01not a file memplan reads\xff\xfe")
    yield root, paths
    sys.path.remove(str(root))
    sys.modules.pop(FACTORY_MODULE, None)


def _argv(command, kind, path, out):
    """The command line of `command` on one input; setup flags only where a model is traced."""
    setup = TINY_SETUP if kind in MODEL_KINDS else []
    return {
        "trace": ["trace", path, *TINY_SETUP, "-o", str(out / "out.memtrace")],
        "show": ["show", path],
        "simulate": ["simulate", path],
        "plan": ["plan", path, "-o", str(out / "out-plan.json")],
        "pack": ["pack", path, "--time-limit", "1"],
        "reorder": ["reorder", path, *TINY_SETUP, "--time-limit", "1"],
        "estimate": ["estimate", path, *setup, "--gpu", "a100-80gb"],
        "fit": ["fit", path, *setup, "--gpu", "a100-80gb", "--gpus", "1", "--top", "1"],
        "offload": ["offload", path, *setup, "--gpu", "h100-80gb", "--nvme", "2x7GB/s"],
        "report": ["report", path, "-o", str(out / "report")],
    }[command]


# what works; every other (command, input) pair is refused in one line
WORKS = {
    "trace": MODEL_KINDS,
    "show": (*TRACE_KINDS, "torch_snapshot"),
    "simulate": TRACE_KINDS,
    "plan": TRACE_KINDS,
    "pack": ("csv",),
    "reorder": ("config", "factory"),
    "estimate": (*MODEL_KINDS, *TRACE_KINDS, "torch_snapshot"),
    "fit": ("config", "factory"),
    "offload": ("config", "factory", *TRACE_KINDS),
    "report": TRACE_KINDS,
}
# the registry model is a 12-block GPT-2: these would trace it whole, or many times over
SLOW_ON_REGISTRY = {"reorder", "fit", "offload"}

CASES = [(command, kind) for command in WORKS for kind in ALL_KINDS
         if not (kind == "registry" and command in SLOW_ON_REGISTRY)]


@pytest.mark.parametrize(("command", "kind"), CASES, ids=[f"{c}-{k}" for c, k in CASES])
def test_works_or_says_why_in_one_line(inputs, tmp_path, capsys, command, kind):
    _, paths = inputs
    code = main(_argv(command, kind, paths[kind], tmp_path))
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    if kind in WORKS[command]:
        assert code == 0, err
    else:
        assert code == 2, (code, err)
        assert len(err.strip().splitlines()) == 1 and err.startswith("memplan: error: "), err
        assert out == ""


def test_estimate_of_a_trace_is_the_full_depth_estimate_of_its_model(inputs, capsys):
    _, paths = inputs
    assert main(["estimate", paths["memtrace"], "--gpu", "a100-80gb", "--json"]) == 0
    from_trace = json.loads(capsys.readouterr().out)
    assert main(["estimate", paths["config"], *TINY_SETUP, "--gpu", "a100-80gb", "--full-depth", "--json"]) == 0
    from_model = json.loads(capsys.readouterr().out)
    for key in ("peak_allocated_bytes", "peak_reserved_bytes", "device_used_bytes", "fits"):
        assert from_trace[key] == from_model[key], key
    assert from_trace["per_rank"][0]["breakdown"] == from_model["per_rank"][0]["breakdown"]
    # the snapshot memplan wrote of the same trace gives the same figures
    assert main(["estimate", paths["snapshot"], "--gpu", "a100-80gb", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["device_used_bytes"] == from_trace["device_used_bytes"]


def test_a_torch_snapshot_of_two_devices_is_estimated_per_device(inputs, capsys):
    _, paths = inputs
    assert main(["estimate", paths["torch_snapshot"], "--gpu", "a100-80gb", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["rank"] for r in doc["per_rank"]] == [0, 1]
    assert all(r["device_used_bytes"] > r["peak_reserved_bytes"] for r in doc["per_rank"])


def test_offload_of_a_trace_plans_it_against_the_hardware(inputs, capsys):
    _, paths = inputs
    assert main(["offload", paths["memtrace"], "--gpu", "h100-80gb", "--nvme", "2x7GB/s", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["setup"]["seq"] == 16 and doc["planned_step_s"] > 0 and doc["feasible"]


@pytest.mark.parametrize("flags", [["--batch", "4"], ["--seq", "32"], ["--world-size", "2", "--zero", "3"],
                                   ["--tp", "2"], ["--device", "cpu"]])
def test_a_trace_is_not_re_traced_under_another_setup_or_layout(inputs, capsys, flags):
    _, paths = inputs
    assert main(["estimate", paths["memtrace"], *flags]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "pass the model instead" in err


def test_the_trace_s_own_setup_flags_are_accepted(inputs, capsys):
    _, paths = inputs
    assert main(["estimate", paths["memtrace"], *TINY_SETUP, "--json"]) == 0


@pytest.mark.parametrize("flags", [["--try-checkpointing"], ["--zero", "3", "--gpus", "2"], ["--precision", "bf16-true"]])
def test_offload_of_a_trace_refuses_what_needs_re_tracing(inputs, capsys, flags):
    _, paths = inputs
    assert main(["offload", paths["memtrace"], "--gpu", "h100-80gb", *flags]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "pass the model instead" in err


def test_a_memplan_bug_is_exit_3_with_the_input_named(inputs, capsys, monkeypatch):
    from memplan.cli import show
    from memplan.errors import BUG_EXIT_CODE, MemplanBug

    def broken(_args):
        raise MemplanBug("the validator caught an overlap")

    monkeypatch.setattr(show, "run", broken)
    _, paths = inputs
    assert main(["show", paths["memtrace"]]) == BUG_EXIT_CODE
    err = capsys.readouterr().err
    assert "internal error (a memplan bug, please report it): the validator caught an overlap" in err
    assert paths["memtrace"] in err and "Traceback" not in err
