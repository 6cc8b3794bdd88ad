"""Optimizers, their placement and host memory against real CPU steps measured by torch.profiler.

One real step per optimizer family (tiny Llama, batch 2, seq 32), after a warm-up step:
`estimate(..., device="cpu", allocator="none")` within 1% of the profiler's peak. The
step runs bitsandbytes' CPU kernels (8-bit: `adamw8bit`; 32-bit, one state: `lion`) and
torchao's update with `torch.compile` off (`memplan.models.optimizers.eager_compile`:
torch.profiler cannot see the tensors a compiled CPU kernel reads through raw pointers).

With CPU offload the host memory is reported apart from the device's: there the trace's
device and host buffers together must equal the profiler's total, and the host buffers
must be exactly the offloaded tensors.
"""

import pytest

from memplan import models
from memplan.capture.groundtruth import profiler_peak_bytes
from memplan.capture.step import build_training_step, capture_model
from memplan.estimation import estimate
from memplan.models.optimizers import eager_compile
from memplan.trace.model import CATEGORY

LLAMA = models.tiny_config("llama-2-7b")


def _real_peak(setup):
    with eager_compile():
        step = build_training_step(LLAMA, setup, device="cpu")
        step.run()  # warm-up: the optimizer state exists, as in the estimate's traced step
        return profiler_peak_bytes(step.run)


@pytest.mark.parametrize("fields", [
    {"optimizer": "adamw8bit"},
    {"optimizer": "lion"},
    {"optimizer": "ao-adamw4bit"},
    {"optimizer_in_backward": True},
    {"optimizer": "adamw8bit", "optimizer_in_backward": True},
], ids=["bnb-8bit", "bnb-32bit-lion", "torchao-4bit", "in-backward-adamw", "in-backward-bnb-8bit"])
def test_cpu_estimate_of_an_optimizer_matches_the_profiler_peak_of_a_real_step_within_one_percent(fields):
    setup = models.TrainingSetup(batch=2, seq=32, **{"precision": "32-true", **fields})
    truth = _real_peak(setup)
    predicted = estimate(LLAMA, setup, device="cpu", allocator="none").peak_allocated_bytes
    assert abs(predicted - truth) / truth <= 0.01, f"estimate {predicted} vs profiler {truth}"


def test_cpu_offloaded_optimizer_device_plus_host_is_the_profiler_total_and_the_host_holds_the_offloaded_tensors():
    """torchao's CPUOffloadOptimizer: a pinned host copy of every parameter of at least
    4096 elements and of its gradient, and the host optimizer's states."""
    setup = models.TrainingSetup(precision="32-true", batch=2, seq=32, cpu_offload="optimizer")
    truth = _real_peak(setup)
    trace = capture_model(LLAMA, setup, fake=True, device="cpu")
    assert abs(trace.peak()[0] - truth) / truth <= 0.01, f"device + host {trace.peak()[0]} vs profiler {truth}"

    params = list(models.build_model(LLAMA, setup).parameters())
    offloaded = [p for p in params if p.numel() >= 4096]  # torchao's minimal_size
    param_bytes = sum(p.numel() * p.element_size() for p in offloaded)
    cat, nbytes = trace.buffers["category"], trace.buffers["nbytes"]
    pinned, pageable = trace.host_mask("pinned"), trace.host_mask("pageable")
    assert set(cat[pinned].tolist()) == {CATEGORY["parameter"], CATEGORY["gradient"]}
    assert int(nbytes[pinned].sum()) == 2 * param_bytes  # the host copies and their gradients
    assert set(cat[pageable].tolist()) == {CATEGORY["optimizer_state"]}
    assert int(nbytes[pageable].sum()) == sum(2 * p.numel() * 4 + 4 for p in offloaded)  # AdamW: moments, step
    on_device_states = ~trace.host_mask() & (cat == CATEGORY["optimizer_state"])
    kept = [p for p in params if p.numel() < 4096]  # stepped on the GPU
    assert int(nbytes[on_device_states].sum()) == sum(2 * p.numel() * 4 + 4 for p in kept)

    result = estimate(LLAMA, setup, device="cpu", allocator="none").per_rank[0]
    assert result.host.pinned_bytes == 2 * param_bytes
    assert result.host.peak_bytes == result.host.pinned_bytes + result.host.pageable_bytes
    assert result.peak_allocated_bytes < trace.peak()[0]  # the device peak leaves the host out
