"""The model registry: shipped configs, spec resolution, tiny configs, parameter counts."""

from __future__ import annotations

import json

import pytest
import transformers

from memplan.errors import UserError
from memplan.models import (
    FactorySpec,
    count_parameters,
    list_models,
    load_config,
    provenance,
    tiny_config,
)

ISSUE_MODELS = [
    "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "llama-2-7b", "llama-2-13b", "llama-2-70b",
    "llama-3-8b", "llama-3-70b", "llama-3.1-8b", "llama-3.1-70b", "llama-3.2-1b", "llama-3.2-3b",
    "mistral-7b", "mixtral-8x7b", "qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b",
    "qwen2.5-14b", "qwen2.5-32b", "qwen2.5-72b", "tinyllama-1.1b", "phi-3-mini", "gemma-2b",
    "gemma-7b", "opt-125m", "opt-350m", "opt-1.3b", "opt-6.7b", "opt-13b", "opt-30b", "opt-66b",
    "bloom-560m", "bloom-1b7", "bloom-7b1", "bert-base", "bert-large", "roberta-base",
]


MOE_MODELS = ["qwen3-30b-a3b", "qwen3-235b-a22b", "gpt-oss-20b", "gpt-oss-120b", "deepseek-v2-lite", "deepseek-v3",
              "olmoe-1b-7b", "mixtral-8x22b"]


@pytest.mark.parametrize("name", MOE_MODELS)
def test_moe_registry_config_builds_on_meta_with_its_published_parameter_count(name):
    entry = provenance(name)
    assert count_parameters(name) == pytest.approx(entry["parameters"], rel=0.01)
    assert all(hasattr(transformers, arch) for arch in load_config(name).architectures)
    assert "/" in entry["hf_id"] and entry["source"].startswith("https://huggingface.co/")


def test_tiny_moe_configs_keep_experts_groups_and_latent_attention_at_toy_size():
    qwen = tiny_config("qwen3-30b-a3b")
    assert (qwen.num_experts, qwen.num_experts_per_tok, qwen.moe_intermediate_size) == (4, 2, 24)
    v3 = tiny_config("deepseek-v3")
    assert (v3.n_routed_experts, v3.n_group, v3.topk_group, v3.first_k_dense_replace) == (4, 2, 1, 1)
    assert (v3.kv_lora_rank, v3.q_lora_rank, v3.qk_rope_head_dim, v3.head_dim) == (32, 48, 8, 8)
    assert tiny_config("deepseek-v2-lite").q_lora_rank is None


def test_registry_holds_every_model_the_issue_names():
    assert set(ISSUE_MODELS) <= set(list_models())


@pytest.mark.parametrize("name", ISSUE_MODELS)
def test_registry_config_builds_with_its_published_parameter_count(name):
    published = provenance(name)["parameters"]
    assert count_parameters(name) == pytest.approx(published, rel=0.01)


@pytest.mark.parametrize("name", ISSUE_MODELS)
def test_registry_config_names_a_transformers_class_and_a_hub_id(name):
    config = load_config(name)
    assert all(hasattr(transformers, arch) for arch in config.architectures)
    assert "/" in provenance(name)["hf_id"]


def test_gpt2_parameter_count_matches_hand_computation():
    # per block: 2 LayerNorms, c_attn 768x2304+2304, c_proj 768x768+768, c_fc 768x3072+3072,
    # mlp c_proj 3072x768+768; plus wte 50257x768, wpe 1024x768, ln_f; lm_head tied to wte.
    block = 2 * 768 + 768 * 2304 + 2304 + 768 * 768 + 768 + 2 * 768 + 768 * 3072 + 3072 + 3072 * 768 + 768
    assert count_parameters("gpt2") == 12 * block + 50257 * 768 + 1024 * 768 + 2 * 768 == 124_439_808


def test_unknown_model_name_is_a_user_error_listing_close_matches():
    with pytest.raises(UserError, match="unknown model 'lama-2-7b'.*llama-2-7b"):
        load_config("lama-2-7b")


def test_local_config_json_path_loads_its_model_type(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 128,
                                "num_hidden_layers": 3, "num_attention_heads": 4, "vocab_size": 1000}))
    config = load_config(str(path))
    assert type(config).__name__ == "LlamaConfig"
    assert (config.hidden_size, config.num_hidden_layers) == (128, 3)
    assert load_config(str(tmp_path)).hidden_size == 128  # a directory holding config.json


def test_invalid_json_config_is_a_user_error_naming_the_file(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(UserError, match="broken.json is not valid JSON"):
        load_config(str(path))


def test_missing_config_file_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_config(str(tmp_path / "nope.json"))


def test_config_without_model_type_is_a_user_error(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(UserError, match="no 'model_type'"):
        load_config(str(path))


def test_config_with_unknown_model_type_is_a_user_error(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "no-such-architecture"}))
    with pytest.raises(UserError, match="config.json"):
        load_config(str(path))


def test_config_with_a_mistyped_field_is_a_one_line_user_error(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": "wide"}))
    with pytest.raises(UserError, match="config.json is invalid.*hidden_size") as exc:
        load_config(str(path))
    assert "\n" not in str(exc.value)


def test_module_colon_factory_spec_resolves_to_a_factory_spec():
    assert load_config("mypkg.models:make_model") == FactorySpec("mypkg.models", "make_model")


def test_tiny_config_keeps_the_architecture_at_toy_size():
    tiny = tiny_config("llama-3-8b")
    assert type(tiny).__name__ == "LlamaConfig"
    assert (tiny.num_hidden_layers, tiny.hidden_size, tiny.num_attention_heads) == (2, 64, 4)
    assert (tiny.vocab_size, tiny.max_position_embeddings) == (512, 256)
    assert tiny.rope_parameters["rope_theta"] == 500000.0


def test_tiny_config_keeps_gqa_mha_and_mqa():
    assert tiny_config("llama-3-8b").num_key_value_heads == 2  # GQA (8 of 32)
    assert tiny_config("llama-2-7b").num_key_value_heads == 4  # MHA
    assert tiny_config("gemma-2b").num_key_value_heads == 1  # MQA


def test_tiny_config_of_mixtral_has_four_experts_top_two():
    tiny = tiny_config("mixtral-8x7b")
    assert (tiny.num_local_experts, tiny.num_experts_per_tok) == (4, 2)


def test_tiny_config_keeps_the_feed_forward_ratio():
    assert tiny_config("llama-2-7b").intermediate_size == 176  # 11008/4096 x 64 = 172 -> multiple of 8
    assert tiny_config("opt-125m").ffn_dim == 256  # 4 x 64


def test_tiny_config_applies_overrides_last():
    assert tiny_config("gpt2", num_hidden_layers=3).n_layer == 3


def test_count_parameters_of_a_factory_is_a_user_error():
    with pytest.raises(UserError, match="factory"):
        count_parameters("mypkg.models:make_model")


def test_tiny_config_scales_long_context_rope_with_the_positions():
    # Llama 3.1: 8192 original of 131072 positions -> 256 / 16 = 16 of 256
    rope = tiny_config("llama-3.1-8b").rope_parameters
    assert (rope["rope_type"], rope["original_max_position_embeddings"]) == ("llama3", 16)


def test_a_config_of_an_architecture_memplan_cannot_build_names_its_type_and_what_is_supported(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "mamba", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 100}')
    with pytest.raises(UserError, match="model type 'mamba' has no attention heads; memplan builds attention-block "
                                        "language models .*gpt2, .*llama") as info:
        load_config(str(path))
    assert "\n" not in str(info.value)


def test_a_config_missing_the_sizes_memplan_needs_is_refused_naming_them(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "llama", "hidden_size": 64}')  # transformers would make the rest Llama-7B's
    with pytest.raises(UserError, match="lacks num_hidden_layers, num_attention_heads, vocab_size"):
        load_config(str(path))
    path.write_text('{"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 100}')
    assert load_config(str(path)).hidden_size == 64  # a family's own spelling of the fields
