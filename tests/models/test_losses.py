"""The chunked (torchtune) and fused linear (Liger) losses: the same loss and gradients as
the model's own, Liger's chunk-size rule against its source, what the fused loss
allocates, and the models they refuse."""

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from memplan import models
from memplan.capture import capture
from memplan.capture.recorder import Recorder
from memplan.capture.step import build_training_step
from memplan.errors import UserError
from memplan.models.losses import IGNORE_INDEX, liger_chunk_size, next_power_of_2, step_loss

LOSSES = ("chunked", "chunked:4", "fused-linear")


@pytest.mark.parametrize(("n", "expected"), [(0, 1), (1, 1), (2, 2), (3, 4), (1000, 1024), (1024, 1024)])
def test_next_power_of_2_is_tritons(n, expected):
    assert next_power_of_2(n) == expected


@pytest.mark.parametrize(("tokens", "hidden", "vocab", "expected"), [
    # the example in Liger's comment (fused_linear_cross_entropy.py lines 96-98):
    # BT = 4096*4, V = 32000, H = 4096 ==> inc_factor = 8, chunk_size = 2048
    (4096 * 4, 4096, 32000, 2048),
    # Llama-3-8B at 2 x 4096: ceil(128256 / 4096) = 32; 8192 / 32 = 256
    (8192, 4096, 128256, 256),
    # ceil(100 / 64) = 2; ceil(100 / 2) = 50 -> 64
    (100, 64, 100, 64),
    # a vocabulary smaller than the hidden size: one chunk, capped at BT (line 105)
    (10, 64, 32, 10),
    # the CPU ground-truth shape: 2 x 64 tokens, H 64, V 2048 -> 32; 128 / 32 = 4
    (128, 64, 2048, 4),
])
def test_liger_chunk_size_follows_the_library_formula(tokens, hidden, vocab, expected):
    assert liger_chunk_size(tokens, hidden, vocab) == expected


def _no_dropout(family):
    overrides = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0} if family == "gpt2" else {}
    return models.tiny_config(family, **overrides)


@pytest.mark.parametrize("family", ["llama-2-7b", "gpt2"])
def test_the_losses_equal_the_models_own_loss_and_gradients(family):
    config = _no_dropout(family)
    setup = models.TrainingSetup(precision="32-true", batch=2, seq=32)
    model = models.build_model(config, setup)
    batch = models.make_batch(model, setup)
    batch["labels"][0, :5] = IGNORE_INDEX  # ignored labels count in neither loss
    reference = models.forward_loss(model, batch)
    reference.backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    for loss in LOSSES:
        value = step_loss(model, batch, loss, chunks=models.TrainingSetup(precision="32-true", loss=loss).loss_chunks())
        value.backward()
        assert torch.allclose(value, reference, atol=1e-5), loss
        for name, p in model.named_parameters():
            assert torch.allclose(p.grad, expected[name], atol=1e-6), (loss, name)
        model.zero_grad(set_to_none=True)


def test_the_fused_loss_under_bf16_autocast_is_close_to_the_full_loss():
    config = models.tiny_config("llama-2-7b")
    setup = models.TrainingSetup(precision="32-true", batch=2, seq=32)
    model = models.build_model(config, setup)
    batch = models.make_batch(model, setup)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference = models.forward_loss(model, batch)
        fused = step_loss(model, batch, "fused-linear")
    assert abs(float(fused.detach()) - float(reference.detach())) < 0.02


def test_a_fused_step_never_holds_the_logits_and_a_chunked_step_holds_them_in_chunks():
    config = models.tiny_config("llama-2-7b", vocab_size=2048)
    largest = {}
    for loss in ("full", "chunked", "fused-linear"):
        setup = models.TrainingSetup(precision="32-true", batch=2, seq=64, loss=loss)
        with FakeTensorMode(allow_non_fake_inputs=True):
            step = build_training_step(config, setup)
            trace = capture(step.run, model=step.model, optimizer=step.optimizer, warmup=1, inputs=step.batches)
        largest[loss] = int(trace.buffers["nbytes"].max())
    logits_fp32 = 2 * 64 * 2048 * 4
    assert largest["full"] == logits_fp32
    assert largest["chunked"] < logits_fp32  # a weight-sized buffer (2048 x 64 fp32) is then the largest
    # Liger: chunks of 4 rows of 2048 logits; the largest buffers are the weight and its gradient
    assert largest["fused-linear"] == 2048 * 64 * 4


def test_the_fused_loss_on_cuda_reuses_one_logits_buffer_for_every_chunk():
    """Liger's `_can_use_mm_out` path (a CUDA job): `torch.mm(..., out=)` into one
    [chunk, V] buffer; elsewhere a new product per chunk."""
    config = models.tiny_config("llama-2-7b", vocab_size=3000)  # ceil(3000 / 64) = 47: chunks of 4 rows
    setup = models.TrainingSetup(batch=2, seq=64, loss="fused-linear", precision="bf16-true")
    counts = {}
    for cuda in (False, True):
        with FakeTensorMode(allow_non_fake_inputs=True):
            model = models.build_model(config, setup)
            batch = models.make_batch(model, setup)
            with Recorder() as rec:
                step_loss(model, batch, "fused-linear", cuda=cuda).backward()
            trace = rec.finish()
        chunk_bytes = 4 * 3000 * 2  # 4 rows of bf16 logits
        counts[cuda] = int((trace.buffers["nbytes"] == chunk_bytes).sum())
    assert counts[True] == 1
    assert counts[False] == 128 // 4


def test_a_model_without_an_output_head_is_refused_in_one_line():
    class Regressor(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(4, 4)

        def forward(self, input_ids, labels):
            return {"loss": self.body(input_ids.float()).pow(2).mean()}

    batch = {"input_ids": torch.ones(2, 4, dtype=torch.long), "labels": torch.ones(2, 4, dtype=torch.long)}
    with pytest.raises(UserError, match="has none") as info:
        step_loss(Regressor(), batch, "chunked", chunks=8)
    assert "\n" not in str(info.value)


def test_a_masked_lm_is_refused():
    setup = models.TrainingSetup(precision="32-true", batch=2, seq=16)
    model = models.build_model(models.tiny_config("bert-base"), setup)
    with pytest.raises(UserError, match="masked LM"):
        step_loss(model, models.make_batch(model, setup), "fused-linear")


def test_a_model_that_soft_caps_its_logits_is_refused():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16, final_logit_softcapping=30.0)
    model = Gemma2ForCausalLM(config)
    batch = {"input_ids": torch.randint(0, 128, (2, 8)), "labels": torch.randint(0, 128, (2, 8))}
    for loss in ("chunked", "fused-linear"):
        with pytest.raises(UserError, match="soft-capping"):
            step_loss(model, batch, loss, chunks=8)


def test_lora_on_the_head_chunks_but_does_not_fuse():
    config = models.tiny_config("llama-2-7b")
    setup = models.TrainingSetup(precision="32-true", batch=2, seq=16, lora_rank=4, lora_targets=("q_proj", "lm_head"))
    model = models.build_model(config, setup)
    batch = models.make_batch(model, setup)
    assert torch.allclose(step_loss(model, batch, "chunked", chunks=4), models.forward_loss(model, batch), atol=1e-5)
    with pytest.raises(UserError, match="use `loss=chunked`"):
        step_loss(model, batch, "fused-linear")
