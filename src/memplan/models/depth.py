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
    """A copy of `config` with `layers` transformer blocks (per-layer lists cut to match)."""
    new = copy.deepcopy(config)
    new.num_hidden_layers = layers
    types = getattr(new, "layer_types", None)
    if isinstance(types, list) and len(types) >= layers:
        new.layer_types = types[:layers]
    if getattr(new, "max_window_layers", None) is not None:
        new.max_window_layers = min(new.max_window_layers, layers)
    return new
