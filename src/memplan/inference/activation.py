"""The activation peak of a serving engine's start-up profile run, modelled from its code.

vLLM sizes its KV cache after one dummy forward of `max_num_batched_tokens` tokens split
over `min(tokens, max_num_seqs)` requests, then one dummy sampler run over those requests
(vLLM 0.11.0 `vllm/v1/worker/gpu_model_runner.py`: `profile_run` L3325-3403,
`_dummy_sampler_run` L3183-3227), and charges the rise of PyTorch's *allocated* peak
during it (`vllm/utils/__init__.py` `memory_profiling`). This module does not trace the
Hugging Face forward: vLLM runs its own model code (fused QKV and gate-up projections,
`SiluAndMul`, `FusedMoE`, fused residual RMSNorm, compiled so that each intermediate is
freed when dead), whose live tensors differ from transformers'. It models that code's
peak instead, per token, from the config:

- a dense block's MLP: the residual, the gate-up output `2 x intermediate / tp` and the
  activation `intermediate / tp` live together (`LlamaMLP`: `gate_up_proj`, `act_fn`);
- attention: the residual, the fused QKV output and the attention output; the profile
  run passes no attention metadata, so no attention kernel workspace is charged;
- a `FusedMoE` block: `fused_experts_impl`'s caches for `min(tokens, 32768)` tokens x
  top-k (`intermediate_cache13` of `max(2 x moe_intermediate / tp, hidden)`, cache2 of
  `moe_intermediate / tp`), the router logits, and the shared experts' MLP;
- after the last block the final hidden states (and the rows the sampler reads) stay
  alive through the sampler run;
- the sampler over `requests` rows of the vocabulary in PyTorch's implementation
  (`vllm/v1/sample/ops/topk_topp_sampler.py` `forward_native` and `apply_top_k_top_p`,
  the dummy run sets top-k and top-p): the model-dtype logits, their fp32 copy, the
  sort's values (fp32) and indices (int64), the top-p softmax, its mask and the
  scattered result live together: `SAMPLER_NATIVE_BYTES` bytes per logit. With
  FlashInfer's sampler (`forward_cuda`) the sort is not made: `SAMPLER_FLASHINFER_BYTES`;
- the cuBLAS workspace (the device profile's), allocated by the first matmul, which in
  vLLM V1 is the profile's own.

Assumes the model dtype is the activations' dtype and the vocabulary is whole after the
logits' all-gather. It is a model of the code, not a measurement: docs/serving.md says how
it compares with published start-up logs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memplan.inference.kv import head_dim, is_mla, kv_heads_per_rank

FUSED_MOE_CHUNK = 32768  # VLLM_FUSED_MOE_CHUNK_SIZE default (vllm/envs.py L777-778 at 0.11.0)
# bytes per logit live at the sampler's peak: bf16 logits 2 + fp32 copy 4 + sorted values 4
# + sort indices 8 + top-p probabilities 4 + top-p mask 1 + scattered logits 4
SAMPLER_NATIVE_BYTES = 27
# FlashInfer's top-k/top-p sampling: bf16 logits 2 + fp32 copy 4 + probabilities 4
SAMPLER_FLASHINFER_BYTES = 10
SAMPLERS = {"native": SAMPLER_NATIVE_BYTES, "flashinfer": SAMPLER_FLASHINFER_BYTES}


@dataclass(frozen=True)
class ActivationPeak:
    """The modelled allocated peak of one profile run, in bytes, by part."""

    forward_bytes: int  # the heaviest block's live tensors, residual included
    sampler_bytes: int  # the sampler's logits and its intermediates
    carried_bytes: int  # hidden states kept alive through the sampler
    workspace_bytes: int  # cuBLAS workspace
    tokens: int
    requests: int

    @property
    def total_bytes(self) -> int:
        return max(self.forward_bytes, self.sampler_bytes + self.carried_bytes) + self.workspace_bytes

    def to_json(self) -> dict[str, Any]:
        return {"total_bytes": self.total_bytes, "forward_bytes": self.forward_bytes,
                "sampler_bytes": self.sampler_bytes, "carried_bytes": self.carried_bytes,
                "workspace_bytes": self.workspace_bytes, "tokens": self.tokens, "requests": self.requests}


def _attention_width(config: Any, tp: int) -> tuple[int, int]:
    """(fused QKV output width, attention output width) per token on one rank."""
    heads = config.num_attention_heads // tp
    if is_mla(config):
        q = heads * (int(config.qk_nope_head_dim) + int(config.qk_rope_head_dim))
        latent = int(config.kv_lora_rank) + int(config.qk_rope_head_dim)
        kv_up = heads * (int(config.qk_nope_head_dim) + int(config.v_head_dim))
        return q + latent + kv_up, heads * int(config.v_head_dim)
    d = head_dim(config)
    return (heads + 2 * kv_heads_per_rank(config, tp)) * d, heads * d


def _dense_intermediate(config: Any) -> int:
    for key in ("intermediate_size", "ffn_dim", "n_inner"):
        value = getattr(config, key, None)
        if value:
            return int(value)
    return 4 * config.hidden_size


def block_peak_per_token(config: Any, tp: int, tokens: int) -> float:
    """Elements live at the heaviest point of one block, per token (residual included)."""
    hidden = config.hidden_size
    qkv, attn_out = _attention_width(config, tp)
    attention = hidden + qkv + attn_out
    inter = _dense_intermediate(config) // tp
    dense = hidden + max(hidden + 2 * inter, 3 * inter)
    from memplan.models.moe import experts_of  # torch, which the command line does not need

    moe = experts_of(config)
    if moe is None:
        return max(attention, dense)
    experts, top_k = moe
    moe_inter = int(getattr(config, "moe_intermediate_size", None) or _dense_intermediate(config)) // tp
    shared = int(getattr(config, "n_shared_experts", None) or 0) * moe_inter
    shared += int(getattr(config, "shared_expert_intermediate_size", None) or 0) // tp
    chunk = min(tokens, FUSED_MOE_CHUNK) / tokens
    caches = chunk * top_k * (max(2 * moe_inter, hidden) + moe_inter)
    routed = 2 * hidden + experts + caches + (3 * shared if shared else 0)
    return max(attention, dense, routed)


def profile_activation(config: Any, tp: int, tokens: int, requests: int, dtype_bytes: int, *,
                       sampler: str = "native", workspace_bytes: int = 0, last_stage: bool = True) -> ActivationPeak:
    """The modelled activation peak of vLLM's profile run on one rank of `tp`."""
    hidden = config.hidden_size
    forward = int(tokens * block_peak_per_token(config, tp, tokens) * dtype_bytes)
    sampler_bytes = int(requests * config.vocab_size * SAMPLERS[sampler]) if last_stage else 0
    kept = tokens * hidden * dtype_bytes + requests * hidden * dtype_bytes
    return ActivationPeak(forward, sampler_bytes, kept if last_stage else 0, workspace_bytes, tokens, requests)


def graph_pool_bytes(config: Any, tp: int, largest_capture: int, dtype_bytes: int) -> int:
    """Intermediates a CUDA-graph pool keeps for its largest captured batch: the forward's
    live tensors at `largest_capture` tokens (graphs captured largest first share one pool,
    the smaller ones reusing its blocks)."""
    return int(largest_capture * block_peak_per_token(config, tp, largest_capture) * dtype_bytes)
