"""`estimate(..., device="cpu", allocator="none")` against torch.profiler on real CPU steps.

The CPU ground truth: a real training step on the host's CPU, measured by
torch.profiler's memory timeline, must match the estimate within 1%, across at least
five model families, with and without checkpointing, LoRA and autocast, and with quantised
bases (bitsandbytes nf4 / fp4 / int8 under peft's k-bit preparation) and LoRA variants
(all-linear, alpha, DoRA, adapters on the LM head and the embeddings).
"""

import pytest

from memplan import models
from memplan.capture.groundtruth import profiler_peak_bytes
from memplan.capture.step import build_training_step
from memplan.estimation import estimate

CASES = [
    ("gpt2", {}),
    ("gpt2", {"checkpointing": "full"}),
    ("llama-2-7b", {}),
    ("llama-2-7b", {"checkpointing": "full"}),
    ("llama-2-7b", {"lora_rank": 4}),
    ("mistral-7b", {"precision": "bf16-mixed"}),
    ("opt-125m", {"checkpointing": "full", "lora_rank": 4}),
    ("qwen2.5-0.5b", {}),
    ("bert-base", {"precision": "bf16-mixed"}),
    ("phi-3-mini", {"checkpointing": "selective"}),
    ("bert-base", {"head": "seq-cls", "zero_grad": "zeros"}),
    # quantised bases through bitsandbytes + peft, and LoRA variants
    ("llama-2-7b", {"quant": "nf4", "lora_rank": 4, "precision": "bf16-true"}),
    ("llama-2-7b", {"quant": "nf4", "double_quant": True, "lora_rank": 4, "precision": "bf16-true"}),
    ("mistral-7b", {"quant": "int8", "lora_rank": 4, "precision": "bf16-true"}),
    ("llama-2-7b", {"quant": "nf4", "kbit_prep": False, "lora_rank": 4, "precision": "bf16-true"}),
    ("gpt2", {"quant": "fp4", "quant_storage": "bf16", "lora_rank": 4, "precision": "bf16-mixed",
              "checkpointing": "full"}),
    ("llama-2-7b", {"quant": "nf4", "frozen_base": True, "precision": "bf16-true"}),
    ("llama-2-7b", {"lora_rank": 4, "lora_targets": ("all-linear",), "lora_alpha": 16.0}),
    ("llama-2-7b", {"lora_rank": 4, "dora": True}),
    ("llama-2-7b", {"quant": "nf4", "lora_rank": 4, "dora": True, "precision": "bf16-true"}),
    ("llama-2-7b", {"lora_rank": 4, "lora_targets": ("q_proj", "v_proj", "lm_head")}),
    ("mistral-7b", {"lora_rank": 4, "lora_targets": ("embed_tokens", "v_proj")}),
]


@pytest.mark.parametrize(("family", "options"), CASES)
def test_cpu_estimate_matches_the_profiler_peak_of_a_real_step_within_one_percent(family, options):
    config = models.tiny_config(family)
    setup = models.TrainingSetup(batch=2, seq=32, optimizer_impl="foreach", **{"precision": "32-true", **options})
    step = build_training_step(config, setup, device="cpu")
    step.run()  # warm-up: optimizer state exists, as in the estimate's traced step
    truth = profiler_peak_bytes(step.run)
    predicted = estimate(config, setup, device="cpu", allocator="none").peak_allocated_bytes
    assert abs(predicted - truth) / truth <= 0.01, f"estimate {predicted} vs profiler {truth}"


# LitGPT's own GPT and its fine-tuning loop's loss (`--impl litgpt`): the chunked head, the
# fp32 logits Fabric returns and keeps until the next forward, LitGPT's LoRA (fused qkv
# adapter, dropout) and its per-Block checkpointing, Mistral's explicit sliding-window mask
LITGPT_CASES = [
    ("llama-2-7b", {}),
    ("llama-2-7b", {"lora_rank": 4, "checkpointing": "full"}),
    ("mistral-7b", {"precision": "bf16-true", "lora_rank": 4,
                    "lora_targets": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                                     "lm_head")}),
]


@pytest.mark.parametrize(("family", "options"), LITGPT_CASES)
def test_cpu_estimate_of_litgpt_s_model_matches_the_profiler_peak_of_a_real_step_within_one_percent(family, options):
    from memplan.models.build import carried_between_steps

    config = models.tiny_config(family)
    setup = models.TrainingSetup(batch=2, seq=32, optimizer_impl="foreach", impl="litgpt", **{"precision": "32-true", **options})
    step = build_training_step(config, setup, device="cpu")
    step.run()
    truth = profiler_peak_bytes(step.run, carried=carried_between_steps(step.model))
    result = estimate(config, setup, device="cpu", allocator="none")
    assert result.impl == "litgpt" and result.to_json()["impl"] == "litgpt"
    assert abs(result.peak_allocated_bytes - truth) / truth <= 0.01, f"estimate {result.peak_allocated_bytes} vs profiler {truth}"


def test_op_level_selective_checkpointing_matches_the_profiler_where_activations_dominate():
    """torchtitan's op-level policy, at a shape whose peak is in backward with the saved
    activations: within 1% of a real CPU step, between full checkpointing and none."""
    config = models.tiny_config("llama-2-7b")
    peaks = {}
    for policy in ("none", "selective-op", "full"):
        setup = models.TrainingSetup(precision="32-true", batch=8, seq=256, optimizer_impl="foreach", checkpointing=policy)
        peaks[policy] = estimate(config, setup, device="cpu", allocator="none").peak_allocated_bytes
    setup = models.TrainingSetup(precision="32-true", batch=8, seq=256, optimizer_impl="foreach", checkpointing="selective-op")
    step = build_training_step(config, setup, device="cpu")
    step.run()
    truth = profiler_peak_bytes(step.run)
    assert abs(peaks["selective-op"] - truth) / truth <= 0.01
    assert peaks["full"] < peaks["selective-op"] < peaks["none"]


# A Llama whose vocabulary is 32x its hidden size (Llama 3's ratio: 128256 / 4096), so
# that the logits and the loss dominate the step, as they do in fine-tuning at scale.
LOGITS_HEAVY = {"vocab_size": 2048}
LOSS_CASES = [
    {"loss": "chunked"},
    {"loss": "chunked:4"},
    {"loss": "fused-linear"},
    {"activation_offload": "torchtune"},
]


@pytest.mark.parametrize("options", LOSS_CASES)
def test_losses_and_activation_offload_match_the_profiler_within_one_percent(options):
    """torch.profiler counts all of a CPU step's memory: the estimate's device peak plus the
    host copies of offloaded activations at their peak (both at the end of the forward)."""
    config = models.tiny_config("llama-2-7b", **LOGITS_HEAVY)
    setup = models.TrainingSetup(batch=2, seq=64, optimizer_impl="foreach", **{"precision": "32-true", **options})
    step = build_training_step(config, setup, device="cpu")
    step.run()
    truth = profiler_peak_bytes(step.run)
    predicted = estimate(config, setup, device="cpu", allocator="none")
    total = predicted.peak_allocated_bytes + predicted.host_peak_bytes
    assert abs(total - truth) / truth <= 0.01, f"{total} vs {truth}"
    assert (predicted.host_peak_bytes > 0) == bool(options.get("activation_offload"))


def test_chunked_and_fused_losses_lower_the_peak_where_the_logits_dominate():
    config = models.tiny_config("llama-2-7b", **LOGITS_HEAVY)
    peaks = {loss: estimate(config, models.TrainingSetup(precision="32-true", batch=2, seq=64, loss=loss), device="cpu",
                            allocator="none").peak_allocated_bytes
             for loss in ("full", "chunked", "fused-linear")}
    assert peaks["fused-linear"] < peaks["chunked"] < peaks["full"]
