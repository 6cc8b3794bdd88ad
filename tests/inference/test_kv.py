"""KV pages, blocks, tokens and concurrency, against vLLM 0.11.0's rules computed by hand.

Each expectation is the arithmetic of the vLLM function named in the test's docstring
(vllm/v1/kv_cache_interface.py and vllm/v1/core/kv_cache_utils.py at v0.11.0), done by
hand on the model's published sizes.
"""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from memplan.errors import UserError
from memplan.inference.kv import (
    FULL,
    MLA,
    SLIDING,
    LayerKV,
    kv_layers,
    kv_pool,
    sglang_cell_bytes,
    vllm_refusal,
)
from memplan.models import load_config, tiny_config

GIB = 1 << 30


def test_llama_3_1_8b_page_is_64_kib_and_a_token_128_kib():
    """AttentionSpec.page_size_bytes (L63-66): 2 x 16 x 8 KV heads x 128 x 2 B = 65,536 per
    layer; 32 layers: 131,072 B per token (the value vLLM's Llama-3.1-8B logs imply)."""
    layers = kv_layers(load_config("llama-3.1-8b"), 1, "auto", 2)
    pool = kv_pool(layers, 16, 8192)
    assert pool.page_bytes == 65536 and pool.group_size == 32
    assert pool.block_bytes * len(pool.groups) // 16 == 131072


def test_kv_heads_are_divided_by_tp_and_replicated_below_one_per_rank():
    """ModelConfig.get_num_kv_heads (config/model.py L1179-1191): max(1, 8 // tp)."""
    config = load_config("llama-3.1-8b")
    assert [kv_layers(config, tp, "auto", 2)[0].kv_heads for tp in (1, 2, 8, 16)] == [8, 4, 1, 1]


def test_mla_page_has_no_factor_two_and_is_the_same_on_every_tp_rank():
    """MLAAttentionSpec.page_size_bytes (L146-153): block x 1 x (512 + 64) x 2 B; the latent
    is replicated over TP ranks (get_num_kv_heads returns 1 for MLA)."""
    config = load_config("deepseek-v3")
    for tp in (1, 8):
        layer = kv_layers(config, tp, "auto", 2)[0]
        assert layer.kind == MLA and layer.page_bytes(64) == 64 * 576 * 2


def test_fp8_ds_mla_is_656_bytes_per_token():
    """MLAAttentionSpec.page_size_bytes L148-151: block x 656 for cache dtype fp8_ds_mla."""
    assert kv_layers(load_config("deepseek-v3"), 8, "fp8_ds_mla", 2)[0].page_bytes(64) == 64 * 656


def test_fp8_kv_cache_halves_the_page():
    config = load_config("llama-3.1-8b")
    assert kv_layers(config, 1, "fp8", 2)[0].page_bytes(16) * 2 == kv_layers(config, 1, "auto", 2)[0].page_bytes(16)


def test_a_sliding_window_request_holds_window_minus_one_plus_a_chunk_and_one_block_more():
    """SlidingWindowSpec.max_memory_usage_bytes (L196-214): min(4096 - 1 + 2048, 32768) =
    6143 tokens -> cdiv(6143, 16) + 1 = 385 pages."""
    layer = LayerKV(SLIDING, 8, 2 * 128 * 2, window=4096)
    assert layer.request_bytes(32768, 16, 2048) == 385 * layer.page_bytes(16)
    assert layer.request_bytes(1000, 16, 2048) == (63 + 1) * layer.page_bytes(16)  # capped by max_model_len


def test_gpt_oss_groups_full_and_sliding_layers_and_counts_tokens_over_both():
    """_get_kv_cache_groups_uniform_page_size (L894-1001): 12 full + 12 sliding layers make
    two groups of 12; get_num_blocks divides by the group size; the logged tokens are
    num_blocks // 2 groups x block size (get_kv_cache_config_from_groups L1076)."""
    pool = kv_pool(kv_layers(load_config("gpt-oss-20b"), 1, "auto", 2), 16, 8192)
    assert sorted((g.layer.kind, g.layers) for g in pool.groups) == [(FULL, 12), (SLIDING, 12)]
    page = 16 * 8 * 64 * 2 * 2
    available = 10 * GIB
    blocks = available // page // 12
    assert pool.num_blocks(available) == blocks and pool.tokens(blocks) == blocks // 2 * 16


def test_uneven_layer_kinds_pad_the_last_group():
    """3 full + 5 sliding: group size 3, sliding split into groups of 3 and 2 (padded)."""
    full, sliding = LayerKV(FULL, 2, 64), LayerKV(SLIDING, 2, 64, window=128)
    pool = kv_pool([full] * 3 + [sliding] * 5, 16, 256)
    assert sorted(g.layers for g in pool.groups) == [2, 3, 3] and pool.group_size == 3


def test_max_concurrency_is_blocks_over_the_blocks_of_one_request():
    """get_max_concurrency_for_kv_cache_config (L780-795): 32 layers x cdiv(32768, 16) pages
    per request, over pages of 32 layers: 2048 blocks a request."""
    pool = kv_pool(kv_layers(load_config("llama-3.1-8b"), 1, "auto", 2), 16, 8192)
    assert pool.max_concurrency(26972, 32768) == pytest.approx(26972 / 2048)


@given(st.integers(min_value=1, max_value=80 * GIB))
def test_the_longest_context_is_the_largest_whose_one_request_fits(available):
    """estimate_max_model_len (L633-675) by binary search: for full attention it is the
    whole blocks that fit, times the block size (capped at the model's positions)."""
    pool = kv_pool([LayerKV(FULL, 8, 512)] * 32, 16, 8192)
    longest = pool.max_model_len(available, 131072)
    blocks = available // (32 * pool.page_bytes)
    assert longest == (0 if blocks == 0 else min(blocks * 16, 131072))


def test_the_refusal_is_vllms_text():
    """check_enough_kv_cache_memory (L700-723), its message as vLLM 0.11.0 prints it."""
    text = vllm_refusal(131072, 16 * GIB, int(3.88 * GIB), 31776)
    assert text == ("To serve at least one request with the models's max seq len (131072), (16.00 GiB KV cache is "
                    "needed, which is larger than the available KV cache memory (3.88 GiB). Based on the available "
                    "memory, the estimated maximum model length is 31776. Try increasing `gpu_memory_utilization` "
                    "or decreasing `max_model_len` when initializing the engine.")


def test_sglang_cell_is_kv_heads_times_head_dim_times_layers_times_two():
    """profile_max_num_token (sglang 0.5.3 model_runner.py L1274-1287)."""
    assert sglang_cell_bytes(load_config("llama-3.1-8b"), 1, "auto", 2) == 8 * 128 * 32 * 2 * 2
    assert sglang_cell_bytes(load_config("deepseek-v3"), 8, "auto", 2) == 576 * 61 * 2


def test_a_layer_kind_not_modelled_is_refused_in_one_line():
    config = tiny_config("gpt-oss-20b")
    config.layer_types = ["linear_attention", "full_attention"]
    with pytest.raises(UserError, match="linear_attention"):
        kv_layers(config, 1, "auto", 2)
