"""Captured peaks against torch.profiler's memory timeline, and fake against real.

One real CPU training step per model family, with and without activation
checkpointing: memplan's captured peak live bytes must equal the profiler's
memory-timeline peak for the same step within 0.5%, and a fake-tensor capture of
the same step must equal the real capture within 0.5%.
"""

import pytest
import torch

from memplan import models
from memplan.capture import capture, capture_model
from memplan.capture.groundtruth import profiler_peak_bytes
from memplan.capture.step import build_training_step

FAMILIES = ["gpt2", "llama-2-7b", "mistral-7b", "opt-125m", "bert-base", "mixtral-8x7b"]
CHECKPOINTING = ["none", "full"]


def setup_for(checkpointing: str, family: str = "") -> models.TrainingSetup:
    # MoE in bf16, the dtype its published weights train in (fp32 MoE: tests/models/test_moe.py)
    precision = "bf16-true" if family.startswith("mixtral") else "32-true"
    return models.TrainingSetup(
        batch=2, seq=32, precision=precision, checkpointing=checkpointing, optimizer_impl="foreach"
    )


@pytest.mark.parametrize("checkpointing", CHECKPOINTING)
@pytest.mark.parametrize("family", FAMILIES)
def test_real_capture_peak_matches_the_profiler_within_half_a_percent(family, checkpointing):
    step = build_training_step(models.tiny_config(family), setup_for(checkpointing, family), device="cpu")
    step.run()  # warm-up: optimizer state exists, as in every later step
    truth = profiler_peak_bytes(step.run)
    trace = capture(step.run, model=step.model, optimizer=step.optimizer, inputs=step.batches)
    peak, _ = trace.peak()
    assert abs(peak - truth) / truth <= 0.005, f"captured {peak} vs profiler {truth}"


@pytest.mark.parametrize("checkpointing", CHECKPOINTING)
@pytest.mark.parametrize("family", FAMILIES)
def test_fake_capture_peak_matches_the_real_capture_within_half_a_percent(family, checkpointing):
    config = models.tiny_config(family)
    real = capture_model(config, setup_for(checkpointing, family), fake=False, device="cpu").peak()[0]
    fake = capture_model(config, setup_for(checkpointing, family), fake=True, device="cpu").peak()[0]
    assert abs(fake - real) / real <= 0.005, f"fake {fake} vs real {real}"


def test_real_capture_does_not_change_the_training_result():
    results = []
    for traced in (False, True):
        step = build_training_step(models.tiny_config("gpt2"), setup_for("none"), device="cpu")
        if traced:
            capture(step.run, model=step.model, optimizer=step.optimizer, iterations=2)
        else:
            step.run()
            step.run()
        results.append([p.detach().clone() for p in step.model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_fake_lora_capture_matches_the_real_one_exactly():
    setup = models.TrainingSetup(precision="32-true", batch=2, seq=32, lora_rank=4, optimizer_impl="foreach")
    config = models.tiny_config("llama-2-7b")
    real = capture_model(config, setup, fake=False, device="cpu").peak()[0]
    fake = capture_model(config, setup, fake=True, device="cpu").peak()[0]
    assert fake == real


def test_fake_capture_passes_no_attention_mask_when_a_real_step_passes_none():
    # transformers would materialise a [B, 1, S, S] mask for fake tensors (and SDPA a
    # float copy of it, via aten.where) unless memplan keeps the real step's program
    trace = capture_model(models.tiny_config("llama-2-7b"), setup_for("none"), fake=True, device="cpu")
    names = {trace.op_name(i) for i in range(trace.num_ops)}
    assert "aten.where.self" not in names
