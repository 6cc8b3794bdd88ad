"""`memplan.watch` around a plain training loop on cpu: the measured step against torch.profiler
and against memplan's own estimate of the same step, an injected out-of-memory error, bad input."""

import json

import pytest
import torch

import memplan
from memplan import models
from memplan.errors import UserError
from memplan.trace import load, load_snapshot

SETUP = models.TrainingSetup(precision="32-true", batch=2, seq=32)


def _job(seed=0, batch=2, seq=32):
    setup = models.TrainingSetup(precision="32-true", batch=batch, seq=seq)
    torch.manual_seed(seed)
    model = models.build_model(models.tiny_config("llama-3.2-1b"), setup, device="cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    batches = [models.make_batch(model, setup, device="cpu", seed=i) for i in range(3)]
    return model, optimizer, batches


def _loop(model, optimizer, batches):
    for batch in batches:
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def test_measured_step_matches_the_profiler_and_the_estimate_of_the_same_step(tmp_path):
    model, optimizer, batches = _job()
    with memplan.watch(model, optimizer, step=2, out_dir=tmp_path) as w:
        _loop(model, optimizer, batches)
    measured = load(tmp_path / "step2.memtrace")
    peak = measured.peak()[0]
    profiler = measured.meta["profiler_peak_bytes"]
    assert abs(peak - profiler) / profiler <= 1e-4, (peak, profiler)
    cmp = json.loads((tmp_path / "compare.json").read_text())
    assert cmp == w.result["compare"]
    for name, entry in {**cmp["breakdown"], "peak_allocated_bytes": cmp["figures"]["peak_allocated_bytes"]}.items():
        assert abs(entry["difference_bytes"]) <= 0.01 * max(entry["measured"], 1), (name, entry)
    assert cmp["peak_phase"]["measured"] == cmp["peak_phase"]["estimated"]
    assert load_snapshot(tmp_path / "step2.pickle").peak()[0] == peak  # memory_viz's file, same step
    assert (tmp_path / "report" / "index.html").is_file()
    # the live model is untouched by the fake step: real parameters, the optimizer's own state
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())
    assert all(type(v) is torch.Tensor for s in optimizer.state.values() for v in s.values())


def test_manual_steps_count_iterations_where_there_is_no_optimizer_hook(tmp_path):
    model, optimizer, batches = _job()
    with memplan.watch(model, None, step=2, out_dir=tmp_path, profile=False) as w:
        for batch in batches:
            model(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            w.step()
    assert load(tmp_path / "step2.memtrace").meta["step"] == 2
    assert w.steps_done == 3
    # the optimizer was not given to the watch: its step runs in the measured iteration, not in the estimate
    assert w.result["compare"]["figures"]["peak_allocated_bytes"]["difference_bytes"] < 0


def test_injected_out_of_memory_writes_the_snapshot_report_and_three_changes_that_fit(tmp_path, capsys):
    model, optimizer, batches = _job(batch=2, seq=64)
    # the step holds 4.41 MB; with micro-batches of 1 or checkpointing, 3.22 to 3.77 MB, within the
    # 3.8 MB usable at the 5% margin
    capacity = 4_000_000
    with pytest.raises(torch.OutOfMemoryError) as raised:
        with memplan.watch(model, optimizer, step=2, out_dir=tmp_path, capacity=capacity) as w:
            _loop(model, optimizer, batches)
    assert "over the capacity" in str(raised.value)
    assert load(tmp_path / "oom.memtrace").peak()[0] > capacity
    assert load_snapshot(tmp_path / "oom.pickle").num_buffers > 0
    assert (tmp_path / "oom-report" / "index.html").is_file()
    fits = w.oom_files["suggestions"]["fits"]
    assert len(fits) == 3
    for change in fits:
        assert change["peak_bytes"] <= capacity
        assert change["command"].startswith("memplan estimate ")
    err = capsys.readouterr().err
    assert err.count("  memplan estimate ") == 3
    assert torch._C._len_torch_dispatch_stack() == 0


def test_a_second_out_of_memory_error_in_the_handler_does_not_mask_the_first(tmp_path, monkeypatch, capsys):
    from memplan.watch import oom

    def second(_watch):
        raise torch.OutOfMemoryError("second error, inside the handler")

    monkeypatch.setattr(oom, "suggest_changes", second)
    model, optimizer, batches = _job()
    with pytest.raises(torch.OutOfMemoryError) as raised:
        with memplan.watch(model, optimizer, step=2, out_dir=tmp_path, capacity=2_000_000):
            _loop(model, optimizer, batches)
    assert "over the capacity" in str(raised.value)
    assert (tmp_path / "oom.memtrace").is_file() and (tmp_path / "oom.pickle").is_file()
    assert (tmp_path / "oom-report" / "index.html").is_file()
    assert "stopped at the suggestions: OutOfMemoryError: second error" in capsys.readouterr().err


def test_bad_input_is_one_line(tmp_path, capsys):
    with pytest.raises(UserError, match="has no parameters"):
        memplan.watch(torch.nn.ReLU(), None, out_dir=tmp_path)
    model, optimizer, batches = _job()
    with pytest.raises(UserError, match="step must be a whole number"):
        memplan.watch(model, optimizer, step=0)
    with memplan.watch(model, optimizer, step=9, out_dir=tmp_path) as w:
        _loop(model, optimizer, batches[:1])
    assert w.result is None
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("memplan.watch: step 9 was never reached (the run made 1 steps): nothing was measured; "
                       "watch an earlier step")


def test_the_cuda_device_name_finds_its_profile():
    from memplan.hardware.devices import profile_of_name

    assert profile_of_name("NVIDIA H100 80GB HBM3").key in ("h100-80gb", "h100-pcie-80gb")
    assert profile_of_name("NVIDIA A100-SXM4-80GB").key == "a100-80gb"
    assert profile_of_name("Some Other Accelerator") is None


def test_the_gpu_search_finds_the_smallest_changes_that_fit_and_each_command_gives_its_figure(tmp_path, capsys):
    # what a CUDA job's out-of-memory handler searches, on the device profile (fake tensors, no GPU)
    import shlex

    from memplan.cli import main
    from memplan.watch.oom import fitting_changes

    config = models.tiny_config("llama-3.2-1b")
    setup = models.TrainingSetup(precision="32-true", batch=4, seq=256)
    target = {"gpu": "t4", "gpus": 1, "capacity_bytes": 360 * 2**20}  # 95% usable: 342 MiB, below the 350 MiB the job uses
    changes = fitting_changes(config, setup, target)
    assert 1 <= len(changes) <= 3 and all(len(c["changes"]) == 1 for c in changes)
    for change in changes:
        trial = models.TrainingSetup(**change["setup"])
        assert trial != setup or "--allocator" in change["flags"]  # a setup change, or expandable segments
        assert trial.batch * trial.grad_accum == setup.batch * setup.grad_accum
        assert change["peak_bytes"] <= change["usable_bytes"] < change["capacity_bytes"]
        assert change["flags"][-2:] == ["--gpu", "t4"]
    path = tmp_path / "config.json"
    config.to_json_file(str(path))
    assert main(["estimate", str(path), *changes[0]["flags"], "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["device_used_bytes"] == changes[0]["peak_bytes"], shlex.join(changes[0]["flags"])


def test_the_gpu_search_refuses_in_one_line_a_job_the_estimate_already_fits():
    from memplan.watch.oom import fitting_changes

    with pytest.raises(UserError, match="fits t4 as it is") as info:
        fitting_changes(models.tiny_config("llama-3.2-1b"), models.TrainingSetup(precision="32-true", batch=4, seq=256),
                        {"gpu": "t4", "gpus": 1})
    assert "\n" not in str(info.value)

