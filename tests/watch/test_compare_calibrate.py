"""`memplan compare` and `memplan calibrate` on the files a watched step writes."""

import json

import pytest
import torch

import memplan
from memplan import models
from memplan.cli import main
from memplan.estimation.pipeline import figures_full, replay_counters
from memplan.hardware import device_profile, list_devices
from memplan.trace import load, save


@pytest.fixture(scope="module")
def watched(tmp_path_factory):
    out = tmp_path_factory.mktemp("watched")
    setup = models.TrainingSetup(precision="32-true", batch=2, seq=32)
    torch.manual_seed(0)
    model = models.build_model(models.tiny_config("llama-3.2-1b"), setup, device="cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    with memplan.watch(model, optimizer, step=2, out_dir=out, profile=False):
        for i in range(2):
            model(**models.make_batch(model, setup, device="cpu", seed=i)).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    return out


def test_compare_cli_prints_both_sides_and_json(watched, capsys):
    assert main(["compare", str(watched / "step2.memtrace"), str(watched / "estimate.json"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc == json.loads((watched / "compare.json").read_text())
    assert set(doc["figures"]) == {"peak_allocated_bytes", "peak_reserved_bytes", "device_used_bytes"}
    peak = doc["figures"]["peak_allocated_bytes"]
    assert abs(peak["difference_bytes"]) <= 0.01 * peak["measured"]
    assert main(["compare", str(watched / "step2.memtrace"), str(watched / "estimate.memtrace")]) == 0
    text = capsys.readouterr().out
    assert "peak allocated" in text and "phase of the peak" in text and "measured only" in text


def test_compare_refuses_an_estimate_as_the_measured_side(watched, capsys):
    assert main(["compare", str(watched / "estimate.json"), str(watched / "step2.memtrace")]) == 2
    assert "the first file is the measured step" in capsys.readouterr().err


def _as_cuda_step(watched, tmp_path, *, workspace_bytes, context_bytes, total_bytes, world_size=1, nccl_bytes=0):
    """The watched cpu step relabelled as a cuda one, with the metadata a watched cuda step carries
    (memplan.watch.cuda.CudaMeasurement): PyTorch's peak allocated is the step's tensors after the
    caching allocator's rounding plus `workspace_bytes` no tensor holds."""
    trace = load(watched / "step2.memtrace")
    tensors = figures_full(trace, replay_counters(trace, "caching", None)).peak_allocated_bytes
    trace.meta.update(device="cuda", gpu_name="NVIDIA A100-SXM4-80GB", device_total_bytes=total_bytes,
                      context_bytes=context_bytes, outside_reserved_end_bytes=context_bytes + nccl_bytes,
                      world_size=world_size, device_used_peak_bytes=context_bytes + tensors + workspace_bytes,
                      cuda_memory_stats={"allocated_bytes.all.peak": tensors + workspace_bytes,
                                         "reserved_bytes.all.peak": tensors + workspace_bytes, "num_ooms": 0})
    path = tmp_path / "cuda-step.memtrace"
    save(trace, path)
    return path


def test_calibrate_stores_a_local_profile_usable_as_gpu(watched, tmp_path, capsys):
    step = _as_cuda_step(watched, tmp_path, workspace_bytes=8_519_680, context_bytes=431_000_000,
                         total_bytes=85_045_854_208)
    assert main(["calibrate", str(step), "--name", "my-a100", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["base"] == "a100-80gb"
    assert result["measured"] == {"capacity_bytes": 85_045_854_208, "cuda_context_bytes": 431_000_000,
                                  "cublas_workspace_bytes": 8_519_680}
    assert "nccl.channels" in result["kept"] and "tflops" in result["kept"]
    profile = device_profile("my-a100")
    base = device_profile("a100-80gb")
    assert (profile.cuda_context_bytes, profile.capacity_bytes) == (431_000_000, 85_045_854_208)
    assert profile.flops_per_s == base.flops_per_s and profile.nccl_channels == base.nccl_channels
    assert "my-a100" in list_devices()
    assert main(["estimate", "--gpu", "list", "--json"]) == 0
    assert "my-a100" in [g["gpu"] for g in json.loads(capsys.readouterr().out)["gpus"]]
    config = tmp_path / "tiny.json"
    models.tiny_config("llama-3.2-1b").to_json_file(str(config))
    flags = [str(config), "--batch", "2", "--seq", "32", "--json"]
    assert main(["estimate", *flags, "--gpu", "my-a100"]) == 0
    mine = json.loads(capsys.readouterr().out)
    assert main(["estimate", *flags, "--gpu", "a100-80gb"]) == 0
    shipped = json.loads(capsys.readouterr().out)
    used = mine["per_rank"][0]["device_used_bytes"] - shipped["per_rank"][0]["device_used_bytes"]
    assert used == 431_000_000 - base.cuda_context_bytes  # the same step, the measured context


def test_calibrate_fits_nccl_channels_on_a_distributed_step(watched, tmp_path, capsys):
    step = _as_cuda_step(watched, tmp_path, workspace_bytes=0, context_bytes=500_000_000,
                         total_bytes=85_045_854_208, world_size=8, nccl_bytes=8 * 2 * 4_194_304)
    assert main(["calibrate", str(step), "--name", "dist", "--json"]) == 0
    assert device_profile("dist").nccl_channels == 8
    capsys.readouterr()


def test_calibrate_refuses_bad_input(watched, tmp_path, capsys):
    assert main(["calibrate", str(watched / "step2.memtrace"), "--name", "x"]) == 2
    assert "not a step measured on CUDA" in capsys.readouterr().err
    step = _as_cuda_step(watched, tmp_path, workspace_bytes=0, context_bytes=1, total_bytes=1)
    assert main(["calibrate", str(step), "--name", "a100-80gb"]) == 2
    assert "is a shipped device profile" in capsys.readouterr().err
    assert main(["calibrate", str(step), "--name", "My A100"]) == 2
    assert "lower-case letters" in capsys.readouterr().err
