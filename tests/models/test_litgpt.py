"""`--impl litgpt`: LitGPT's own GPT built from a Hugging Face config, its LoRA, its
checkpointing, and the refusals (the CPU ground truth is in
tests/estimation/test_cpu_accuracy.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from memplan import models
from memplan.capture.step import build_training_step
from memplan.errors import UserError
from memplan.models.litgpt import LM_HEAD_CHUNK_SIZE, MLP_CLASSES, litgpt_config_fields

# Fields that do not set a tensor's shape or pick an op: names, the unpadded vocabulary
# (only the padded one sizes the embedding and head), the norm epsilon (LitGPT's Gemma and
# larger Qwen2.5 configs keep 1e-5 where the Hub's say 1e-6), the block size (the longest
# sequence allowed: LitGPT's Gemma and Mistral configs stop at 4096 where the Hub's go
# further) and Phi-3's sliding window (2047 on the Hub, 2048 in LitGPT: the same [T, T]
# mask either way)
NOT_MEMORY = {"name", "hf_config", "vocab_size", "padding_multiple", "sliding_window_indices", "norm_eps",
              "block_size", "sliding_window_size"}
# Hub ids LitGPT spells differently (litgpt/config.py names the Llama 3.1 repos "Meta-Llama-3.1-*")
HUB_ALIASES = {"meta-llama/Llama-3.1-8B": "meta-llama/Meta-Llama-3.1-8B",
               "meta-llama/Llama-3.1-70B": "meta-llama/Meta-Llama-3.1-70B"}
SETUP = {"batch": 2, "seq": 32, "impl": "litgpt"}


def _litgpt_named_configs() -> dict[str, str]:
    from litgpt.config import configs

    return {f"{c['hf_config']['org']}/{c['hf_config']['name']}": c["name"] for c in configs}


def _registry_models_litgpt_names() -> list[tuple[str, str]]:
    named = _litgpt_named_configs()
    pairs = []
    for name in models.list_models():
        if getattr(models.load_config(name), "model_type", None) not in MLP_CLASSES:
            continue  # refused in one line (test_a_family_memplan_maps_no_litgpt_model_for_is_refused_in_one_line)
        hub = models.provenance(name)["hf_id"]
        hub = HUB_ALIASES.get(hub, hub)
        if hub in named:
            pairs.append((name, named[hub]))
    return pairs


def test_every_registry_model_litgpt_names_maps_onto_litgpt_s_own_config():
    from litgpt.config import Config

    pairs = _registry_models_litgpt_names()
    assert len(pairs) >= 20  # Llama 2/3/3.1/3.2, TinyLlama, Mistral, Mixtral, Qwen2.5, Gemma, Phi-3
    for name, litgpt_name in pairs:
        mapped = dataclasses.asdict(Config(**litgpt_config_fields(models.load_config(name))))
        named = dataclasses.asdict(Config.from_name(litgpt_name))
        differ = {k: (mapped[k], named[k]) for k in mapped if k not in NOT_MEMORY and mapped[k] != named[k]}
        assert not differ, f"{name} vs LitGPT's {litgpt_name}: {differ}"
        if named.get("sliding_window_size") is not None:
            assert mapped["sliding_window_size"] is not None, name


@pytest.mark.parametrize("family", ["gpt2", "opt-125m", "bert-base", "bloom-560m", "qwen3-30b-a3b"])
def test_a_family_memplan_maps_no_litgpt_model_for_is_refused_in_one_line(family):
    with pytest.raises(UserError, match="memplan maps no LitGPT model for model type") as info:
        models.build_model(models.tiny_config(family), models.TrainingSetup(**{"precision": "32-true", **SETUP}))
    assert "\n" not in str(info.value) and "`impl=hf`" in str(info.value)


@pytest.mark.parametrize(("options", "message"), [
    ({"lora_rank": 4, "lora_targets": ("q_proj", "gate_proj")}, "adapts the MLP as a whole"),
    ({"lora_rank": 4, "lora_targets": ("q_proj", "embed_tokens")}, "cannot adapt 'embed_tokens'"),
    ({"attn": "eager"}, "always calls scaled_dot_product_attention"),
    ({"head": "seq-cls"}, "Hugging Face head"),
    ({"seq": 512}, "exceeds the block size of LitGPT's config"),
])
def test_what_litgpt_cannot_build_is_refused_in_one_line(options, message):
    setup = models.TrainingSetup(**{"precision": "32-true", **SETUP, **options})
    with pytest.raises(UserError, match=message) as info:
        models.build_model(models.tiny_config("llama-2-7b"), setup)
    assert "\n" not in str(info.value)


def test_a_factory_model_refuses_impl_litgpt():
    with pytest.raises(UserError, match="`impl=litgpt` builds a model from a Hugging Face config"):
        models.build_model(models.FactorySpec("torch.nn", "Linear"), models.TrainingSetup(**{"precision": "32-true", **SETUP}))


def test_a_mixture_of_experts_is_refused_on_fake_tensors_with_advice():
    with FakeTensorMode(allow_non_fake_inputs=True), pytest.raises(UserError, match="data-dependent shapes"):
        models.build_model(models.tiny_config("mixtral-8x7b"), models.TrainingSetup(**SETUP, precision="bf16-true"))


def test_the_built_model_is_litgpt_s_gpt_with_its_lora_checkpointing_and_chunked_head():
    from litgpt.lora import GPT as LoraGPT
    from litgpt.lora import LoRAQKVLinear
    from litgpt.model import GPT
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    plain = models.build_model(models.tiny_config("llama-2-7b"), models.TrainingSetup(**{"precision": "32-true", **SETUP}))
    assert type(plain.gpt) is GPT
    assert plain.gpt.cos.shape[0] == 32 and plain.gpt.cos.dtype == torch.float32  # fit(): max_seq_length = 32
    setup = models.TrainingSetup(**SETUP, precision="bf16-true", lora_rank=4, checkpointing="full",
                                 lora_targets=("q_proj", "v_proj", "lm_head"))
    model = models.build_model(models.tiny_config("llama-2-7b"), setup)
    assert type(model.gpt) is LoraGPT
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert any(n.startswith("gpt.lm_head.lora_") for n in trainable)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert all(isinstance(block, CheckpointWrapper) for block in model.gpt.transformer.h)
    qkv = model.gpt.transformer.h[0]._checkpoint_wrapped_module.attn.qkv
    assert isinstance(qkv, LoRAQKVLinear) and tuple(qkv.enable_lora) == (True, False, True)
    assert model.gpt.transformer.h[0]._checkpoint_wrapped_module.attn.qkv.lora_dropout.p == 0.05


def test_a_step_keeps_the_previous_logits_until_the_next_forward_returns_as_litgpt_s_loop_does():
    setup = models.TrainingSetup(**{"precision": "32-true", **SETUP}, grad_accum=2)
    step = build_training_step(models.tiny_config("llama-2-7b"), setup)
    step.run()
    logits = models.build.carried_between_steps(step.model)["logits"]
    assert len(logits) == 1 and logits[0].shape == (2, 31, 512)  # one chunk of <= 128 positions, shifted
    assert logits[0].dtype == torch.float32  # Fabric's convert_output
    assert LM_HEAD_CHUNK_SIZE == 128
