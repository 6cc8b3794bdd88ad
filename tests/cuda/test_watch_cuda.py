"""`memplan.watch` on a CUDA device: PyTorch's own stats and snapshot as the measurement, the
estimate of the same step beside them, and the out-of-memory observer. Skipped without a GPU."""

import json
import pickle

import pytest
import torch

import memplan
from memplan import models
from memplan.trace import load

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _job(batch=2, seq=32):
    setup = models.TrainingSetup(precision="32-true", batch=batch, seq=seq)
    torch.manual_seed(0)
    model = models.build_model(models.tiny_config("llama-3.2-1b"), setup, device="cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    batches = [models.make_batch(model, setup, device="cuda", seed=i) for i in range(3)]
    return model, optimizer, batches


def _loop(model, optimizer, batches):
    for batch in batches:
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def test_cuda_step_is_measured_by_pytorch_and_compared(tmp_path):
    model, optimizer, batches = _job()
    with memplan.watch(model, optimizer, step=2, out_dir=tmp_path, gpu="h100-80gb") as w:
        _loop(model, optimizer, batches)
    trace = load(tmp_path / "step2.memtrace")
    stats = trace.meta["cuda_memory_stats"]
    assert stats["allocated_bytes.all.peak"] > 0 and stats["num_ooms"] == 0
    assert trace.meta["device_used_peak_bytes"] >= stats["reserved_bytes.all.peak"]
    snapshot = pickle.loads((tmp_path / "step2.pickle").read_bytes())
    assert "segments" in snapshot and "device_traces" in snapshot  # PyTorch's own, for memory_viz
    cmp = json.loads((tmp_path / "compare.json").read_text())
    assert cmp["figures"]["peak_allocated_bytes"]["measured"] == stats["allocated_bytes.all.peak"]
    assert cmp["figures"]["device_used_bytes"]["estimated"] is not None
    assert w.result["report"].endswith("index.html")


def test_cuda_out_of_memory_is_answered_and_reraised(tmp_path):
    model, optimizer, batches = _job()
    with pytest.raises(torch.OutOfMemoryError):
        with memplan.watch(model, optimizer, step=2, out_dir=tmp_path, gpu="h100-80gb") as w:
            _loop(model, optimizer, batches)
            torch.empty(1 << 50, dtype=torch.uint8, device="cuda")  # 1 PiB: more than any device holds
    assert (tmp_path / "oom.pickle").is_file() and (tmp_path / "oom.memtrace").is_file()
    assert w.oom_files["report"] is not None


def test_cuda_offload_plan_auto_runs_after_the_measured_step(tmp_path):
    """The measured step planned within half its peak; steps 3-4 under the offload runtime
    (CUDA tensors through `memplan.offload.runtime.cuda_io`): loss bit-identical to the loop
    without the watch, what the plan moves written and read back, and a lower allocator peak."""
    reference, ref_optimizer, batches = _job()
    batches = batches + [batches[0]]
    ref_losses = []
    for batch in batches:
        loss = reference(**batch).loss
        loss.backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        ref_losses.append(loss.detach())
    model, optimizer, _ = _job()
    losses, peaks = [], []
    with memplan.watch(model, optimizer, step=2, out_dir=tmp_path, gpu="h100-80gb", offload_plan="auto",
                       offload_budget="1KiB", offload_options={"min_nbytes": 1024}) as w:
        for batch in batches:
            torch.cuda.reset_peak_memory_stats()
            loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
            peaks.append(torch.cuda.max_memory_allocated())
    assert torch.equal(torch.stack(losses), torch.stack(ref_losses))
    stats = w.offload_stats
    assert stats["iterations"] == 2 and stats["bytes_written"] == stats["bytes_read"] > 0
    assert max(peaks[2:]) < peaks[1]
