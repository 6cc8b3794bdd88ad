"""Hugging Face Hub ids that name a registry model, resolved offline.

Each registry entry's own Hub id (`_memplan.hf_id`) names it, and so do the published
variants listed in `HUB_VARIANTS` whose config.json has the same architecture and sizes
as the entry's (instruction-tuned and chat releases, renamed repositories): their
memory is the registry model's. Where the published checkpoint is quantised, its
`quantization_config` (as the repository's config.json gives it) comes with the alias,
since the registry's config describes the unquantised architecture.

`load_config` uses an alias only when the Hub cache holds no config.json of that id,
so a cached or user-provided config always wins. Ids are matched case-insensitively.
"""

from __future__ import annotations

from typing import Any

# published variants of registry models: Hub id -> registry name
HUB_VARIANTS = {
    "meta-llama/Llama-3.1-8B-Instruct": "llama-3.1-8b",
    "meta-llama/Meta-Llama-3.1-8B": "llama-3.1-8b",
    "meta-llama/Meta-Llama-3.1-8B-Instruct": "llama-3.1-8b",
    "meta-llama/Llama-3.1-70B-Instruct": "llama-3.1-70b",
    "meta-llama/Meta-Llama-3.1-70B-Instruct": "llama-3.1-70b",
    "meta-llama/Llama-3.3-70B-Instruct": "llama-3.1-70b",
    "meta-llama/Meta-Llama-3-8B-Instruct": "llama-3-8b",
    "meta-llama/Meta-Llama-3-70B-Instruct": "llama-3-70b",
    "meta-llama/Llama-3.2-1B-Instruct": "llama-3.2-1b",
    "meta-llama/Llama-3.2-3B-Instruct": "llama-3.2-3b",
    "meta-llama/Llama-2-7b-chat-hf": "llama-2-7b",
    "meta-llama/Llama-2-13b-chat-hf": "llama-2-13b",
    "meta-llama/Llama-2-70b-chat-hf": "llama-2-70b",
    "mistralai/Mistral-7B-Instruct-v0.1": "mistral-7b",
    "mistralai/Mixtral-8x7B-Instruct-v0.1": "mixtral-8x7b",
    "mistralai/Mixtral-8x22B-Instruct-v0.1": "mixtral-8x22b",
    "Qwen/Qwen2.5-0.5B-Instruct": "qwen2.5-0.5b",
    "Qwen/Qwen2.5-1.5B-Instruct": "qwen2.5-1.5b",
    "Qwen/Qwen2.5-3B-Instruct": "qwen2.5-3b",
    "Qwen/Qwen2.5-7B-Instruct": "qwen2.5-7b",
    "Qwen/Qwen2.5-14B-Instruct": "qwen2.5-14b",
    "Qwen/Qwen2.5-32B-Instruct": "qwen2.5-32b",
    "Qwen/Qwen2.5-72B-Instruct": "qwen2.5-72b",
    "google/gemma-2b-it": "gemma-2b",
    "google/gemma-7b-it": "gemma-7b",
    "TinyLlama/TinyLlama-1.1B-Chat-v1.0": "tinyllama-1.1b",
}

# quantization_config of published checkpoints that are quantised (from their config.json)
_FP8_BLOCK = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}
_MXFP4 = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                              "model.embed_tokens", "lm_head"]}
HUB_QUANTIZATION: dict[str, dict[str, Any]] = {
    "deepseek-ai/deepseek-v3": _FP8_BLOCK,
    "openai/gpt-oss-20b": _MXFP4,
    "openai/gpt-oss-120b": _MXFP4,
}


def hub_alias(repo_id: str, registry_ids: dict[str, str]) -> tuple[str, dict[str, Any] | None] | None:
    """(registry name, quantization_config or None) of a Hub id, or None. `registry_ids`
    maps each registry entry's own Hub id to its name."""
    key = repo_id.lower()
    names = {k.lower(): v for k, v in {**registry_ids, **HUB_VARIANTS}.items()}
    if key not in names:
        return None
    return names[key], HUB_QUANTIZATION.get(key)
