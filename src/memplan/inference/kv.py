"""KV-cache pages and blocks per attention kind, as the serving engines size them.

What one layer of a Hugging Face config stores per token on one tensor-parallel rank
(`kv_layers`), the bytes of one page of `block_size` tokens (`LayerKV.page_bytes`), what
one request of `max_model_len` tokens needs (`LayerKV.request_bytes`), how vLLM groups the
layers of a hybrid model into pools of equal page size (`kv_groups`), and from a KV budget
the blocks, tokens, concurrency and longest context the engine reports (`KVPool`).

Source: vLLM 0.11.0, `vllm/v1/kv_cache_interface.py` (page sizes: `AttentionSpec` L63-66,
`FullAttentionSpec.max_memory_usage_bytes` L83-91, `MLAAttentionSpec` L146-153,
`SlidingWindowSpec` L196-214) and `vllm/v1/core/kv_cache_utils.py` (`estimate_max_model_len`
L633-675, `check_enough_kv_cache_memory` L678-723, `get_max_concurrency_for_kv_cache_config`
L780-795, `get_num_blocks` L813-827, `_get_kv_cache_groups_uniform_page_size` L894-1001,
`get_kv_cache_config_from_groups` L1004-1093); the KV heads per rank are vLLM's
`ModelConfig.get_num_kv_heads` (`vllm/config/model.py` L1179-1191: one latent for MLA, else
`max(1, kv_heads // tp)`). docs/serving.md lists each rule with its lines.

Assumes decoder-only models whose layers are full attention, sliding-window attention or
DeepSeek's multi-head latent attention; any other layer kind (Mamba, linear attention,
chunked local attention) is refused with `UserError`, as is a KV cache dtype memplan does
not know.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from memplan.errors import UserError

FULL = "full"
SLIDING = "sliding_window"
MLA = "mla"

# bytes per element of each `--kv-cache-dtype`; "auto" is the model's dtype
KV_CACHE_DTYPE_BYTES = {"fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "bfloat16": 2, "fp16": 2, "float16": 2}
FP8_DS_MLA_TOKEN_BYTES = 656  # vLLM's fp8_ds_mla page: block_size x 656 bytes (kv_cache_interface.py L148-151)
MODEL_DTYPE_BYTES = {"bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "half": 2, "fp32": 4, "float32": 4,
                     "float": 4}

# layer_types values of transformers' configs that are full or sliding-window attention
_LAYER_TYPE_KIND = {"full_attention": FULL, "sliding_attention": SLIDING, "sliding_window_attention": SLIDING}


def cdiv(a: int, b: int) -> int:
    """Ceiling division, as vLLM's `cdiv`."""
    return -(-a // b)


@dataclass(frozen=True)
class LayerKV:
    """What one attention layer keeps per token on one rank.

    `kind` is FULL, SLIDING or MLA; `kv_heads` the heads per rank (1 for MLA's latent);
    `head_bytes` the bytes of one head's K and V for one token (K and V together, except
    MLA whose one latent row is K and V at once); `window` the sliding window in tokens.
    """

    kind: str
    kv_heads: int
    head_bytes: int
    window: int | None = None
    fixed_token_bytes: int | None = None  # fp8_ds_mla: a fixed 656 B per token

    def token_bytes(self) -> int:
        """Bytes one token takes in this layer."""
        if self.fixed_token_bytes is not None:
            return self.fixed_token_bytes
        return self.kv_heads * self.head_bytes

    def page_bytes(self, block_size: int) -> int:
        """Bytes of one page (`block_size` tokens): vLLM's `page_size_bytes`."""
        return block_size * self.token_bytes()

    def request_bytes(self, max_model_len: int, block_size: int, max_num_batched_tokens: int) -> int:
        """Bytes one request of `max_model_len` tokens can hold in this layer: vLLM's
        `max_memory_usage_bytes` (a sliding window holds at most `window - 1` computed
        tokens plus one chunk, and one block more for a window not aligned to a block)."""
        if self.kind == SLIDING and self.window is not None:
            tokens = min(self.window - 1 + max_num_batched_tokens, max_model_len)
            return (cdiv(tokens, block_size) + 1) * self.page_bytes(block_size)
        return cdiv(max_model_len, block_size) * self.page_bytes(block_size)


def kv_cache_dtype_bytes(kv_cache_dtype: str, model_dtype_bytes: int) -> int:
    """Bytes per element of the KV cache; "auto" is the model's dtype."""
    if kv_cache_dtype in (None, "auto"):
        return model_dtype_bytes
    if kv_cache_dtype in KV_CACHE_DTYPE_BYTES:
        return KV_CACHE_DTYPE_BYTES[kv_cache_dtype]
    if kv_cache_dtype == "fp8_ds_mla":
        return 1
    raise UserError(f"--kv-cache-dtype {kv_cache_dtype!r} is not modelled: use auto, "
                    f"{', '.join(KV_CACHE_DTYPE_BYTES)} or fp8_ds_mla")


def is_mla(config: Any) -> bool:
    """Whether the config has DeepSeek's multi-head latent attention (a `kv_lora_rank`)."""
    return bool(getattr(config, "kv_lora_rank", None))


def head_dim(config: Any) -> int:
    """The attention head width: `head_dim` where the config has one, else hidden / heads."""
    value = getattr(config, "head_dim", None)
    if isinstance(value, int) and value > 0 and not is_mla(config):
        return value
    return config.hidden_size // config.num_attention_heads


def total_kv_heads(config: Any) -> int:
    """The config's key/value heads (its attention heads when it has no GQA field)."""
    return int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)


def kv_heads_per_rank(config: Any, tp: int) -> int:
    """KV heads on one tensor-parallel rank: `max(1, heads // tp)` (replicated below one
    head per rank), 1 for MLA's latent (vLLM `ModelConfig.get_num_kv_heads`)."""
    if is_mla(config):
        return 1
    return max(1, total_kv_heads(config) // tp)


def layer_kinds(config: Any) -> list[str]:
    """FULL or SLIDING for each decoder layer, from `layer_types`, or from `sliding_window`
    (every layer, unless `use_sliding_window` is false, or only the layers from
    `max_window_layers` on where the config sets both, as Qwen2 does)."""
    layers = int(config.num_hidden_layers)
    types = getattr(config, "layer_types", None)
    if isinstance(types, list) and types:
        unknown = sorted({t for t in types if t not in _LAYER_TYPE_KIND})
        if unknown:
            raise UserError(f"{getattr(config, 'model_type', 'this model')} has {', '.join(unknown)} layers, an "
                            "attention kind memplan's serving model does not cover (full, sliding-window and "
                            "MLA attention are covered)")
        return [_LAYER_TYPE_KIND[t] for t in types[:layers]]
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return [FULL] * layers
    return [SLIDING] * layers


def kv_layers(config: Any, tp: int, kv_cache_dtype: str, model_dtype_bytes: int) -> list[LayerKV]:
    """One `LayerKV` per decoder layer of `config`, as one of `tp` ranks stores it."""
    elem = kv_cache_dtype_bytes(kv_cache_dtype, model_dtype_bytes)
    if is_mla(config):
        width = int(config.kv_lora_rank) + int(config.qk_rope_head_dim)
        fixed = FP8_DS_MLA_TOKEN_BYTES if kv_cache_dtype == "fp8_ds_mla" else None
        return [LayerKV(MLA, 1, width * elem, fixed_token_bytes=fixed)] * int(config.num_hidden_layers)
    if kv_cache_dtype == "fp8_ds_mla":
        raise UserError("--kv-cache-dtype fp8_ds_mla is DeepSeek's MLA format: this model has no latent attention")
    heads = kv_heads_per_rank(config, tp)
    head_bytes = 2 * head_dim(config) * elem  # K and V
    window = getattr(config, "sliding_window", None)
    return [LayerKV(kind, heads, head_bytes, window if kind == SLIDING else None) for kind in layer_kinds(config)]


@dataclass(frozen=True)
class KVGroup:
    """One KV-cache group: `layers` real layers of one kind sharing one block table (a
    padded group has fewer than the pool's `group_size`)."""

    layer: LayerKV
    layers: int


def kv_groups(layers: list[LayerKV]) -> list[KVGroup]:
    """vLLM's KV-cache groups: one group when every layer has the same spec; otherwise
    the layers of each spec split into groups of `min(#layers per spec)` layers, the last
    group of a spec padded (`_get_kv_cache_groups_uniform_page_size`). Refused when the
    layers' page sizes differ (vLLM raises NotImplementedError there)."""
    counts = Counter(layers)
    if len(counts) == 1:
        return [KVGroup(layers[0], len(layers))]
    if len({layer.token_bytes() for layer in counts}) != 1:
        raise UserError("the layers of this model keep different bytes per token: vLLM's hybrid KV-cache "
                        "manager needs one page size, and memplan does not model its padding of pages")
    group_size = min(counts.values())
    groups = []
    for layer, n in counts.items():
        for i in range(cdiv(n, group_size)):
            groups.append(KVGroup(layer, min(group_size, n - i * group_size)))  # the last one padded
    return groups


@dataclass(frozen=True)
class KVPool:
    """The KV cache of one rank: its groups, pages and what a budget of bytes buys.

    `group_size` layers share each pool tensor (vLLM allocates `group_size` tensors of
    `num_blocks` pages each); a block holds `block_size` tokens in every group."""

    groups: tuple[KVGroup, ...]
    block_size: int
    max_num_batched_tokens: int

    @property
    def group_size(self) -> int:
        return max(g.layers for g in self.groups)

    @property
    def page_bytes(self) -> int:
        return self.groups[0].layer.page_bytes(self.block_size)

    @property
    def block_bytes(self) -> int:
        """Bytes one block takes across the `group_size` tensors."""
        return self.page_bytes * self.group_size

    def num_blocks(self, available_bytes: int) -> int:
        """`int(available // page_size // group_size)`, at least 0 (vLLM `get_num_blocks`)."""
        return max(int(available_bytes // self.page_bytes // self.group_size), 0)

    def tokens(self, num_blocks: int) -> int:
        """"GPU KV cache size: N tokens": blocks shared by the groups, times the block size."""
        return num_blocks // len(self.groups) * self.block_size

    def request_bytes(self, max_model_len: int) -> int:
        """KV bytes one request of `max_model_len` tokens needs on this rank (vLLM's
        `max_memory_usage_bytes` over every layer, as `check_enough_kv_cache_memory` sums it)."""
        return sum(g.layer.request_bytes(max_model_len, self.block_size, self.max_num_batched_tokens) * g.layers
                   for g in self.groups)

    def max_concurrency(self, num_blocks: int, max_model_len: int) -> float:
        """"Maximum concurrency for N tokens per request: X": blocks over the blocks one
        request takes (`get_max_concurrency_for_kv_cache_config`)."""
        per_request = self.group_size * sum(
            g.layer.request_bytes(max_model_len, self.block_size, self.max_num_batched_tokens) for g in self.groups)
        return num_blocks / cdiv(per_request, self.block_bytes)

    def max_model_len(self, available_bytes: int, upper: int) -> int:
        """The longest `max_model_len` (<= `upper`) whose one request fits in
        `available_bytes`: vLLM's binary search `estimate_max_model_len` (0 if none)."""
        if self.request_bytes(1) > available_bytes:
            return 0
        left, right, best = 1, upper, 1
        while left <= right:
            mid = (left + right) // 2
            if self.request_bytes(mid) <= available_bytes:
                best, left = mid, mid + 1
            else:
                right = mid - 1
        return best

    def blocks_for_concurrency(self, concurrency: float, max_model_len: int) -> int:
        """Blocks needed for `concurrency` requests of `max_model_len` tokens."""
        per_request = cdiv(self.group_size * sum(
            g.layer.request_bytes(max_model_len, self.block_size, self.max_num_batched_tokens)
            for g in self.groups), self.block_bytes)
        return int(-(-concurrency * per_request // 1))


def kv_pool(layers: list[LayerKV], block_size: int, max_num_batched_tokens: int) -> KVPool:
    """The KV pool of one rank holding `layers`."""
    return KVPool(tuple(kv_groups(layers)), block_size, max_num_batched_tokens)


def vllm_refusal(max_model_len: int, needed_bytes: int, available_bytes: int, estimated_max_len: int) -> str:
    """vLLM 0.11.0's message when one `max_model_len` request does not fit
    (`check_enough_kv_cache_memory`, kv_cache_utils.py L700-723), spelt as it prints it."""
    gib = 1 << 30
    estimated = (f"Based on the available memory, the estimated maximum model length is {estimated_max_len}."
                 if estimated_max_len > 0 else "")
    return (f"To serve at least one request with the models's max seq len ({max_model_len}), "
            f"({needed_bytes / gib:.2f} GiB KV cache is needed, which is larger than the available KV cache "
            f"memory ({available_bytes / gib:.2f} GiB). {estimated} Try increasing `gpu_memory_utilization` or "
            "decreasing `max_model_len` when initializing the engine.")


VLLM_NO_MEMORY = ("No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when "
                  "initializing the engine.")


def sglang_cell_bytes(config: Any, tp: int, kv_cache_dtype: str, model_dtype_bytes: int) -> int:
    """SGLang's `cell_size`: KV bytes of one token over all layers of one rank
    (`ModelRunner.profile_max_num_token`, model_runner.py L1274-1287 at sglang 0.5.3):
    `(kv_lora_rank + qk_rope_head_dim) x layers x bytes` for MLA, else
    `kv_heads(tp) x head_dim x layers x 2 x bytes`. Sliding-window layers are charged in full."""
    elem = kv_cache_dtype_bytes(kv_cache_dtype, model_dtype_bytes)
    layers = int(config.num_hidden_layers)
    if is_mla(config):
        return (int(config.kv_lora_rank) + int(config.qk_rope_head_dim)) * layers * elem
    return kv_heads_per_rank(config, tp) * head_dim(config) * layers * 2 * elem
