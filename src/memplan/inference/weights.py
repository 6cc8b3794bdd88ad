"""Weight bytes per GPU as a serving engine's loader lays them out.

The model is built on the meta device from its Hugging Face config (no memory, no
weights), and each parameter is charged to one tensor-parallel / pipeline rank by the
rules of vLLM's parallel layers (vLLM 0.11.0):

- vocabulary rows (`VocabParallelEmbedding`, `ParallelLMHead`) padded to a multiple of 64
  (`pad_vocab_size`, `vllm/model_executor/layers/vocab_parallel_embedding.py` L23, L60-63),
  then split over the TP ranks; a tied head is one tensor;
- linear layers split over TP (`ColumnParallelLinear` / `RowParallelLinear`), K and V
  replicated when the model has fewer KV heads than ranks (`QKVParallelLinear`: each rank
  keeps `max(1, kv_heads // tp)` heads); a row-parallel layer's bias is whole on each rank;
- routed experts split over TP (`FusedMoE` shards each expert's intermediate dimension);
  the router, DeepSeek's latent down-projections (`q_a_proj`, `kv_a_proj_with_mqa`:
  `ReplicatedLinear`) and norms whole on each rank;
- the rotary embedding's `cos_sin_cache` (`max_position_embeddings x rotary_dim` in the
  model dtype, one per model: `vllm/model_executor/layers/rotary_embedding/base.py`);
- pipeline stages of `len(layers) // pp` blocks, the remainder on the last stages
  (`vllm/distributed/utils.py` `get_pp_indices`); the first stage holds the embedding,
  the last the head; the heaviest stage is reported.

Quantised checkpoints keep their linear layers (experts included, the router excluded)
in the layout of their quantisation method (`QUANT_METHODS`): fp8 (one byte and a scale
per tensor, or per 128 x 128 block), AWQ / GPTQ int4 (packed weights, fp16 scales and
packed zeros per group, GPTQ's `g_idx`), bitsandbytes (nf4 with an absmax per 64 values,
or int8 with a scale per row) and MXFP4 experts (4 bits and one e8m0 scale per 32).
Embeddings, heads and norms stay in the model dtype. Any other method is refused.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from memplan.errors import UserError
from memplan.inference.kv import is_mla, kv_heads_per_rank, total_kv_heads

VOCAB_PADDING = 64  # vLLM DEFAULT_VOCAB_PADDING_SIZE
BNB_BLOCK = 64  # bitsandbytes 4-bit blocksize: one absmax per 64 values
BNB_NESTED_BLOCK = 256  # double quantisation: one fp32 absmax per 256 8-bit absmaxes
MXFP4_BLOCK = 32  # OCP MX: one e8m0 scale per 32 fp4 values

QUANT_METHODS = ("fp8", "awq", "gptq", "bitsandbytes", "mxfp4")
QUANT_ALIASES = {"awq_marlin": "awq", "gptq_marlin": "gptq", "gptq_marlin_24": "gptq", "bnb": "bitsandbytes"}

_VOCAB_NAMES = ("embed_tokens", "wte", "lm_head", "embed_in", "embed_out", "word_embeddings")
_HEAD_NAMES = ("lm_head", "embed_out")
_BLOCK = re.compile(r"\.(layers|h|blocks|layer|decoder\.layers)\.(\d+)\.")
_REPLICATED_LINEAR = ("q_a_proj", "kv_a_proj_with_mqa", "router", "mlp.gate")
_ROW_PARALLEL = ("o_proj", "down_proj", "c_proj", "dense", "out_proj", "fc2", "dense_4h_to_h", "w2", "wo")
_KV_PROJ = ("k_proj", "v_proj")


@dataclass(frozen=True)
class QuantScheme:
    """How a quantised checkpoint stores its linear layers."""

    method: str  # one of QUANT_METHODS
    bits: int = 4
    group_size: int = 128
    block: tuple[int, int] | None = None  # fp8 block-wise scales
    double_quant: bool = False  # bitsandbytes nested absmax
    experts_only: bool = False  # MXFP4 (gpt-oss): only the routed experts are quantised

    def matrix_bytes(self, rows: int, cols: int, count: int = 1) -> float:
        """Bytes of `count` matrices of `rows` x `cols` (out x in) on one rank."""
        n = rows * cols
        if self.method == "fp8":
            scales = math.ceil(rows / self.block[0]) * math.ceil(cols / self.block[1]) * 4 if self.block else 8
            return count * (n + scales)
        if self.method in ("awq", "gptq"):
            groups = math.ceil(cols / self.group_size) * rows
            packed = n * self.bits / 8 + groups * 2 + groups * self.bits / 8  # weights, fp16 scales, zeros
            return count * (packed + (cols * 4 if self.method == "gptq" else 0))  # GPTQ's int32 g_idx
        if self.method == "bitsandbytes":
            if self.bits == 8:
                return count * (n + rows * 4)
            absmax = n / BNB_BLOCK * (1 + 4 / BNB_NESTED_BLOCK) if self.double_quant else n / BNB_BLOCK * 4
            return count * (n / 2 + absmax)
        if self.method == "mxfp4":
            return count * (n / 2 + n / MXFP4_BLOCK)
        raise AssertionError(self.method)


def quant_scheme(config: Any, quantization: str | None) -> QuantScheme | None:
    """The scheme of `--quantization` (or of the config's `quantization_config` when the
    flag is not given); None for an unquantised model. `UserError` for another method."""
    qc = getattr(config, "quantization_config", None) or {}
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method = quantization or qc.get("quant_method")
    if method in (None, "", "none"):
        return None
    method = QUANT_ALIASES.get(str(method).lower(), str(method).lower())
    if method not in QUANT_METHODS:
        raise UserError(f"quantization {method!r} is not modelled: memplan serve knows {', '.join(QUANT_METHODS)} "
                        "(and unquantised bf16/fp16)")
    if method == "fp8":
        block = qc.get("weight_block_size")
        return QuantScheme("fp8", 8, block=tuple(block) if block else None)
    if method in ("awq", "gptq"):
        return QuantScheme(method, int(qc.get("bits", qc.get("w_bit", 4))),
                           int(qc.get("group_size", qc.get("q_group_size", 128))))
    if method == "bitsandbytes":
        eight = bool(qc.get("load_in_8bit"))
        return QuantScheme("bitsandbytes", 8 if eight else 4, double_quant=bool(qc.get("bnb_4bit_use_double_quant")))
    return QuantScheme("mxfp4", 4, experts_only=True)


@dataclass
class WeightFigures:
    """Weight bytes of the heaviest rank, by part."""

    embedding_bytes: int = 0  # vocabulary rows: embedding and head
    blocks_bytes: int = 0  # the transformer blocks of the stage
    other_bytes: int = 0  # final norm, position embeddings
    rope_cache_bytes: int = 0
    stage_layers: int = 0
    parts: dict[str, int] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return self.embedding_bytes + self.blocks_bytes + self.other_bytes + self.rope_cache_bytes

    def to_json(self) -> dict[str, Any]:
        return {"total_bytes": self.total_bytes, "embedding_bytes": self.embedding_bytes,
                "blocks_bytes": self.blocks_bytes, "other_bytes": self.other_bytes,
                "rope_cache_bytes": self.rope_cache_bytes, "stage_layers": self.stage_layers}


def stage_layers(layers: int, pp: int) -> list[int]:
    """Blocks per pipeline stage: `layers // pp` each, the remainder on the last stages."""
    if pp > layers:
        raise UserError(f"--pp {pp} is more pipeline stages than the model's {layers} layers")
    parts = [layers // pp] * pp
    for i in range(1, layers % pp + 1):
        parts[-i] += 1
    return parts


def rotary_dim(config: Any) -> int:
    """Width of the rotary embedding: MLA's rope part, else head_dim x partial_rotary_factor;
    0 for a model without rotary positions."""
    if getattr(config, "rope_theta", None) is None and not _rope_parameters(config):
        return 0
    if is_mla(config):
        return int(config.qk_rope_head_dim)
    head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    factor = getattr(config, "partial_rotary_factor", None) or 1.0
    return int(head * factor)


def _rope_parameters(config: Any) -> dict[str, Any]:
    value = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    return value if isinstance(value, dict) else {}


def _param_rank_bytes(name: str, shape: tuple[int, ...], config: Any, tp: int, dtype_bytes: int,
                      quant: QuantScheme | None) -> float:
    """Bytes one TP rank keeps of one block parameter."""
    n = math.prod(shape)
    leaf = name.rsplit(".", 1)[0]
    is_kv = leaf.endswith(_KV_PROJ)
    replicated = any(leaf.endswith(r) for r in _REPLICATED_LINEAR)
    if len(shape) == 1:
        row_bias = name.endswith("bias") and leaf.endswith(_ROW_PARALLEL)
        if "norm" in leaf or "ln_" in leaf or row_bias or replicated:
            return n * dtype_bytes
        if is_kv:
            return n / total_kv_heads(config) * kv_heads_per_rank(config, tp) * dtype_bytes
        return n * dtype_bytes / tp
    experts = len(shape) == 3
    if experts and name.endswith("_bias"):
        return n * dtype_bytes / (1 if "down" in name else tp)
    count, rows, cols = (shape[0], shape[-2], shape[-1]) if experts else (1, shape[0], shape[-1])
    if replicated:
        share = 1.0
    elif is_kv:
        share = kv_heads_per_rank(config, tp) / total_kv_heads(config)
    else:
        share = 1.0 / tp
    if quant is None or (quant.experts_only and not experts) or leaf.endswith(("router", "mlp.gate")):
        return n * share * dtype_bytes
    return quant.matrix_bytes(max(1, round(rows * share)), cols, count)


def weight_figures(model_params: list[tuple[str, tuple[int, ...]]], config: Any, tp: int, pp: int,
                   dtype_bytes: int, quant: QuantScheme | None) -> WeightFigures:
    """Weight bytes of the heaviest rank of a TP x PP layout, from the model's (name, shape)
    list (`named_parameters` of the model built on the meta device, tied weights once)."""
    layers = int(config.num_hidden_layers)
    stages = stage_layers(layers, pp)
    per_layer: dict[int, float] = {}
    vocab_bytes: dict[str, float] = {}
    other = 0.0
    for name, shape in model_params:
        match = _BLOCK.search(f".{name}")
        if match is not None:
            index = int(match.group(2))
            per_layer[index] = per_layer.get(index, 0.0) + _param_rank_bytes(name, shape, config, tp, dtype_bytes,
                                                                           quant)
        elif any(part in name for part in _VOCAB_NAMES) and len(shape) == 2 and shape[0] >= config.vocab_size:
            rows = math.ceil(shape[0] / VOCAB_PADDING) * VOCAB_PADDING
            vocab_bytes[name] = math.ceil(rows / tp) * shape[1] * dtype_bytes
        else:
            other += math.prod(shape) * dtype_bytes
    rope = getattr(config, "max_position_embeddings", 0) * rotary_dim(config) * dtype_bytes
    heads = sum(v for k, v in vocab_bytes.items() if any(h in k for h in _HEAD_NAMES))
    embeds = sum(vocab_bytes.values()) - heads
    best = WeightFigures()
    start = 0
    for s, count in enumerate(stages):
        blocks = sum(per_layer.get(i, 0.0) for i in range(start, start + count))
        start += count
        vocab = (embeds if s == 0 else 0.0) + (heads if s == pp - 1 else 0.0)
        figures = WeightFigures(int(vocab), int(round(blocks)), int(other) if s == pp - 1 else 0, int(rope), count)
        if figures.total_bytes > best.total_bytes:
            best = figures
    return best


def built_layers(config: Any) -> int:
    """Blocks to build so that every later block repeats the last one built: DeepSeek's
    dense first blocks and one more, or every block where MoE and dense blocks interleave."""
    layers = int(config.num_hidden_layers)
    if (getattr(config, "decoder_sparse_step", 1) or 1) > 1 or getattr(config, "mlp_only_layers", None):
        return layers
    return min(layers, int(getattr(config, "first_k_dense_replace", 0) or 0) + 2)


def meta_parameters(config: Any) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter of the model `config` builds, on the meta device;
    the blocks past `built_layers` are copies of the last one built, renamed."""
    import torch

    from memplan.models.build import instantiate, model_class
    from memplan.models.depth import with_layers

    layers = int(config.num_hidden_layers)
    built = built_layers(config)
    with torch.device("meta"):
        model = instantiate(model_class(config), with_layers(config, built) if built < layers else config)
    params = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    last = [(name, shape) for name, shape in params if f".{built - 1}." in name and _BLOCK.search(f".{name}")]
    for index in range(built, layers):
        params += [(name.replace(f".{built - 1}.", f".{index}.", 1), shape) for name, shape in last]
    return params
