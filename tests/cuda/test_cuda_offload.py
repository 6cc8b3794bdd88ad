"""The offload runtime's device moves on a GPU: pinned host staging on a side stream
(`memplan.offload.runtime.cuda_io.CudaMover`) and a CUDA training step under the runtime,
bit-identical to the same step without it. Skipped without a GPU."""

import threading

import pytest
import torch

from memplan import models
from memplan.capture.step import build_training_step
from memplan.offload.runtime import RunOptions, run
from memplan.offload.runtime.cuda_io import CudaMover, ready_event

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_a_cuda_tensor_round_trips_through_pinned_staging():
    mover = CudaMover()
    t = torch.randn(4096, device="cuda")
    host = mover.to_host(t, ready_event())
    assert host.is_pinned() and host.numel() == t.numel() * t.element_size()
    saved = host.clone()
    out = torch.empty_like(t)
    mover.to_device(saved, out, ready_event())
    assert torch.equal(out, t)


def test_each_thread_reuses_its_pinned_buffer_and_grows_it_for_a_larger_tensor():
    mover = CudaMover()
    first = mover.to_host(torch.ones(1024, device="cuda"), None).data_ptr()
    assert mover.to_host(torch.ones(512, device="cuda"), None).data_ptr() == first  # reused
    grown = mover.to_host(torch.ones(1 << 16, device="cuda"), None)
    assert grown.numel() == (1 << 16) * 4 and grown.is_pinned()
    other = []
    thread = threading.Thread(target=lambda: other.append(mover.to_host(torch.ones(16, device="cuda"), None)))
    thread.start()
    thread.join()
    assert other[0].data_ptr() != grown.data_ptr()  # another thread has its own


def test_the_copy_waits_for_the_kernel_that_made_the_tensor():
    mover = CudaMover()
    a = torch.randn(2048, 2048, device="cuda")
    t = a @ a  # still running on the training stream when the side stream copies
    host = mover.to_host(t, ready_event())
    assert torch.equal(host.view(torch.float32).view(2048, 2048), t.cpu())


def cuda_step():
    setup = models.TrainingSetup(batch=2, seq=64)
    return build_training_step(models.tiny_config("gpt2"), setup, device="cuda")


def test_a_cuda_step_under_the_offload_runtime_is_bit_identical_and_peaks_lower(tmp_path):
    reference = cuda_step()
    reference.run()
    torch.cuda.reset_peak_memory_stats()
    reference.run()
    reference_peak = torch.cuda.max_memory_allocated()
    offloaded = cuda_step()
    with run(offloaded.model, offloaded.optimizer,
             options=RunOptions(directory=tmp_path, min_nbytes=1024, checksum=True, streamed_step=True)) as engine:
        offloaded.run()
        torch.cuda.reset_peak_memory_stats()
        offloaded.run()
        offloaded_peak = torch.cuda.max_memory_allocated()
    assert engine.bytes_written > 0 and engine.bytes_read > 0 and not engine.degraded
    assert offloaded_peak < reference_peak, (offloaded_peak, reference_peak)
    for (name, a), (_, b) in zip(reference.model.named_parameters(), offloaded.model.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    assert list(tmp_path.iterdir()) == []
