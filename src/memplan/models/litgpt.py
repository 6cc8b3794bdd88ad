"""LitGPT's own model (`litgpt.GPT`) built from a Hugging Face config, and its loss as
LitGPT's fine-tuning scripts compute it (`setup.impl="litgpt"`).

LitGPT (github.com/Lightning-AI/litgpt, pinned 0.5.13) defines its models in one module,
`litgpt/model.py` (`GPT`, `Block`, `CausalSelfAttention` with a fused `qkv` linear, its
own RoPE cache), configured by `litgpt.Config`. `litgpt_config` maps a Hugging Face
config onto that `Config` field by field, for the families LitGPT has configs for
(Llama, Mistral, Mixtral, Qwen2, Gemma, Phi-3); for every registry model whose Hub id
LitGPT names (`litgpt/config.py`, `hf_config`), the mapped config equals LitGPT's
named one in every field that sets a tensor's shape or an op (tests/models/test_litgpt.py).
Any other family is refused in one line.

`LitGPTStep` runs one micro-batch as `litgpt/finetune/lora.py` and `full.py` (`fit`) do
with Lightning Fabric on one device:

    logits = model(input_ids, lm_head_chunk_size=128)   # a list of [B, 128, V] chunks
    logits[-1] = logits[-1][..., :-1, :]
    loss = chunked_cross_entropy(logits, targets[..., 1:])

- the model is built under Fabric's precision plugin: `precision="bf16-true"` (a bf16
  setup) builds it with bf16 as the default dtype (`HalfPrecision.module_init_context`),
  casts it with `module.to(bf16)` (`convert_module`) and runs its forward with bf16 as
  the default dtype (`forward_context`); `32-true` changes nothing; a setup with
  autocast is Fabric's `bf16-mixed` / `16-mixed` (autocast around the forward);
- Fabric's module wrapper casts the forward's floating outputs to the default dtype
  (`_FabricModule.forward` -> `Precision.convert_output`, `float32` outside the
  forward), so each chunk of logits becomes an fp32 copy;
- `fit` sets `model.max_seq_length` to the longest training sequence, which rebuilds
  the RoPE cache (`cos`, `sin`: fp32 [seq, rope_n_elem]) unless it is the block size;
- the loop's `logits` variable keeps the previous micro-batch's chunks alive until the
  next forward returns (`carried`: what the step keeps between micro-batches and steps);
- LoRA (`lora_rank > 0`) is `litgpt.lora.GPT` with `mark_only_lora_as_trainable`,
  LitGPT's defaults `lora_alpha=16`, `lora_dropout=0.05`, the adapted weights chosen by
  the setup's targets (Hugging Face names mapped onto LitGPT's `lora_query`, `lora_key`,
  `lora_value`, `lora_projection`, `lora_mlp`, `lora_head`; default query and value, as
  `finetune/lora.py`);
- activation checkpointing (`full`) wraps every `Block` in a non-reentrant checkpoint,
  what Fabric's `FSDPStrategy(activation_checkpointing_policy={Block})` of
  `finetune/full.py` applies (`lightning/fabric/strategies/fsdp.py`,
  `_setup_activation_checkpointing`: `apply_activation_checkpointing` with
  `checkpoint_wrapper`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from memplan.errors import UserError
from memplan.models.setup import TrainingSetup

if TYPE_CHECKING:  # transformers takes a second to import; only its config class is named here
    from transformers import PretrainedConfig

LM_HEAD_CHUNK_SIZE = 128  # litgpt/finetune/{full,lora}.py: model(input_ids, lm_head_chunk_size=128)
LORA_ALPHA = 16  # litgpt/finetune/lora.py setup() defaults
LORA_DROPOUT = 0.05

# Hugging Face model types -> LitGPT's MLP class for them (litgpt/config.py named configs)
MLP_CLASSES = {"llama": "LLaMAMLP", "mistral": "LLaMAMLP", "qwen2": "LLaMAMLP", "phi3": "LLaMAMLP",
               "gemma": "GemmaMLP", "mixtral": "LLaMAMoE"}

# Hugging Face LoRA target names -> the litgpt.lora.Config switch that adapts them
LORA_SWITCHES = {"q_proj": "lora_query", "k_proj": "lora_key", "v_proj": "lora_value", "o_proj": "lora_projection",
                 "qkv_proj": ("lora_query", "lora_key", "lora_value"), "gate_proj": "lora_mlp",
                 "up_proj": "lora_mlp", "down_proj": "lora_mlp", "gate_up_proj": "lora_mlp", "lm_head": "lora_head"}
MLP_TARGETS = {"llama": ("gate_proj", "up_proj", "down_proj"), "phi3": ("gate_up_proj", "down_proj")}
DEFAULT_LORA_TARGETS = ("q_proj", "v_proj")  # finetune/lora.py: lora_query=True, lora_value=True


def litgpt_config_fields(config: PretrainedConfig) -> dict[str, Any]:
    """`litgpt.Config` keyword arguments for a Hugging Face config (module docstring);
    `UserError` for a family LitGPT has no config for."""
    model_type = getattr(config, "model_type", None)
    mlp = MLP_CLASSES.get(model_type)
    if mlp is None:
        raise UserError(f"memplan maps no LitGPT model for model type '{model_type}' (it maps "
                        f"{', '.join(sorted(MLP_CLASSES))}): use `impl=hf`")
    heads = int(config.num_attention_heads)
    head_size = getattr(config, "head_dim", None) or config.hidden_size // heads
    fields: dict[str, Any] = {
        "block_size": int(config.max_position_embeddings), "n_layer": int(config.num_hidden_layers),
        "n_embd": int(config.hidden_size), "n_head": heads, "head_size": int(head_size),
        "n_query_groups": int(getattr(config, "num_key_value_heads", None) or heads),
        "vocab_size": int(config.vocab_size), "padded_vocab_size": int(config.vocab_size),
        "norm_class_name": "RMSNorm", "norm_eps": float(config.rms_norm_eps), "parallel_residual": False,
        "bias": False, "attn_bias": bool(getattr(config, "attention_bias", model_type == "qwen2")),
        "rotary_percentage": 1.0, "intermediate_size": int(config.intermediate_size), "mlp_class_name": mlp,
    }
    fields.update(_rope_fields(config))
    if model_type == "gemma":
        fields.update(gelu_approximate="tanh", scale_embeddings=True)
    if model_type == "mixtral":
        fields.update(n_expert=int(config.num_local_experts), n_expert_per_token=int(config.num_experts_per_tok))
    window = getattr(config, "sliding_window", None)
    if window and model_type in ("mistral", "phi3"):
        fields["sliding_window_size"] = int(window)
    return fields


def _rope_fields(config: PretrainedConfig) -> dict[str, Any]:
    """RoPE base and Llama 3's frequency adjustments (`rope_theta`, `rope_scaling`, or
    transformers 5's `rope_parameters` holding both)."""
    rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    base = rope.get("rope_theta", getattr(config, "rope_theta", 10000))
    fields: dict[str, Any] = {"rope_base": int(base)}
    if rope.get("rope_type", rope.get("type")) == "llama3":
        fields["rope_adjustments"] = {
            "factor": float(rope["factor"]), "low_freq_factor": float(rope["low_freq_factor"]),
            "high_freq_factor": float(rope["high_freq_factor"]),
            "original_max_seq_len": int(rope["original_max_position_embeddings"])}
    return fields


def lora_switches(config: PretrainedConfig, setup: TrainingSetup) -> dict[str, bool]:
    """The `litgpt.lora.Config` switches for the setup's LoRA targets (module docstring);
    `UserError` for a target LitGPT cannot adapt on its own."""
    targets = tuple(setup.lora_targets or DEFAULT_LORA_TARGETS)
    switches = dict.fromkeys(("lora_query", "lora_key", "lora_value", "lora_projection", "lora_mlp", "lora_head"),
                             False)
    for target in targets:
        switch = LORA_SWITCHES.get(target)
        if switch is None:
            raise UserError(f"LitGPT's LoRA cannot adapt '{target}': give targets among {', '.join(LORA_SWITCHES)}")
        for name in (switch,) if isinstance(switch, str) else switch:
            switches[name] = True
    mlp = MLP_TARGETS.get(getattr(config, "model_type", ""), MLP_TARGETS["llama"])
    chosen = [t for t in targets if t in mlp]
    if chosen and sorted(chosen) != sorted(mlp):
        raise UserError(f"LitGPT's LoRA adapts the MLP as a whole (lora_mlp): give all of {', '.join(mlp)} "
                        "as targets, or none")
    return switches


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """`torch.get_default_dtype()` is `dtype` within the block, as Lightning Fabric's
    `_DtypeContextManager` sets it (lightning/fabric/plugins/precision/utils.py)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


class LitGPTStep(nn.Module):
    """LitGPT's `GPT` and the loss its fine-tuning loop computes (module docstring).

    `config` is the Hugging Face config the model was mapped from (sequence length,
    vocabulary and batches are read from it); `gpt` is LitGPT's module; `carried` holds
    what LitGPT's loop keeps between micro-batches (the previous logits)."""

    def __init__(self, gpt: nn.Module, config: PretrainedConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.gpt = gpt
        self.config = config
        self.compute_dtype = dtype
        self.carried: dict[str, Any] = {}

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        from litgpt.utils import chunked_cross_entropy

        with default_dtype(self.compute_dtype):  # Fabric's forward_context
            logits = self.gpt(input_ids, lm_head_chunk_size=LM_HEAD_CHUNK_SIZE)
        out_dtype = torch.get_default_dtype()  # Fabric's convert_output
        logits = [chunk.to(out_dtype) if torch.is_floating_point(chunk) else chunk for chunk in logits]
        self.carried["logits"] = logits  # fit(): the previous micro-batch's logits end here
        logits[-1] = logits[-1][..., :-1, :]
        return chunked_cross_entropy(logits, labels[..., 1:])


def build_litgpt_model(config: PretrainedConfig, setup: TrainingSetup, seq: int, dtype: torch.dtype,
                       device: str) -> LitGPTStep:
    """LitGPT's `GPT` (or `litgpt.lora.GPT`) for `config`, as its fine-tuning scripts set
    it up for sequences of `seq` tokens in `dtype` (module docstring)."""
    try:
        import litgpt.lora
        from litgpt.config import Config
        from litgpt.model import GPT
    except ImportError as exc:
        raise UserError(f"`impl=litgpt` needs the litgpt package ({exc}): pip install --no-deps "
                        "-r requirements-nodeps.lock") from exc

    fields = litgpt_config_fields(config)
    if seq > fields["block_size"]:
        raise UserError(f"sequence length {seq} exceeds the block size of LitGPT's config ({fields['block_size']}): "
                        f"use `seq={fields['block_size']}` or less")
    if setup.lora_rank > 0:
        lora = litgpt.lora.Config(**fields, lora_r=setup.lora_rank, lora_alpha=LORA_ALPHA, lora_dropout=LORA_DROPOUT,
                                  **lora_switches(config, setup))
        with torch.device(device), default_dtype(dtype):  # Fabric's module_init_context
            gpt = litgpt.lora.GPT(lora)
        litgpt.lora.mark_only_lora_as_trainable(gpt)
    else:
        with torch.device(device), default_dtype(dtype):
            gpt = GPT(Config(**fields))
    _convert_module(gpt, dtype)
    gpt.max_seq_length = seq  # fit(): model.max_seq_length = the longest training sequence
    return LitGPTStep(gpt, config, dtype)


def _convert_module(module: nn.Module, dtype: torch.dtype) -> None:
    """`module.to(dtype=dtype)` (Fabric's `convert_module`) on floating parameters and
    buffers, done tensor by tensor: under `FakeTensorMode`, `Module.to` refuses to swap
    fake parameters. The parameters were made in `dtype` already; the RoPE cache was
    made in fp32 (`litgpt.model.build_rope_cache`) and is cast, as Fabric casts it."""
    for sub in module.modules():
        for param in sub._parameters.values():
            if param is not None and param.is_floating_point() and param.dtype != dtype:
                param.data = param.data.to(dtype)
        for key, buffer in sub._buffers.items():
            if buffer is not None and buffer.is_floating_point():
                sub._buffers[key] = buffer.to(dtype)


def checkpoint_blocks(model: LitGPTStep) -> None:
    """Wrap every LitGPT `Block` in a non-reentrant activation checkpoint, as Fabric's
    `FSDPStrategy(activation_checkpointing_policy={Block})` does (module docstring)."""
    from litgpt.model import Block
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    def wrap(module: nn.Module) -> nn.Module:
        return checkpoint_wrapper(module, checkpoint_impl=CheckpointImpl.NO_REENTRANT)

    apply_activation_checkpointing(model.gpt, checkpoint_wrapper_fn=wrap, check_fn=lambda m: isinstance(m, Block))
