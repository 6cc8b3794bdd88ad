"""`estimate_serving`: how a vLLM or SGLang server sizes its memory on one GPU, term by term.

For one rank of a TP x PP deployment (the heaviest), from the model's config and the
engine's flags, with the engine's own defaults filled in (`memplan.inference.engines`):

1. **weights** as the engine's loader lays them out (`memplan.inference.weights`);
2. **activation peak** of the start-up profile run (`memplan.inference.activation`: a model
   of vLLM's code, not a trace of the Hugging Face forward);
3. **non-torch memory**: what rises outside PyTorch during the profile run
   (`NON_TORCH_RISE_BYTES`), and what lies outside the budget: the CUDA context and the
   NCCL buffers made before the start-up snapshot (`memplan.hardware.devices`);
4. **CUDA graphs**: the pool capture really holds (the forward's intermediates at the
   largest captured batch, plus `GRAPH_OVERHEAD_BYTES` per graph) and, from vLLM 0.21,
   the engine's own estimate subtracted from the budget;
5. **the KV pool**: vLLM's `requested = total x gpu_memory_utilization` minus the terms
   its version counts, or SGLang's `free_at_init x mem_fraction_static - weights`; then
   pages, blocks, tokens and concurrency (`memplan.inference.kv`).

The answers: KV bytes and tokens, blocks, the maximum concurrency at `max_model_len`, the
largest `max_model_len` that starts, the engine's own refusal message when it would not
start, the utilisation (and `--kv-cache-memory-bytes`) for a target concurrency, and the
device memory `nvidia-smi` would show. Assumes one model per GPU, no other process on it,
no LoRA, no speculative decoding, no multimodal encoder, no prefix-cache offload.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from memplan.errors import UserError
from memplan.hardware.devices import DeviceProfile, device_profile
from memplan.inference import engines
from memplan.inference.activation import (
    SAMPLERS,
    ActivationPeak,
    graph_pool_bytes,
    profile_activation,
)
from memplan.inference.kv import (
    VLLM_NO_MEMORY,
    KVPool,
    kv_layers,
    kv_pool,
    sglang_cell_bytes,
    vllm_refusal,
)
from memplan.inference.weights import (
    WeightFigures,
    meta_parameters,
    quant_scheme,
    stage_layers,
    weight_figures,
)
from memplan.models.registry import FactorySpec, load_config

# Non-torch memory that rises during vLLM's profile run at TP 1 (CUDA modules loaded lazily
# by the first forward: cuBLASLt, FlashAttention, Triton kernels); published V1 logs show
# "non-torch forward increase memory" of 0.04-0.25 GiB for 8B models (docs/serving.md).
NON_TORCH_RISE_BYTES = 128 * (1 << 20)
GRAPH_OVERHEAD_BYTES = 1 << 20  # per captured graph; vLLM 0.21's estimator floors each graph at 1 MiB
DTYPES = {"auto": None, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2}
ENTRIES = ("server", "llm")
GIB = 1 << 30
SERVE_FORMAT = "memplan-serve"  # the "format" of `to_json()` (`memplan report` reads it)


@dataclass
class ServingEstimate:
    """What `memplan serve` reports; `to_json()` is its `--json` object. Bytes per rank."""

    model: str
    engine: str
    engine_rules: dict[str, Any]
    gpu: str
    capacity_bytes: int
    settings: dict[str, Any]
    weights: WeightFigures
    activation: ActivationPeak
    non_torch_rise_bytes: int
    outside_budget_bytes: dict[str, int]
    graphs: dict[str, Any]
    budget_bytes: int
    kv_available_bytes: int
    kv: dict[str, Any]
    device_used_bytes: int
    starts: bool
    refusal: str | None
    max_model_len_that_starts: int
    target: dict[str, Any] | None
    assumptions: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def margin_bytes(self) -> int:
        return self.capacity_bytes - self.device_used_bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "format": SERVE_FORMAT, "model": self.model, "engine": self.engine, "engine_rules": self.engine_rules,
            "gpu": self.gpu,
            "capacity_bytes": self.capacity_bytes, "settings": self.settings, "weights": self.weights.to_json(),
            "activation": self.activation.to_json(), "non_torch_rise_bytes": self.non_torch_rise_bytes,
            "outside_budget_bytes": self.outside_budget_bytes, "cuda_graphs": self.graphs,
            "budget_bytes": self.budget_bytes, "kv_available_bytes": self.kv_available_bytes, "kv": self.kv,
            "device_used_bytes": self.device_used_bytes, "margin_bytes": self.margin_bytes, "starts": self.starts,
            "refusal": self.refusal, "max_model_len_that_starts": self.max_model_len_that_starts,
            "target": self.target, "assumptions": self.assumptions, "elapsed_s": round(self.elapsed_s, 3),
        }


@dataclass
class ServeJob:
    """The resolved inputs of one estimate."""

    name: str
    config: Any
    profile: DeviceProfile
    capacity_bytes: int
    tp: int
    pp: int
    dtype_bytes: int
    quantization: str | None
    kv_cache_dtype: str
    max_model_len: int
    block_size: int | None
    enforce_eager: bool
    sampler: str


def estimate_serving(
    model: str | Any,
    engine: str = "vllm",
    gpu: str = "h100-80gb",
    *,
    tp: int = 1,
    pp: int = 1,
    dtype: str = "auto",
    quantization: str | None = None,
    kv_cache_dtype: str = "auto",
    max_model_len: int | None = None,
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int | None = None,
    gpu_memory_utilization: float | None = None,
    mem_fraction_static: float | None = None,
    kv_cache_memory_bytes: int | None = None,
    enforce_eager: bool = False,
    block_size: int | None = None,
    engine_version: str | None = None,
    entry: str = "server",
    sampler: str = "native",
    target_concurrency: float | None = None,
    capacity: int | None = None,
    resident_bytes: int = 0,
) -> ServingEstimate:
    """The memory of serving `model` with `engine` on one `gpu` per rank (see the module
    docstring). Flags are the engine's (`max_num_seqs`, `gpu_memory_utilization`...);
    None fills in the engine's default. `entry` is how vLLM is started ("server": `vllm
    serve`, "llm": the `LLM` class), which picks its batch defaults; `sampler` is vLLM's
    top-k/top-p implementation ("native": PyTorch's, "flashinfer" where FlashInfer is
    installed). `target_concurrency` asks for the utilisation that holds that many
    `max_model_len` requests. `capacity` (bytes) replaces the profile's total memory.
    `resident_bytes`: device memory something else holds when the engine starts (a
    colocated trainer's tensors), which vLLM V1's start-up check finds missing from the
    free memory."""
    start = time.perf_counter()
    job = _job(model, engine, gpu, tp, pp, dtype, quantization, kv_cache_dtype, max_model_len, block_size,
               enforce_eager, sampler, entry, capacity)
    if engine == "vllm":
        if mem_fraction_static is not None:
            raise UserError("--mem-fraction-static is SGLang's: vLLM takes --gpu-memory-utilization")
        result = _vllm(job, engines.vllm_rules(engine_version), entry, max_num_seqs, max_num_batched_tokens,
                       gpu_memory_utilization, kv_cache_memory_bytes, target_concurrency, resident_bytes)
    else:
        if gpu_memory_utilization is not None or kv_cache_memory_bytes is not None:
            raise UserError("--gpu-memory-utilization and --kv-cache-memory-bytes are vLLM's: SGLang takes "
                            "--mem-fraction-static")
        result = _sglang(job, engine_version, max_num_seqs, max_num_batched_tokens, mem_fraction_static,
                         target_concurrency)
    result.elapsed_s = time.perf_counter() - start
    return result


def _job(model: Any, engine: str, gpu: str, tp: int, pp: int, dtype: str, quantization: str | None,
         kv_cache_dtype: str, max_model_len: int | None, block_size: int | None, enforce_eager: bool,
         sampler: str, entry: str, capacity: int | None) -> ServeJob:
    if engine not in engines.ENGINES:
        raise UserError(f"--engine {engine!r}: memplan serve models {' and '.join(engines.ENGINES)}")
    if entry not in ENTRIES:
        raise UserError(f"--entry {entry!r}: server (vllm serve) or llm (the LLM class)")
    if sampler not in SAMPLERS:
        raise UserError(f"--sampler {sampler!r}: {' or '.join(SAMPLERS)}")
    if tp < 1 or pp < 1:
        raise UserError("--tp and --pp are at least 1")
    name = model if isinstance(model, str) else (getattr(model, "name_or_path", "") or type(model).__name__)
    config = load_config(model) if isinstance(model, str) else model
    if isinstance(config, FactorySpec):
        raise UserError(f"model '{config.spec}' is a factory: memplan serve needs a config (registry name, "
                        "config.json or Hub id)")
    if not hasattr(config, "num_hidden_layers") and hasattr(config, "text_config"):
        config = config.text_config  # a multimodal config: its language model (the encoder is not modelled)
    if config.num_attention_heads % tp:
        raise UserError(f"--tp {tp} does not divide the model's {config.num_attention_heads} attention heads")
    profile = device_profile(gpu)
    if profile.cuda_context_bytes is None or profile.platform != "cuda":
        raise UserError(f"{profile.name} is not a CUDA GPU with a known CUDA context: memplan serve models "
                        "vLLM and SGLang on NVIDIA GPUs")
    positions = int(getattr(config, "max_position_embeddings", 0) or 0)
    if max_model_len is None:
        if not positions:
            raise UserError("the config has no max_position_embeddings: pass --max-model-len")
        max_model_len = positions
    if max_model_len < 1:
        raise UserError("--max-model-len is at least 1")
    if positions and max_model_len > positions:
        raise UserError(f"--max-model-len {max_model_len} is longer than the model's {positions} positions "
                        "(max_position_embeddings): the engines refuse it")
    return ServeJob(name, config, profile, int(capacity or profile.capacity_bytes), tp, pp,
                    _dtype_bytes(config, dtype), quantization, kv_cache_dtype, max_model_len, block_size,
                    enforce_eager, sampler)


def _dtype_bytes(config: Any, dtype: str) -> int:
    """Bytes of the weights' dtype: "auto" is the config's (fp32 configs served in bf16)."""
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r}: auto, bfloat16 or float16")
    return DTYPES[dtype] or 2


def _rank_layers(job: ServeJob) -> list:
    """The KV layers of the pipeline stage with the most blocks."""
    layers = kv_layers(job.config, job.tp, job.kv_cache_dtype, job.dtype_bytes)
    stages = stage_layers(len(layers), job.pp)
    heaviest = max(range(job.pp), key=lambda s: stages[s])
    first = sum(stages[:heaviest])
    return layers[first:first + stages[heaviest]]


def _weights(job: ServeJob) -> WeightFigures:
    scheme = quant_scheme(job.config, job.quantization)
    return weight_figures(meta_parameters(job.config), job.config, job.tp, job.pp, job.dtype_bytes, scheme)


def _outside_budget(job: ServeJob) -> dict[str, int]:
    """Device memory made before the start-up snapshot: the CUDA context, NCCL buffers."""
    communicators = (job.tp > 1) + (job.pp > 1)
    return {"cuda_context_bytes": job.profile.context_bytes(), "nccl_bytes": job.profile.nccl_bytes(communicators)}


def _graphs(job: ServeJob, sizes: list[int], in_budget: bool) -> dict[str, Any]:
    """The CUDA-graph pool capture holds, and the engine's estimate where it makes one."""
    if not sizes:
        return {"captured": 0, "largest_batch": 0, "pool_bytes": 0, "engine_estimate_bytes": 0}
    pool = graph_pool_bytes(job.config, job.tp, max(sizes), job.dtype_bytes) + len(sizes) * GRAPH_OVERHEAD_BYTES
    return {"captured": len(sizes), "largest_batch": max(sizes), "pool_bytes": pool,
            "engine_estimate_bytes": pool if in_budget else 0}


def _vllm_batch(job: ServeJob, rules: engines.VllmRules, entry: str, max_num_seqs: int | None,
                max_num_batched_tokens: int | None) -> tuple[int, int]:
    tokens, seqs = rules.batch_defaults(job.capacity_bytes, job.profile.name, entry, job.max_model_len)
    tokens = max_num_batched_tokens or tokens
    seqs = max_num_seqs or min(seqs, tokens)
    if not rules.v1 and tokens < job.max_model_len:
        raise UserError(f"--max-num-batched-tokens {tokens} is below --max-model-len {job.max_model_len}: vLLM V0 "
                        "without chunked prefill refuses it")
    return tokens, seqs


def _vllm(job: ServeJob, rules: engines.VllmRules, entry: str, max_num_seqs: int | None,
          max_num_batched_tokens: int | None, utilization: float | None, kv_cache_memory_bytes: int | None,
          target_concurrency: float | None, resident_bytes: int = 0) -> ServingEstimate:
    tokens, seqs = _vllm_batch(job, rules, entry, max_num_seqs, max_num_batched_tokens)
    utilization = rules.default_utilization if utilization is None else utilization
    if not 0 < utilization <= 1:
        raise UserError(f"--gpu-memory-utilization {utilization} must be in (0, 1]")
    block = job.block_size or (64 if getattr(job.config, "kv_lora_rank", None) else 16)
    weights = _weights(job)
    activation = profile_activation(job.config, job.tp, tokens, min(tokens, seqs), job.dtype_bytes,
                                    sampler=job.sampler, workspace_bytes=job.profile.cublas_workspace_bytes)
    outside = _outside_budget(job)
    non_torch = NON_TORCH_RISE_BYTES if rules.non_torch_counted else 0
    graphs = _graphs(job, [] if job.enforce_eager else rules.capture_sizes(seqs, tokens), rules.graphs_in_budget)
    requested = int(job.capacity_bytes * utilization)
    non_kv = weights.total_bytes + activation.total_bytes + non_torch + graphs["engine_estimate_bytes"]
    if rules.context_in_budget:
        non_kv += sum(outside.values())
    available = int(kv_cache_memory_bytes) if kv_cache_memory_bytes is not None else requested - non_kv
    pool = kv_pool(_rank_layers(job), block, tokens)
    refusal = _vllm_refusal(job, rules, requested, outside, pool, available, utilization, resident_bytes)
    blocks = pool.num_blocks(available) if refusal is None else 0
    kv_bytes = blocks * pool.block_bytes
    used = (sum(outside.values()) + weights.total_bytes + kv_bytes + non_torch + activation.total_bytes
            + graphs["pool_bytes"])
    target = None
    if target_concurrency is not None:
        kv_needed = pool.blocks_for_concurrency(target_concurrency, job.max_model_len) * pool.block_bytes
        target = {"concurrency": target_concurrency, "kv_cache_memory_bytes": kv_needed,
                  "gpu_memory_utilization": math.ceil((kv_needed + non_kv) / job.capacity_bytes * 1e4) / 1e4}
    settings = {"tp": job.tp, "pp": job.pp, "dtype_bytes": job.dtype_bytes, "quantization": job.quantization,
                "kv_cache_dtype": job.kv_cache_dtype, "max_model_len": job.max_model_len,
                "max_num_seqs": seqs, "max_num_batched_tokens": tokens, "gpu_memory_utilization": utilization,
                "kv_cache_memory_bytes": kv_cache_memory_bytes, "block_size": block,
                "enforce_eager": job.enforce_eager, "entry": entry, "sampler": job.sampler}
    return ServingEstimate(
        job.name, "vllm", engines.rules_to_json(rules), job.profile.key, job.capacity_bytes, settings, weights,
        activation, non_torch, outside, graphs, requested, available, _kv_json(pool, blocks, job.max_model_len),
        used, refusal is None, refusal, pool.max_model_len(available, _max_positions(job)), target,
        _vllm_assumptions(job, rules, entry))


def _max_positions(job: ServeJob) -> int:
    return int(getattr(job.config, "max_position_embeddings", 0) or job.max_model_len)


def _vllm_refusal(job: ServeJob, rules: engines.VllmRules, requested: int, outside: dict[str, int], pool: KVPool,
                  available: int, utilization: float, resident_bytes: int = 0) -> str | None:
    """The message vLLM stops with, or None when it starts."""
    free = job.capacity_bytes - sum(outside.values()) - resident_bytes
    if rules.v1 and free < requested:
        gib = lambda b: round(b / GIB, 2)  # noqa: E731 - spelt as vLLM's gpu_worker.py L186
        return (f"Free memory on device ({gib(free)}/{gib(job.capacity_bytes)} GiB) on startup is less than desired "
                f"GPU memory utilization ({utilization}, {gib(requested)} GiB). Decrease GPU memory utilization or "
                "reduce GPU memory used by other processes.")
    if available <= 0:
        return VLLM_NO_MEMORY
    needed = pool.request_bytes(job.max_model_len)
    if needed > available:
        return vllm_refusal(job.max_model_len, needed, available, pool.max_model_len(available, job.max_model_len))
    return None


def _kv_json(pool: KVPool, blocks: int, max_model_len: int) -> dict[str, Any]:
    return {"bytes": blocks * pool.block_bytes, "blocks": blocks, "tokens": pool.tokens(blocks),
            "block_size": pool.block_size, "page_bytes": pool.page_bytes, "group_size": pool.group_size,
            "groups": [{"kind": g.layer.kind, "layers": g.layers, "window": g.layer.window} for g in pool.groups],
            "bytes_per_token": pool.block_bytes * len(pool.groups) // pool.block_size,
            "request_bytes": pool.request_bytes(max_model_len),
            "max_concurrency": round(pool.max_concurrency(blocks, max_model_len), 2) if blocks else 0.0}


def _vllm_assumptions(job: ServeJob, rules: engines.VllmRules, entry: str) -> list[str]:
    return [
        f"vLLM {rules.version}: KV = {rules.budget_rule}",
        f"batch defaults of the {'OpenAI server (vllm serve)' if entry == 'server' else 'LLM class'} on "
        f"{job.profile.name}",
        f"activation peak modelled from vLLM's model code and its {job.sampler} sampler, not traced",
        "CUDA context and NCCL buffers made before the start-up snapshot"
        + (" count against the budget" if rules.context_in_budget else " lie outside the budget"),
        "CUDA graphs: " + ("none (--enforce-eager)" if job.enforce_eager else
                          "the engine's estimate is subtracted from the budget" if rules.graphs_in_budget else
                          "captured after the KV cache is allocated, outside the budget"),
    ]


def _sglang(job: ServeJob, version: str | None, max_running_requests: int | None, chunked_prefill_size: int | None,
            fraction: float | None, target_concurrency: float | None) -> ServingEstimate:
    layers = kv_layers(job.config, job.tp, job.kv_cache_dtype, job.dtype_bytes)
    if len({layer.kind for layer in layers}) > 1:
        raise UserError("SGLang's hybrid sliding-window KV pools are not modelled: memplan serve --engine sglang "
                        "covers models whose layers all have the same attention kind")
    gpu_mib = job.capacity_bytes / (1 << 20)
    rules = engines.sglang_rules(version, gpu_mib, job.tp, job.pp, chunked_prefill_size=chunked_prefill_size,
                                 mem_fraction_static=fraction)
    if not 0 < rules.mem_fraction_static < 1:
        raise UserError(f"--mem-fraction-static {rules.mem_fraction_static} must be in (0, 1)")
    weights = _weights(job)
    outside = _outside_budget(job)
    at_init = job.capacity_bytes - sum(outside.values())
    reserve = int(at_init * (1 - rules.mem_fraction_static))
    rest = at_init - weights.total_bytes - reserve
    cell = sglang_cell_bytes(job.config, job.tp, job.kv_cache_dtype, job.dtype_bytes) * max(
        stage_layers(int(job.config.num_hidden_layers), job.pp)) // int(job.config.num_hidden_layers)
    tokens = max(rest // cell, 0)
    refusal = None if tokens > 0 else ("Not enough memory. Please try to increase --mem-fraction-static. Current "
                                       f"value: self.server_args.mem_fraction_static={rules.mem_fraction_static}")
    requests = max_running_requests or rules.cuda_graph_max_bs
    activation = profile_activation(job.config, job.tp, rules.chunked_prefill_size, min(requests, 1 << 30),
                                    job.dtype_bytes, sampler="flashinfer",
                                    workspace_bytes=job.profile.cublas_workspace_bytes)
    sizes = [] if job.enforce_eager else list(range(1, rules.cuda_graph_max_bs + 1))
    graphs = _graphs(job, [s for s in sizes if s in (1, 2, 4) or s % 8 == 0], False)
    kv_bytes = tokens * cell
    used = sum(outside.values()) + weights.total_bytes + kv_bytes + activation.total_bytes + graphs["pool_bytes"]
    kv = {"bytes": kv_bytes, "tokens": int(tokens), "cell_bytes": cell, "blocks": int(tokens), "block_size": 1,
          "max_concurrency": round(tokens / job.max_model_len, 2), "headroom_bytes": reserve,
          "headroom_needed_bytes": activation.total_bytes + graphs["pool_bytes"]}
    target = None
    if target_concurrency is not None:
        needed = int(math.ceil(target_concurrency * job.max_model_len)) * cell
        target = {"concurrency": target_concurrency, "kv_bytes": needed,
                  "mem_fraction_static": math.ceil((needed + weights.total_bytes) / at_init * 1e3) / 1e3}
    settings = {"tp": job.tp, "pp": job.pp, "dtype_bytes": job.dtype_bytes, "quantization": job.quantization,
                "kv_cache_dtype": job.kv_cache_dtype, "max_model_len": job.max_model_len,
                "mem_fraction_static": rules.mem_fraction_static, "chunked_prefill_size": rules.chunked_prefill_size,
                "cuda_graph_max_bs": rules.cuda_graph_max_bs, "enforce_eager": job.enforce_eager}
    assumptions = [f"SGLang {rules.version}: KV = free at start-up x mem_fraction_static - weights",
                   "free at start-up = total - CUDA context - NCCL buffers; SGLang's GPU tiers read nvidia-smi's "
                   "total, taken here as the profile's (about 0.5 GiB less)",
                   "activation and CUDA-graph headroom is what mem_fraction_static leaves, not measured by SGLang"]
    return ServingEstimate(
        job.name, "sglang", engines.rules_to_json(rules), job.profile.key, job.capacity_bytes, settings, weights,
        activation, 0, outside, graphs, at_init, rest, kv, used, refusal is None, refusal,
        min(int(tokens), _max_positions(job)), target, assumptions)
