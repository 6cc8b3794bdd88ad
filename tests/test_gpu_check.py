"""`benchmarks/gpu_check.py` (`make gpu-check`) without a GPU: its cases are valid setups of
shipped models, its dry run estimates them in a Python without bitsandbytes, torchao or litgpt
(as the GPU machine's own), and its run, driven by stand-ins for the GPU's children, writes the
table after each case, judges the goals and skips what does not fit or does not finish."""

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from memplan import models
from memplan.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
WITHOUT_OPTIONAL = ROOT / "tests" / "support" / "without_optional_packages"
H100_TOTAL = 81_009 * 2**20  # what PyTorch reports for an H100 SXM (devices.json)


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("gpu_check", None)


def test_every_case_is_a_valid_setup_of_a_shipped_model(gpu_check):
    names = [case.name for case in gpu_check.CASES]
    assert len(set(names)) == len(names)
    assert gpu_check.WATCH_CASE in names
    quick = [case.quick for case in gpu_check.CASES]
    assert quick == sorted(quick, reverse=True)  # the quick ones run first
    for case in gpu_check.CASES:
        case.training_setup()
        models.load_config(case.model)
    setups = [case.setup for case in gpu_check.CASES]
    assert {"dtype": "fp32", "autocast": "bf16"}.items() <= setups[1].items()  # bf16-mixed


def test_the_dry_run_estimates_in_a_python_without_the_optional_packages(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(WITHOUT_OPTIONAL), str(ROOT / "src")])}
    done = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--case", "llama-3.2-1b-bf16", "--out",
                           str(tmp_path)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "llama-3.2-1b-bf16" in done.stdout
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["dry_run"] and report["gpu"] == "h100-80gb"
    assert report["environment"]["packages"]["bitsandbytes"] is None
    assert report["environment"]["packages"]["torchao"] is None
    (row,) = report["cases"]
    assert row["estimate"]["ok"] and row["estimate"]["fits"]
    assert 0 < row["estimate"]["peak_allocated_bytes"] <= row["estimate"]["peak_reserved_bytes"]
    assert "| llama-3.2-1b-bf16 |" in (tmp_path / "gpu_check.md").read_text()


def test_errors_are_relative_to_the_measured_figure_and_goals_hold_for_dense_cases(gpu_check):
    measured = {"peak_allocated_bytes": 1000, "peak_reserved_bytes": 2000, "device_used_bytes": 4000}
    estimated = {"peak_allocated_bytes": 1009, "peak_reserved_bytes": 1930, "device_used_bytes": None}
    errors = gpu_check.errors_of(measured, estimated)
    assert errors == {"peak_allocated_bytes": pytest.approx(0.009), "peak_reserved_bytes": pytest.approx(-0.035),
                      "device_used_bytes": None}
    dense, moe = gpu_check.CASES[0], gpu_check.case_by_name("olmoe-1b-7b-lora")
    assert gpu_check.within_goals(dense, errors) is False  # reserved is 3.5% off, past 3%
    assert gpu_check.within_goals(dense, {**errors, "peak_reserved_bytes": -0.03}) is True
    assert gpu_check.within_goals(moe, errors) is None


def test_the_median_goal_is_over_the_dense_cases_alone(gpu_check):
    def row(alloc, reserved, dense=True):
        return {"dense": dense, "within_goals": None,
                "errors": {"peak_allocated_bytes": alloc, "peak_reserved_bytes": reserved, "device_used_bytes": 0.0}}

    rows = [row(0.001, -0.01), row(-0.03, 0.02), row(0.015, 0.025), row(0.5, 0.5, dense=False)]
    out = gpu_check.summary(rows)
    assert out["dense_measured"] == 3
    assert out["median_abs_error_peak_allocated"] == pytest.approx(0.015)
    assert out["median_abs_error_peak_reserved"] == pytest.approx(0.02)
    assert out["median_goal_met"] is True


def test_another_gpu_is_refused_unless_a_profile_is_named(gpu_check):
    h100 = {"gpu_name": "NVIDIA H100 80GB HBM3", "total_bytes": H100_TOTAL}
    assert gpu_check.pick_profile(h100, None) == ("h100-80gb", H100_TOTAL)
    other = {"gpu_name": "Some Accelerator", "total_bytes": 24 * 2**30}
    with pytest.raises(UserError, match="--gpu NAME"):
        gpu_check.pick_profile(other, None)
    assert gpu_check.pick_profile(other, "l4") == ("l4", 24 * 2**30)  # the measured total as capacity


def test_a_child_past_its_timeout_is_killed_with_what_it_started(gpu_check, tmp_path):
    marker = tmp_path / "grandchild-ran"
    grandchild = tmp_path / "grandchild.py"
    grandchild.write_text(f"import time\ntime.sleep(3)\nopen({str(marker)!r}, 'w').close()\n")
    code = f"import subprocess, sys, time; subprocess.Popen([sys.executable, {str(grandchild)!r}]); time.sleep(60)"
    start = time.monotonic()
    child = gpu_check.run_child([sys.executable, "-c", code], 1.0, tmp_path / "log", env=dict(os.environ))
    assert child.timed_out and time.monotonic() - start < 10
    assert gpu_check.child_outcome(child)["error"].startswith("timed out")
    time.sleep(4)
    assert not marker.exists()  # the whole process group went


def fake_children(gpu_check, monkeypatch, measured_figures, estimated_figures):
    """Stand-ins for the GPU's children: the device, the estimates and the measured steps."""
    calls = []

    def run_mode(mode_args, timeout_s, log, result, hide_gpu=False):
        calls.append((mode_args[0], mode_args[1] if len(mode_args) > 1 else None, hide_gpu))
        if mode_args[0] == "--device-info":
            data = {"ok": True, "cuda_available": True, "gpu_name": "NVIDIA H100 80GB HBM3",
                    "total_bytes": H100_TOTAL, "torch": "2.11.0", "packages": {}}
        elif mode_args[0] == "--estimate":
            data = {"ok": True, "fits": True, "capacity_bytes": H100_TOTAL, **estimated_figures[mode_args[1]]}
        else:
            data = {"ok": True, **measured_figures[mode_args[1]]}
        return gpu_check.Child(data, 0, False, 0.1, "")

    monkeypatch.setattr(gpu_check, "run_mode", run_mode)
    return calls


def figures(alloc, reserved, used):
    return {"peak_allocated_bytes": alloc, "peak_reserved_bytes": reserved, "device_used_bytes": used}


def test_a_run_measures_each_case_against_its_estimate_and_skips_what_does_not_fit(gpu_check, monkeypatch, tmp_path):
    names = ["gpt2", "llama-3.2-1b-bf16", "qwen3-30b-a3b-lora"]
    measured = {"gpt2": figures(1000, 2000, 3000), "llama-3.2-1b-bf16": figures(1000, 2000, 3000)}
    estimated = {"gpt2": figures(1005, 2040, 3100), "llama-3.2-1b-bf16": figures(1100, 2000, 3000),
                 "qwen3-30b-a3b-lora": {**figures(1, 1, 2 * H100_TOTAL), "fits": False}}
    calls = fake_children(gpu_check, monkeypatch, measured, estimated)
    monkeypatch.setattr(gpu_check, "estimate_case", None)  # the parent never estimates in-process on a GPU run
    args = ["--no-pytest", "--no-watch", "--out", str(tmp_path)] + [f"--case={n}" for n in names]
    assert gpu_check.main(args) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    rows = {row["name"]: row for row in report["cases"]}
    assert report["gpu"] == "h100-80gb" and report["capacity_bytes"] == H100_TOTAL
    assert rows["gpt2"]["within_goals"] is True
    assert rows["llama-3.2-1b-bf16"]["within_goals"] is False  # allocated +10%
    assert rows["qwen3-30b-a3b-lora"]["status"].startswith("skipped: estimated")
    assert ("--measure", "qwen3-30b-a3b-lora", False) not in calls
    assert all(hide for mode, _, hide in calls if mode == "--estimate")  # estimates never see the GPU
    assert not any(hide for mode, _, hide in calls if mode == "--measure")
    table = (tmp_path / "gpu_check.md").read_text()
    assert "| gpt2 |" in table and "met" in table and "missed" in table


def test_cases_past_the_budget_are_skipped_and_said_so(gpu_check, monkeypatch, tmp_path):
    measured = {"gpt2": figures(1000, 2000, 3000)}
    fake_children(gpu_check, monkeypatch, measured, {"gpt2": figures(1000, 2000, 3000)})
    monkeypatch.setattr(gpu_check.Budget, "left_s", lambda self: gpu_check.MIN_STAGE_S - 1)
    assert gpu_check.main(["--no-pytest", "--no-watch", "--out", str(tmp_path), "--case", "gpt2"]) == 0
    (row,) = json.loads((tmp_path / "gpu_check.json").read_text())["cases"]
    assert row["status"] == "skipped: budget"


def test_the_watched_step_is_calibrated_and_set_beside_the_shipped_profile(gpu_check, monkeypatch, tmp_path):
    """The watch's child stands in (a real cpu step's trace with the metadata a watched cuda
    step carries, a known context and workspace); `memplan calibrate` runs for real on it."""
    from memplan.capture.step import capture_model
    from memplan.estimation.pipeline import figures_full, replay_counters
    from memplan.trace import save

    trace = capture_model(models.tiny_config("llama-3.2-1b"), models.TrainingSetup(batch=2, seq=32), fake=False,
                          device="cpu")
    tensors = figures_full(trace, replay_counters(trace, "caching", None)).peak_allocated_bytes
    context, workspace = 600 * 2**20, 32 * 2**20
    trace.meta.update(device="cuda", gpu_name="NVIDIA H100 80GB HBM3", device_total_bytes=H100_TOTAL,
                      context_bytes=context, outside_reserved_end_bytes=context, world_size=1,
                      cuda_memory_stats={"allocated_bytes.all.peak": tensors + workspace,
                                         "reserved_bytes.all.peak": tensors + workspace, "num_ooms": 0})
    measured = tmp_path / "step2.memtrace"
    save(trace, measured)
    figures = {"peak_allocated_bytes": {"measured": 1000, "estimated": 1010}}
    monkeypatch.setattr(gpu_check, "run_mode", lambda *a, **k: gpu_check.Child(
        {"ok": True, "measured_file": str(measured), "figures": figures}, 0, False, 0.1, ""))
    out = gpu_check.watch_and_calibrate(gpu_check.case_by_name(gpu_check.WATCH_CASE), "h100-80gb", tmp_path,
                                        gpu_check.Budget(300))
    assert out["ok"], out
    assert out["measured"] == {"capacity_bytes": H100_TOTAL, "cuda_context_bytes": context,
                               "cublas_workspace_bytes": workspace}
    assert out["shipped"]["cublas_workspace_bytes"] == 32 * 2**20
    assert out["watch_error_allocated"] == pytest.approx(0.01)
    assert (tmp_path / "cache" / "devices" / "gpu-check.json").is_file()  # under the run's folder, not the user's
    assert "cuBLAS workspace 32 MiB (profile 32 MiB)" in gpu_check.calibration_line(out)


def test_the_generation_cases_are_valid_calls_of_shipped_models_run_after_the_training_steps(gpu_check):
    from memplan.inference.gen_capture import model_setup

    for case in gpu_check.GENERATION_CASES:
        case.generation_setup()
        model_setup(case.model_fields())
        models.load_config(case.model)
    generation = [case.name for case in gpu_check.GENERATION_CASES]
    assert {"dynamic", "static"} <= {case.generation["cache"] for case in gpu_check.GENERATION_CASES}
    full = [case.name for case in gpu_check.selected_cases(gpu_check.parse_args(["--dry-run"]))]
    assert full[-len(generation):] == generation
    assert not set(generation) & {c.name for c in gpu_check.selected_cases(gpu_check.parse_args(["--quick"]))}


def test_the_dry_run_estimates_a_generation_case_into_a_table_of_its_own(gpu_check, monkeypatch, tmp_path):
    call = gpu_check.Case("gpt2-gen", "gpt2", {"dtype": "fp32"}, generation={"batch": 1, "input_len": 16,
                                                                            "new_tokens": 4})
    monkeypatch.setattr(gpu_check, "GENERATION_CASES", (call,))
    assert gpu_check.main(["--dry-run", "--case", "gpt2-gen", "--out", str(tmp_path)]) == 0
    (row,) = json.loads((tmp_path / "gpu_check.json").read_text())["cases"]
    assert row["generation"] == call.generation and row["estimate"]["ok"]
    assert 0 < row["estimate"]["peak_allocated_bytes"] <= row["estimate"]["peak_reserved_bytes"]
    assert row["estimate"]["peak_phase"] == "prefill" or row["estimate"]["peak_phase"].startswith("decode step")
    table = (tmp_path / "gpu_check.md").read_text()
    assert table.index("`generate()` calls") < table.index("| gpt2-gen | fp32, b1, 16 + 4 tokens, dynamic cache |")


def test_a_run_sums_up_its_generation_calls_apart_from_its_training_steps(gpu_check, monkeypatch, tmp_path):
    call = gpu_check.GENERATION_CASES[0].name
    measured = {"gpt2": figures(1000, 2000, 3000), call: figures(1000, 2000, 3000)}
    estimated = {"gpt2": figures(1005, 2040, 3100), call: figures(1200, 2000, 3000)}
    fake_children(gpu_check, monkeypatch, measured, estimated)
    assert gpu_check.main(["--no-pytest", "--no-watch", "--out", str(tmp_path), "--case", "gpt2", "--case", call]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["summary"]["dense_measured"] == 1 and report["summary"]["median_goal_met"] is True
    assert report["generation_summary"]["dense_measured"] == 1
    assert report["generation_summary"]["median_abs_error_peak_allocated"] == pytest.approx(0.2)
    assert "Generation cases measured: 1" in (tmp_path / "gpu_check.md").read_text()
