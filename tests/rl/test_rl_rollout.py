"""The transformers rollout as TRL runs it: the policy's forward under accelerate's autocast."""

from memplan.inference import estimate_generation
from memplan.inference.gen_capture import GenerationSetup
from memplan.models.registry import tiny_config


def test_an_fp32_policy_under_bf16_autocast_keeps_an_fp32_kv_cache_and_logits_to_keep():
    config = tiny_config("qwen2.5-0.5b")
    call = GenerationSetup(batch=2, input_len=16, new_tokens=1)
    mixed = estimate_generation(config, call, {"dtype": "fp32", "autocast": "bf16"}, device="cpu", allocator="none")
    heads, dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    # one new token: the prefill alone. The keys leave RoPE in fp32 (cos and sin take the fp32
    # embeddings' dtype) and the bf16 values are concatenated onto the fp32 cache they start
    assert mixed.peak_phase == "prefill"
    assert mixed.breakdown["kv_cache"] == config.num_hidden_layers * 2 * 2 * heads * 16 * dim * 4
    assert any("the last position only" in line for line in mixed.assumptions)

