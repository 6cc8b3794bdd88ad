"""memplan's own training step (`memplan.capture.step.build_training_step`) built and run on a
CUDA device with real tensors, for each kind of case `make gpu-check` measures: the step that
is estimated is the step that runs. Skipped without a GPU."""

import pytest
import torch

from memplan import models
from memplan.capture.step import build_training_step

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
SETUPS = {
    "fp32": ("gpt2", {}),
    "bf16-mixed": ("llama-3.2-1b", {"dtype": "fp32", "autocast": "bf16"}),
    "bf16": ("llama-3.2-1b", {"dtype": "bf16"}),
    "chunked loss": ("llama-3.2-1b", {"dtype": "bf16", "loss": "chunked"}),
    "fused loss": ("llama-3.2-1b", {"dtype": "bf16", "loss": "fused-linear"}),
    "checkpointed": ("qwen2.5-1.5b", {"dtype": "bf16", "checkpointing": "full"}),
    "lora": ("llama-3.1-8b", {"dtype": "bf16", "lora_rank": 8}),
    "moe lora": ("olmoe-1b-7b", {"dtype": "bf16", "lora_rank": 8, "lora_targets": ATTENTION}),
}


@pytest.mark.parametrize("kind", list(SETUPS))
def test_the_step_builds_on_cuda_and_trains(kind):
    family, fields = SETUPS[kind]
    setup = models.TrainingSetup(batch=2, seq=64, **fields)
    step = build_training_step(models.tiny_config(family), setup, device="cuda")
    assert step.meta["device"] == "cuda"
    assert all(p.is_cuda for p in step.model.parameters())
    assert all(t.is_cuda for batch in step.batches for t in batch.values())
    trained = [p for p in step.model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in trained]
    step.run()
    step.run()
    torch.cuda.synchronize()
    assert all(torch.isfinite(p).all() for p in trained)
    assert any(not torch.equal(a, p) for a, p in zip(before, trained, strict=True))
    assert all(p.grad is None for p in trained)  # zero_grad(set_to_none=True) after the step
