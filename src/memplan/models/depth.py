"""The depth of a Hugging Face config: how many transformer blocks it has, and a copy with fewer."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # transformers takes a second to import; only its config class is named here
    from transformers import PretrainedConfig


def num_layers(config: PretrainedConfig) -> int | None:
    """Number of transformer blocks of an HF config (None when it has no such field)."""
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def with_layers(config: PretrainedConfig, layers: int) -> PretrainedConfig:
    """A copy of `config` with `layers` transformer blocks (per-layer lists cut to match, or
    grown by repeating their pattern: the model's attention classes index `layer_types` by
    layer)."""
    new = copy.deepcopy(config)
    new.num_hidden_layers = layers
    types = getattr(new, "layer_types", None)
    if isinstance(types, list) and types:
        new.layer_types = [types[i % len(types)] for i in range(layers)]
    if getattr(new, "max_window_layers", None) is not None:
        new.max_window_layers = min(new.max_window_layers, layers)
    return new


def block_kinds(config: PretrainedConfig, layers: int | None = None) -> list[tuple[str | None, bool]]:
    """What sets each of the first `layers` blocks (default: all) apart from the others, per
    block: its attention kind (`layer_types`: full or sliding window) and whether its MLP
    is a mixture of experts (DeepSeek's `first_k_dense_replace` dense blocks first and
    `moe_layer_freq`, Qwen-MoE's `decoder_sparse_step` and `mlp_only_layers`, Llama 4's
    `interleave_moe_layer_step`). Blocks of equal kinds are built the same way."""
    count = num_layers(config) if layers is None else layers
    types = getattr(config, "layer_types", None)
    dense_first = int(getattr(config, "first_k_dense_replace", 0) or 0)
    every = int(getattr(config, "moe_layer_freq", 1) or 1)
    sparse_step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    mlp_only = set(getattr(config, "mlp_only_layers", None) or [])
    interleave = int(getattr(config, "interleave_moe_layer_step", 1) or 1)
    kinds: list[tuple[str | None, bool]] = []
    for i in range(count or 0):
        attention = types[i] if isinstance(types, list) and i < len(types) else None
        moe = i >= dense_first and i % every == 0 and (i + 1) % sparse_step == 0 and i not in mlp_only \
            and (i + 1) % interleave == 0
        kinds.append((attention, moe))
    return kinds
