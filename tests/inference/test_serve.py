"""memplan serve's weights, budget and answers: hand-computed from vLLM's and SGLang's rules."""

import math

import pytest

from memplan.errors import UserError
from memplan.inference import estimate_serving
from memplan.inference.engines import sglang_rules, vllm_rules
from memplan.inference.weights import QuantScheme, quant_scheme, weight_figures
from memplan.models import tiny_config

GIB = 1 << 30
CAPACITY = 8 * GIB  # above the H100 profile's 540 MiB CUDA context


def test_llama_3_1_8b_weights_are_what_vllm_logs():
    """vLLM logs "Model loading took 14.9889 GiB" for Llama-3.1-8B-Instruct (vllm-project/vllm
    PR 17122): 8,030,261,248 parameters x 2 B + the rotary cache 131,072 x 128 x 2 B."""
    r = estimate_serving("meta-llama/Llama-3.1-8B-Instruct", "vllm", "h100-80gb", max_model_len=4096)
    assert r.weights.total_bytes == 8_030_261_248 * 2 + 131072 * 128 * 2
    assert round(r.weights.total_bytes / GIB, 4) == 14.9888


def test_vocab_rows_are_padded_to_64_then_split_over_tp():
    """pad_vocab_size (vocab_parallel_embedding.py L60-63): 500 rows -> 512, 256 per rank."""
    config = tiny_config("llama-3.1-8b", vocab_size=500, tie_word_embeddings=False)
    params = [("model.embed_tokens.weight", (500, 64)), ("lm_head.weight", (500, 64))]
    assert weight_figures(params, config, 2, 1, 2, None).embedding_bytes == 2 * 256 * 64 * 2


def test_k_and_v_are_replicated_when_tp_exceeds_the_kv_heads():
    """QKVParallelLinear: 2 KV heads over 4 ranks -> each rank keeps one whole head."""
    config = tiny_config("llama-3.1-8b")  # 4 heads, 2 KV heads of 16
    params = [("model.layers.0.self_attn.k_proj.weight", (32, 64)), ("model.layers.0.self_attn.q_proj.weight",
                                                                    (64, 64))]
    figures = weight_figures(params, config, 4, 1, 2, None)
    assert figures.blocks_bytes == 16 * 64 * 2 + 16 * 64 * 2


def test_awq_int4_keeps_half_a_byte_per_weight_and_fp16_scales_and_packed_zeros_per_group():
    scheme = QuantScheme("awq", 4, 128)
    assert scheme.matrix_bytes(4096, 4096) == 4096 * 4096 / 2 + 4096 * 32 * 2 + 4096 * 32 / 2


def test_fp8_block_scales_are_one_fp32_per_128_by_128_block():
    assert QuantScheme("fp8", 8, block=(128, 128)).matrix_bytes(512, 1024) == 512 * 1024 + 4 * 8 * 4


def test_an_unmodelled_quantisation_is_refused_in_one_line():
    with pytest.raises(UserError, match="quantization 'gguf' is not modelled"):
        quant_scheme(tiny_config("llama-3.1-8b"), "gguf")


def test_vllm_v1_batch_defaults_follow_gpu_memory_and_entry_point():
    """EngineArgs._set_default_args (arg_utils.py L1594-1680 at 0.11.0)."""
    rules = vllm_rules("0.11.0")
    assert rules.batch_defaults(80 * GIB, "NVIDIA H100 SXM5 80GB", "server", 4096) == (8192, 1024)
    assert rules.batch_defaults(80 * GIB, "NVIDIA H100 SXM5 80GB", "llm", 4096) == (16384, 1024)
    assert rules.batch_defaults(80 * GIB, "NVIDIA A100 SXM4 80GB", "server", 4096) == (2048, 256)
    assert rules.batch_defaults(24 * GIB, "NVIDIA L4 24GB", "llm", 4096) == (8192, 256)


def test_the_budget_of_each_vllm_era():
    assert vllm_rules("0.2.0").budget == "torch-only" and vllm_rules("0.6.4").budget == "device"
    assert vllm_rules("0.7.3").budget == "instance" and vllm_rules("0.8.5").budget == "device"
    assert vllm_rules("0.11.0").budget == "instance" and vllm_rules("0.21.0").budget == "instance+graphs"
    assert vllm_rules("0.21.0").default_utilization == 0.92 and vllm_rules("0.11.0").default_utilization == 0.9


def test_capture_sizes_step_by_8_then_by_16_from_0_21():
    assert vllm_rules("0.11.0").capture_sizes(256, 8192)[-3:] == [496, 504, 512]
    assert vllm_rules("0.21.0").capture_sizes(256, 8192)[-3:] == [480, 496, 512]
    assert max(vllm_rules("0.11.0").capture_sizes(1024, 128)) == 128  # capped by max_num_batched_tokens


def test_sglang_default_fraction_on_an_80_gib_gpu_keeps_10_gib():
    """server_args.py _handle_gpu_memory_settings: reserved = max(512 + 1.5 x 8192 + 2 x 256
    + 1/8 x 1024, 10240) MiB on a GPU over 60 GiB."""
    rules = sglang_rules("0.5.3", 81009, 1, 1)
    assert rules.chunked_prefill_size == 8192 and rules.cuda_graph_max_bs == 256
    assert rules.mem_fraction_static == round((81009 - 13440) / 81009, 3)


def tiny_serving(**kwargs):
    config = tiny_config("llama-3.1-8b", max_position_embeddings=4096)
    return estimate_serving(config, capacity=CAPACITY, **kwargs)


def test_vllm_kv_is_the_requested_memory_less_weights_activation_and_non_torch():
    r = tiny_serving(gpu_memory_utilization=0.5)
    non_kv = r.weights.total_bytes + r.activation.total_bytes + r.non_torch_rise_bytes
    assert r.kv_available_bytes == int(CAPACITY * 0.5) - non_kv
    assert r.kv["blocks"] == r.kv_available_bytes // r.kv["page_bytes"] // r.kv["group_size"]


def test_vllm_0_21_also_subtracts_the_cuda_graph_estimate():
    before, after = tiny_serving(engine_version="0.20.0"), tiny_serving(engine_version="0.21.0",
                                                                        gpu_memory_utilization=0.9)
    assert after.graphs["engine_estimate_bytes"] > 0
    assert before.kv_available_bytes - after.kv_available_bytes == after.graphs["engine_estimate_bytes"]


def test_vllm_refuses_free_memory_below_the_requested_fraction():
    """gpu_worker.py L185-195 at 0.11.0: free at start-up (total - CUDA context) < total x util."""
    r = tiny_serving(gpu_memory_utilization=0.99)
    assert not r.starts and r.refusal.startswith("Free memory on device (7.47/8.0 GiB) on startup is less than")


def test_vllm_refuses_a_context_whose_one_request_does_not_fit_and_names_the_longest_that_does():
    r = tiny_serving(kv_cache_memory_bytes=2 * 16 * 2 * 2 * 16 * 2 * 100)  # 100 blocks of 2 layers
    assert not r.starts and "the estimated maximum model length is 1600." in r.refusal
    assert r.max_model_len_that_starts == 1600


def test_the_utilisation_for_a_target_concurrency_holds_that_concurrency():
    target = tiny_serving(target_concurrency=3, max_model_len=2048).target
    again = tiny_serving(gpu_memory_utilization=target["gpu_memory_utilization"], max_model_len=2048)
    assert again.kv["max_concurrency"] >= 3


def test_sglang_kv_is_free_memory_times_the_fraction_less_weights():
    r = tiny_serving(engine="sglang", mem_fraction_static=0.8)
    at_init = CAPACITY - r.outside_budget_bytes["cuda_context_bytes"]
    rest = at_init - r.weights.total_bytes - int(at_init * 0.2)
    assert r.kv["tokens"] == rest // r.kv["cell_bytes"] and r.kv_available_bytes == rest


def test_the_other_engines_knob_is_refused():
    with pytest.raises(UserError, match="SGLang's"):
        tiny_serving(mem_fraction_static=0.8)
    with pytest.raises(UserError, match="vLLM's"):
        tiny_serving(engine="sglang", gpu_memory_utilization=0.8)


def test_device_used_adds_what_lies_outside_the_budget():
    r = tiny_serving()
    inside = r.weights.total_bytes + r.kv["bytes"] + r.non_torch_rise_bytes + r.activation.total_bytes
    assert r.device_used_bytes == inside + r.graphs["pool_bytes"] + sum(r.outside_budget_bytes.values())
    assert math.isclose(r.margin_bytes, CAPACITY - r.device_used_bytes)
