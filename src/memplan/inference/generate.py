"""`estimate_generation(model, generation, setup)`: the peak memory of one transformers
`generate()` call on one GPU (or on the host's CPU), traced like a training step.

Method: the call itself runs on fake tensors (`memplan.inference.gen_capture`: the model's own
code, prefill then N decode steps, with the cache class transformers 5.23 makes for it), and
the trace goes through the training estimate's own stages (`memplan.estimation.pipeline`):
the GPU-only terms of a CUDA job (`gpu_view`: cuBLAS's workspace), the allocator simulator
(`replay_counters`: PyTorch's caching allocator, expandable segments, or tensor bytes only),
and the figures at the allocated peak (`figures_full`), or for deep models with identical
blocks the same call at 3 and 4 blocks extrapolated to the full depth region by region
(`figures_extrapolated`, docs/estimation.md "Deep models": every block's cache and
activations are linear in the number of blocks in each prefill and decode step as in a
training step's forward). Device used = reserved + the CUDA context of the device profile.

`generate()` decides when to stop from its tensors' values; the trace is of a fixed-shape call
(`memplan.inference.gen_fixed`): B unpadded prompts of L tokens, exactly N new tokens each,
what a real call with `min_new_tokens = max_new_tokens = N` does. The breakdown puts the
weights (parameters and quantisation constants), the KV cache (the storages the cache's
layers hold, `gen_caches.cache_buffers`), the activations (logits included) and the rest
(inputs, buffers, the allocator's rounding and workspace) apart, at the peak; the peak's phase
is the prefill or the decode step it falls in. The method and its validation: docs/generation.md.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from memplan.capture.step import StepTrace
from memplan.errors import UserError
from memplan.estimation import layers
from memplan.estimation.layers import figures_extrapolated
from memplan.estimation.pipeline import (
    MIN_BLOCKS_TO_EXTRAPOLATE,
    TRACE_BLOCKS,
    Counters,
    Figures,
    HostFigures,
    check_options,
    figures_full,
    gpu_view,
    replay_counters,
)
from memplan.hardware.devices import DeviceProfile, device_profile
from memplan.inference.gen_capture import (
    CACHE_IMPLEMENTATIONS,
    GenerationSetup,
    GenerationTrace,
    capture_generation,
    check_generation,
    model_setup,
)
from memplan.inference.gen_parallel import check_tensor_parallel
from memplan.models.depth import num_layers, with_layers
from memplan.models.moe import experts_of
from memplan.models.registry import load_config
from memplan.models.setup import TrainingSetup
from memplan.parallel.traced import gloo_staging_buffers
from memplan.trace import edit as trace_edit
from memplan.trace.model import CATEGORY, Trace

if TYPE_CHECKING:  # transformers takes a second to import; only its config class is named here
    from transformers import PretrainedConfig

GENERATION_BREAKDOWN_KEYS = ("weights", "kv_cache", "activations", "other")
GENERATE_FORMAT = "memplan-generate"  # the "format" of `to_json()` (`memplan report` reads it)


@dataclass
class GenerationEstimate:
    """What `memplan generate` reports; `to_json()` is its `--json` object (bytes)."""

    model: str
    parameters: int
    setup: dict[str, Any]
    generation: dict[str, Any]
    device: str
    gpu: str | None
    allocator: str
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    device_used_bytes: int
    breakdown: dict[str, int]
    peak_phase: str
    capacity_bytes: int | None
    method: str
    assumptions: list[str]
    host: HostFigures = field(default_factory=HostFigures)
    elapsed_s: float = 0.0
    tp: int = 1  # ranks of tensor parallelism; the figures are rank 0's

    @property
    def fits(self) -> bool | None:
        return None if self.capacity_bytes is None else self.device_used_bytes <= self.capacity_bytes

    @property
    def margin_bytes(self) -> int | None:
        """Capacity left (negative: short by) at the peak; None without a capacity."""
        return None if self.capacity_bytes is None else self.capacity_bytes - self.device_used_bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "format": GENERATE_FORMAT, "model": self.model, "parameters": self.parameters, "setup": self.setup,
            "generation": self.generation, "tp": self.tp, "device": self.device, "gpu": self.gpu, "allocator": self.allocator,
            "peak_allocated_bytes": self.peak_allocated_bytes, "peak_reserved_bytes": self.peak_reserved_bytes,
            "device_used_bytes": self.device_used_bytes, "breakdown": dict(self.breakdown),
            "peak_phase": self.peak_phase, "host_peak_bytes": self.host.peak_bytes,
            "host_pinned_bytes": self.host.pinned_bytes, "capacity_bytes": self.capacity_bytes, "fits": self.fits,
            "margin_bytes": self.margin_bytes, "method": self.method, "assumptions": list(self.assumptions),
            "elapsed_s": round(self.elapsed_s, 3),
        }


def estimate_generation(
    model: str | PretrainedConfig,
    generation: GenerationSetup | None = None,
    setup: TrainingSetup | dict[str, Any] | None = None,
    device: str = "cuda",
    allocator: str = "caching",
    alloc_conf: str | None = None,
    capacity: int | None = None,
    gpu: str | None = None,
    *,
    cuda_context: int | None = None,
    extrapolate: bool = True,
    progress: bool = False,
    tp: int = 1,
) -> GenerationEstimate:
    """The peak memory of `model.generate(...)` for `generation` (a `GenerationSetup`: batch,
    input length, new tokens, cache, beams) on one `device` ("cuda" or "cpu").

    `setup`: the model's fields (`TrainingSetup`, or a dict of them: dtype, attn, quant,
    double_quant, quant_storage, compute_dtype, routing); the rest is as `memplan.estimate`:
    `allocator` caching, expandable, planned or none (tensor bytes, what torch.profiler shows on
    CPU), `gpu` a device profile, `capacity` overriding its capacity, `cuda_context` its context.
    `extrapolate=False` traces every block of a deep model. `tp` > 1: rank 0 of transformers'
    tensor-parallel model over `tp` GPUs (`memplan.inference.gen_parallel`), NCCL's buffers in
    device used; on "cpu", gloo's all-gather staging buffers in the peak.
    """
    start = time.perf_counter()
    generation = generation if generation is not None else GenerationSetup()
    check_options(device, allocator, alloc_conf, cuda_context)
    if allocator == "planned":
        raise UserError("--allocator planned plans one training step's addresses: use caching, expandable or none")
    profile = device_profile(gpu) if gpu is not None else None
    if capacity is None and profile is not None:
        capacity = profile.capacity_bytes
    name = model if isinstance(model, str) else (getattr(model, "name_or_path", "") or type(model).__name__)
    config = load_config(model) if isinstance(model, str) else model
    setup = model_setup(setup)
    check_generation(config, setup, generation, device)
    check_tensor_parallel(config, setup, generation.cache, tp)
    total = num_layers(config) or 0
    deep = extrapolate and total >= MIN_BLOCKS_TO_EXTRAPOLATE and _identical_blocks(config)
    depths = [TRACE_BLOCKS, TRACE_BLOCKS + 1] if deep else [None]
    traced = [capture_generation(with_layers(config, d) if d else config, setup, generation, device, tp)
              for d in depths]
    if progress:
        sys.stderr.write(f"traced generate() at {', '.join(str(g.layers) for g in traced)} blocks\n")
    views = [_device_view(g, setup, generation, device, profile) for g in traced]
    counters = [replay_counters(trace_edit.without_host(v), allocator, alloc_conf) for v in views]
    fig = None
    if deep:
        fig = figures_extrapolated((views[0], views[1]), (counters[0], counters[1]),
                                   layers.block_pattern(traced[0].blocks_path), TRACE_BLOCKS, total)
    if fig is None:
        if deep:
            traced, views, counters, deep = _full_depth(config, setup, generation, device, profile, allocator,
                                                        alloc_conf, tp)
        fig = figures_full(views[-1], counters[-1])
    breakdown = _breakdown(traced, views, counters, fig, total if deep else None)
    parameters = traced[-1].parameters if not deep else int(round(float(
        layers.extrapolate(traced[0].parameters, traced[1].parameters, TRACE_BLOCKS, total))))
    context = _context_bytes(profile, cuda_context) + _nccl_bytes(profile, tp) if device == "cuda" else 0
    return GenerationEstimate(
        model=name, parameters=parameters, setup=_model_fields(setup), generation=generation.to_dict(),
        device=device, gpu=gpu, allocator=allocator, peak_allocated_bytes=fig.peak_allocated_bytes,
        peak_reserved_bytes=fig.peak_reserved_bytes, device_used_bytes=fig.peak_reserved_bytes + context,
        breakdown=breakdown, peak_phase=generation_phase(views[-1], fig.peak_events[-1]),
        capacity_bytes=capacity, method="extrapolated" if deep else "full",
        assumptions=assumptions(config, setup, generation, traced[-1]), host=fig.host,
        elapsed_s=time.perf_counter() - start, tp=tp,
    )


def _full_depth(config: PretrainedConfig, setup: TrainingSetup, generation: GenerationSetup, device: str,
                profile: DeviceProfile | None, allocator: str, alloc_conf: str | None,
                tp: int) -> tuple[list[GenerationTrace], list[Trace], list[Counters], bool]:
    """The call traced at full depth, where the 3- and 4-block traces' regions do not line up."""
    sys.stderr.write("memplan: block extrapolation not applicable here; tracing the full depth\n")
    traced = [capture_generation(config, setup, generation, device, tp)]
    views = [_device_view(traced[0], setup, generation, device, profile)]
    return traced, views, [replay_counters(trace_edit.without_host(views[0]), allocator, alloc_conf)], False


def _identical_blocks(config: PretrainedConfig) -> bool:
    """Whether every block is of one kind (no per-layer `layer_types` that differ), which the
    block extrapolation assumes (a model alternating sliding and full layers is traced whole)."""
    types = getattr(config.get_text_config(decoder=True), "layer_types", None)
    return not isinstance(types, list) or len(set(types)) <= 1


def _device_view(traced: GenerationTrace, setup: TrainingSetup, generation: GenerationSetup, device: str,
                 profile: DeviceProfile | None) -> Trace:
    """The trace plus what a CUDA device adds (`memplan.estimation.pipeline.gpu_view`), or on
    a cpu with TP, gloo's all-gather staging buffers (`memplan.parallel.traced`)."""
    if device != "cuda":
        if traced.trace.meta.get("tp", 1) > 1:
            return trace_edit.with_extra_buffers(traced.trace, gloo_staging_buffers(traced.trace))
        return traced.trace
    step = StepTrace(traced.trace, traced.blocks_path, traced.parameters, 1, 1, generation.total_len, traced.layers)
    return gpu_view(step, setup, profile)


def _context_bytes(profile: DeviceProfile | None, override: int | None) -> int:
    """The CUDA context in device-used memory: `override`, else the profile's (0 without one)."""
    if override is not None:
        return int(override)
    return profile.context_bytes() if profile is not None else 0


def _nccl_bytes(profile: DeviceProfile | None, tp: int) -> int:
    """NCCL's buffers of the TP communicator outside PyTorch's allocator (the profile's; 0 without TP)."""
    return profile.nccl_bytes(1) if profile is not None and tp > 1 else 0


def _kv_mask(traced: GenerationTrace, trace: Trace) -> np.ndarray:
    mask = np.zeros(trace.num_buffers, bool)
    mask[np.asarray(traced.kv_buffers, np.int64)] = True
    return mask


def classes_at(trace: Trace, kv: np.ndarray, event: int, charged: np.ndarray) -> np.ndarray:
    """Bytes the allocator charges for the buffers live just after `event`, per
    `GENERATION_BREAKDOWN_KEYS` class (host memory left out)."""
    live = trace.live_at(event) & ~trace.host_mask()
    category = trace.buffers["category"]
    weights = live & (category == CATEGORY["parameter"])
    cache = live & kv & ~weights
    work = live & ~weights & ~cache & np.isin(category, [CATEGORY["activation"], CATEGORY["temporary"]])
    rest = live & ~weights & ~cache & ~work
    return np.array([float(charged[m].sum()) for m in (weights, cache, work, rest)])


def _breakdown(traced: list[GenerationTrace], views: list[Trace], counters: list[Counters], fig: Figures,
               target_layers: int | None) -> dict[str, int]:
    """The breakdown at the allocated peak (extrapolated to `target_layers` blocks from the
    pair of traces when given); what the classes do not cover (the allocator's unsplit tails) is other."""
    vectors = [classes_at(v, _kv_mask(g, v), e, c.charged_nbytes)
               for g, v, c, e in zip(traced, views, counters, fig.peak_events)]
    vector = vectors[-1] if target_layers is None else \
        layers.extrapolate(vectors[0], vectors[1], TRACE_BLOCKS, target_layers)
    out = np.maximum(np.rint(vector), 0)
    out[-1] += max(0.0, fig.peak_allocated_bytes - out.sum())
    return {k: int(v) for k, v in zip(GENERATION_BREAKDOWN_KEYS, out)}


def generation_phase(trace: Trace, event: int) -> str:
    """The part of the call running at `event`: the prefill (the first forward, and what comes
    before it) or decode step i (the i-th forward after it, and what follows it)."""
    op = int(trace.events["op"][event]) if 0 <= event < trace.num_events else -1
    step = int(trace.ops["iteration"][op]) if op >= 0 else 0
    return "prefill" if step <= 0 else f"decode step {step}"


def _model_fields(setup: TrainingSetup) -> dict[str, Any]:
    return {"dtype": setup.dtype, **{k: v for k, v in setup.to_dict().items()
                                     if k in ("attn", "quant", "double_quant", "quant_storage", "compute_dtype",
                                              "routing")}}


CACHE_RULES = {
    "dynamic": "DynamicCache: each layer's keys and values grow by torch.cat every step (old and new both "
               "live during the copy); sliding layers keep their last sliding_window - 1 tokens",
    "static": "StaticCache: keys and values preallocated at max_cache_len = input + new tokens - 1, "
              "batch x beams rows, in the model's dtype, written in place",
    "sliding": "StaticCache with sliding layers preallocated at min(sliding_window, max_cache_len)",
    "offloaded": "DynamicCache(offloading=True): the layer being updated and the next one on the GPU, the "
                 "others in pinned host memory",
    "quantized:int4": "QuantizedCache, quanto backend (traced), 4 bits, groups of 64, the last 128 tokens in "
                      "full precision until they are quantised",
    "quantized:int8": "QuantizedCache, HQQ backend, 8 bits, groups of 64, residual 128 tokens: HQQ's storage "
                      "is modelled from its code (its optimiser reads tensor values, which fake tensors lack), "
                      "not traced",
    "quantized:fp8": "QuantizedCache, fp8 backend: float8_e4m3 keys and values appended, a scale per tensor",
}


def assumptions(config: PretrainedConfig, setup: TrainingSetup, generation: GenerationSetup,
                traced: GenerationTrace) -> list[str]:
    """What the figures assume, one sentence each."""
    out = [f"fixed shape: {generation.batch} unpadded prompt(s) of {generation.input_len} tokens, exactly "
           f"{generation.new_tokens} new tokens each (min_new_tokens = max_new_tokens: no sequence stops early)",
           CACHE_RULES[generation.cache],
           "logits: " + ("the last position only (generate passes logits_to_keep=1)" if traced.trace.meta.get(
               "logits_to_keep") else "every prompt position at the prefill (the model takes no logits_to_keep)")]
    if generation.cache in ("static", "sliding") and traced.trace.meta.get("device") == "cuda":
        out.append("eager decoding: on CUDA, generate() compiles the decoding forward for a static cache "
                   "(transformers' auto-compile, CompileConfig mode reduce-overhead) unless "
                   "generation_config.disable_compile=True; the compiled forward and its CUDA graphs are not traced")
    if generation.beams > 1:
        out.append(f"beam search over {generation.beams} beams per prompt: the cache holds batch x beams rows")
    elif generation.sampling:
        out.append(f"sampling {generation.num_return_sequences} sequences per prompt: the cache holds "
                   "batch x sequences rows")
    if traced.trace.meta.get("tp", 1) > 1:
        out.append(f"tensor parallel over {traced.trace.meta['tp']} ranks as transformers applies its TP plan "
                   "(DistributedConfig(tp_size=T)): rank 0's shards, heads and KV cache; on CUDA, NCCL's buffers "
                   "of one communicator in device used; on a CPU, gloo's all-gather staging buffers")
    if experts_of(config):
        out.append(f"mixture of experts routed {setup.routing} (memplan.models.moe)")
    if setup.quant != "none":
        out.append(f"bitsandbytes {setup.quant} base weights, as from_pretrained with a BitsAndBytesConfig loads them")
    implementation = CACHE_IMPLEMENTATIONS[generation.cache][0]
    out.append(f"transformers' cache_implementation={implementation!r}")
    return out
