"""`estimate(model, setup, layout)`: per-GPU peak memory of one training step.

Pipeline (LLMem, IJCAI 2024, arXiv 2404.10933, measures memory after framework
initialisation and adds analytic terms; memplan instead *traces* the whole step on fake
tensors and adds only what a CPU trace cannot see):

1. capture the step on fake cpu tensors with the target device's code paths
   (`memplan.capture.step`), at full depth or, for deep models, at 2 and 3 blocks
   (`memplan.estimation.layers`);
2. per distinct rank of the parallel layout, trace that rank's step itself with FSDP2 /
   DTensor TP applied on a fake process group (`memplan.parallel.traced`), or, where
   that is not possible (DDP, ZeRO-1/2, PP without TP) or not asked for
   (`parallel_tracing=False`), reshape the single-device trace by the modelled rules
   (`memplan.parallel.rank_trace`); PP x TP traces the first rank of each distinct
   pipeline stage (first, a middle one, last), its 1F1B step with the stage's modules
   under the TP plan (`memplan.parallel.traced.capture_stage_rank`), at 3 and 4 blocks
   per stage for deep models; TP with what cannot be traced (DDP, ZeRO-1/2, more
   data-parallel ranks per stage, the interleaved schedule) traces the TP part and
   models the rest on it (`RankPlan.traced_transform`);
   TP that cannot be traced is refused (`UserError`) unless `parallel_tracing=False`;
   a cpu job traced on the fake group also gets gloo's all-gather staging buffers;
3. add the GPU-only terms (`memplan.trace.edit`: SDPA kernel workspaces,
   cuBLAS workspace) when the target is cuda;
4. replay through the allocator simulator (512-B rounding, caching / expandable
   segments) for peak allocated (`max_memory_allocated`) and peak reserved
   (`max_memory_reserved`); `allocator="none"` counts tensor bytes only;
5. device used = reserved + CUDA context + NCCL buffers (device profile);
   breakdown and phase at the allocated peak; fits = device used <= capacity.

Every term is listed, with how it was validated, in docs/estimation.md.
"""

from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from memplan.errors import UserError
from memplan.estimation import layers
from memplan.hardware.devices import DeviceProfile, device_profile
from memplan.hardware.roofline import matmul_dtype, step_seconds
from memplan.models.depth import num_layers, with_layers
from memplan.trace import edit as trace_edit
from memplan.trace.model import CATEGORY, Trace

ESTIMATE_ALLOCATORS = ("caching", "expandable", "planned", "none")
MIN_BLOCKS_TO_EXTRAPOLATE = 6  # below this, tracing the full depth is as fast
TRACE_BLOCKS = 3  # traces at 3 and 4 blocks: a middle block has neighbours on both sides
ROUND_BYTES = 512

BREAKDOWN_KEYS = ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "other")
_CATEGORY_TO_KEY = {
    CATEGORY["parameter"]: 0, CATEGORY["gradient"]: 1, CATEGORY["optimizer_state"]: 2,
    CATEGORY["activation"]: 3, CATEGORY["temporary"]: 4, CATEGORY["input"]: 5, CATEGORY["other"]: 5,
}


@dataclass
class RankEstimate:
    """One rank's figures (bytes)."""

    rank: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    device_used_bytes: int
    breakdown: dict[str, int]
    peak_phase: str
    ranks: list[int] = field(default_factory=list)  # the ranks this one stands for

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "device_used_bytes": self.device_used_bytes,
            "breakdown": dict(self.breakdown),
            "peak_phase": self.peak_phase,
            "same_as_ranks": self.ranks,
        }


@dataclass
class Estimate:
    """What `memplan estimate` reports; `to_json()` is its `--json` object."""

    model: str
    parameters: int
    setup: dict[str, Any]
    layout: dict[str, Any]
    per_rank: list[RankEstimate]
    capacity_bytes: int | None
    device: str
    allocator: str
    gpu: str | None
    method: str
    elapsed_s: float
    parallel: str = "single device"  # how the layout was applied: traced (fake process group) or modelled
    flops: float = 0.0
    bytes_moved: float = 0.0
    roofline_s: float = 0.0  # rank 0's compute time, per-op roofline over the device profile

    @property
    def peak_allocated_bytes(self) -> int:
        return max(r.peak_allocated_bytes for r in self.per_rank)

    @property
    def peak_reserved_bytes(self) -> int:
        return max(r.peak_reserved_bytes for r in self.per_rank)

    @property
    def device_used_bytes(self) -> int:
        return max(r.device_used_bytes for r in self.per_rank)

    @property
    def fits(self) -> bool | None:
        if self.capacity_bytes is None:
            return None
        return self.device_used_bytes <= self.capacity_bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "parameters": self.parameters,
            "setup": self.setup,
            "layout": self.layout,
            "device": self.device,
            "gpu": self.gpu,
            "allocator": self.allocator,
            "per_rank": [r.to_json() for r in self.per_rank],
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "device_used_bytes": self.device_used_bytes,
            "capacity_bytes": self.capacity_bytes,
            "fits": self.fits,
            "method": self.method,
            "parallel": self.parallel,
            "elapsed_s": round(self.elapsed_s, 3),
        }


@dataclass
class StepTrace:
    """A captured step and what the later stages need to know about its model."""

    trace: Trace
    blocks_path: str
    parameters: int
    heads: int
    head_dim: int
    seq: int
    layers: int


def capture_step(config: Any, setup: Any, device: str) -> StepTrace:
    """Trace one training step of `config` under `setup` on fake tensors for `device`."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memplan.capture import capture
    from memplan.capture.step import build_training_step
    from memplan.models import sequence_length
    from memplan.models.build import transformer_blocks

    with FakeTensorMode(allow_non_fake_inputs=True):
        step = build_training_step(config, setup, device="cpu", target_device=device)
        blocks = transformer_blocks(step.model)
        blocks_path = next(name for name, mod in step.model.named_modules() if mod is blocks)
        trace = capture(step.run, model=step.model, optimizer=step.optimizer, iterations=1, warmup=1,
                        meta={**step.meta, "fake": True}, inputs=step.batches)
    if device == "cuda":
        trace.devices = ["cuda:0" if name == "cpu" else name for name in trace.devices]
    heads = int(getattr(config, "num_attention_heads", 1) or 1)
    head_dim = getattr(config, "head_dim", None) or (int(getattr(config, "hidden_size", heads)) // heads)
    return StepTrace(trace, blocks_path, int(step.meta["parameters"]), heads, int(head_dim),
                     sequence_length(setup, config), len(blocks))


def gpu_view(step: StepTrace, setup: Any, profile: DeviceProfile | None) -> Trace:
    """The trace with the GPU-only buffers added (see `memplan.trace.edit`)."""
    extras = trace_edit.attention_kernel_buffers(step.trace, dtype=matmul_dtype(setup), attn=setup.attn,
                                                seq=step.seq, head_dim=step.head_dim)
    workspace = profile.cublas_workspace_bytes if profile is not None else 8_519_680
    extras += trace_edit.workspace_buffer(step.trace, workspace)
    return trace_edit.with_extra_buffers(step.trace, extras)


@dataclass
class Counters:
    """Series of one replay: allocated and reserved bytes after each event, and the
    per-buffer sizes the allocator charges (for the breakdown)."""

    allocated: np.ndarray
    reserved: np.ndarray
    charged_nbytes: np.ndarray


def replay_counters(trace: Trace, allocator: str, alloc_conf: str | None) -> Counters:
    """Allocated and reserved series of `trace` under `allocator` (unlimited capacity)."""
    nbytes = trace.buffers["nbytes"]
    if allocator == "none":
        live = trace.live_bytes()
        return Counters(live, live, nbytes)
    from memplan.alloc import simulate

    charged = np.where(nbytes > 0, np.maximum(ROUND_BYTES, -(-nbytes // ROUND_BYTES) * ROUND_BYTES), 0)
    if allocator == "planned":
        # STWeaver plan of this very step (validated by the layout work's independent
        # checker before it is returned), replayed with its caching fallback.
        from memplan.layout import plan as make_plan

        result = simulate(trace, "planned", alloc_conf=alloc_conf, plan=make_plan(trace), segment_map=False)
    else:
        result = simulate(trace, allocator, alloc_conf=alloc_conf, segment_map=False)
    return Counters(result.allocated_bytes, result.reserved_bytes, charged)


def _breakdown(vector: np.ndarray, total: float) -> dict[str, int]:
    """Trace categories -> the report's six keys; the allocator's unsplit tails go to other."""
    out = np.zeros(len(BREAKDOWN_KEYS))
    for cat, key in _CATEGORY_TO_KEY.items():
        out[key] += vector[cat]
    out = np.maximum(np.rint(out), 0)
    out[5] += max(0.0, round(total) - out.sum())
    return {k: int(v) for k, v in zip(BREAKDOWN_KEYS, out)}


@dataclass
class Figures:
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    breakdown: dict[str, int]
    peak_phase: str


def figures_full(trace: Trace, counters: Counters) -> Figures:
    """Peaks of a full-depth trace."""
    event = int(np.argmax(counters.allocated)) if counters.allocated.shape[0] else -1
    peak = int(counters.allocated[event]) if event >= 0 else 0
    vector = layers.breakdown_vector(trace, event, counters.charged_nbytes) if event >= 0 else np.zeros(7)
    return Figures(peak, int(counters.reserved.max()) if counters.reserved.shape[0] else 0,
                   _breakdown(vector, peak), trace.phase_at(event))


def figures_extrapolated(pair: tuple[Trace, Trace], counters: tuple[Counters, Counters],
                         pattern: re.Pattern[str], k: int, target_layers: int) -> Figures | None:
    """Peaks at `target_layers` blocks from traces at k and k+1 blocks (None: regions differ)."""
    reg = [layers.regions(t, pattern) for t in pair]
    if not layers.check_regions(*reg):
        return None
    alloc = [layers.region_peaks(c.allocated, r) for c, r in zip(counters, reg)]
    resv = [layers.region_peaks(c.reserved, r) for c, r in zip(counters, reg)]
    alloc_full = layers.extrapolate(alloc[0].values, alloc[1].values, k, target_layers)
    resv_full = layers.extrapolate(resv[0].values, resv[1].values, k, target_layers)
    win = int(np.argmax(alloc_full))
    vectors = [layers.breakdown_vector(t, int(a.events[win]), c.charged_nbytes)
               for t, a, c in zip(pair, alloc, counters)]
    vector = layers.extrapolate(vectors[0], vectors[1], k, target_layers)
    peak = float(alloc_full[win])
    # The caching allocator's slack (reserved - allocated) does not grow linearly with
    # depth (segments are reused across blocks): keep the deeper trace's slack on top of
    # the extrapolated allocated peak, unless the linear reserved figure is larger.
    slack = float(counters[1].reserved.max() - counters[1].allocated.max())
    reserved = max(float(resv_full.max()), peak + slack)
    return Figures(int(round(peak)), int(round(reserved)), _breakdown(vector, peak),
                   pair[1].phase_at(int(alloc[1].events[win])))


def estimate(
    model: Any,
    setup: Any = None,
    layout: Any = None,
    device: str = "cuda",
    allocator: str = "caching",
    alloc_conf: str | None = None,
    capacity: int | None = None,
    gpu: str | None = None,
    *,
    extrapolate: bool = True,
    parallel_tracing: bool = True,
    progress: bool = False,
    cache: dict[Any, StepTrace] | None = None,
    cuda_context: int | None = None,
) -> Estimate:
    """Per-rank peak memory of one training step of `model` under `setup` and `layout`.

    `model`: a registry name, config path, or `PretrainedConfig`. `layout`: a
    `memplan.parallel.Layout` (None: one GPU). `device`: "cuda" (GPU terms added) or
    "cpu" (the step as it runs on this machine's CPU: no GPU terms). `allocator`:
    caching, expandable, planned, or none (tensor bytes only, what torch.profiler's
    memory timeline shows on CPU). `gpu` names a device profile (capacity, context,
    workspace); `capacity` overrides its capacity. `extrapolate=False` traces the
    full depth even for deep models. `parallel_tracing=False` models every layout from
    the single-device trace (`memplan.parallel.transform`) instead of tracing the
    parallel step on a fake process group where that is possible. `cache` (a dict the caller keeps) reuses captured
    steps across calls that differ only in layout or allocator (what `fit` does).
    `cuda_context` (bytes) overrides the profile's CUDA context, which is CUDA 12's
    lazy-loading one: eager kernel loading (CUDA < 11.7, or CUDA_MODULE_LOADING=EAGER)
    takes about 1 GB more.
    """
    from memplan import models
    from memplan.parallel import Layout, rank_plans

    start = time.perf_counter()
    setup = setup if setup is not None else models.TrainingSetup()
    layout = layout if layout is not None else Layout()
    if device not in ("cuda", "cpu"):
        raise UserError(f"unknown device {device!r}: use cuda or cpu")
    if allocator not in ESTIMATE_ALLOCATORS:
        raise UserError(f"unknown allocator {allocator!r}: choose one of {', '.join(ESTIMATE_ALLOCATORS)}")
    if cuda_context is not None and (isinstance(cuda_context, bool) or not isinstance(cuda_context, int)
                                     or cuda_context < 0):
        raise UserError(f"the CUDA context must be a size >= 0, not {cuda_context!r}")
    if alloc_conf is not None:
        from memplan.alloc import AllocConf

        AllocConf.parse(alloc_conf)  # a bad string is a UserError before any tracing
    profile = device_profile(gpu) if gpu is not None else None
    if capacity is None and profile is not None:
        capacity = profile.capacity_bytes
    name = model if isinstance(model, str) else type(model).__name__
    config = models.load_config(model) if isinstance(model, str) else model
    total_layers = num_layers(config)
    layout.check(config, setup)

    if parallel_tracing:
        from memplan.parallel.apply import untraceable_tensor_parallel

        refused = untraceable_tensor_parallel(layout, config, setup)
        if refused is not None:
            raise UserError(refused)
    if layout.fsdp_param_dtype is not None:
        from memplan.parallel.apply import traced_part

        if not parallel_tracing or traced_part(layout, config, setup) != layout:
            raise UserError("--fsdp-param-dtype is estimated where FSDP2 itself is traced (--zero 3, without --pp)")

    per_rank: list[RankEstimate] = []
    parameters = 0
    method = "full"
    parallel = "single device"
    flops = moved = roofline = 0.0
    for plan in rank_plans(layout, config, setup, total_layers):
        stage_layers = plan.layers
        deep = extrapolate and stage_layers is not None and stage_layers >= MIN_BLOCKS_TO_EXTRAPOLATE
        depths = [TRACE_BLOCKS, TRACE_BLOCKS + 1] if deep else [stage_layers]
        traced = parallel_tracing and plan.traceable
        steps = [_cached_capture(config, d, plan.setup, device, cache, plan.traced_layout if traced else None,
                                 plan.traced_rank) for d in depths]
        transform = plan.transform
        if traced:
            transform = _traced_view(device, plan.traced_transform)
        if progress:
            sys.stderr.write(f"traced rank {plan.rank} at {', '.join(str(s.layers) for s in steps)} blocks\n")
        views = []
        for step in steps:
            trace = transform(step)
            views.append(_device_view(trace, step, plan.setup, device, profile))
        counters = [replay_counters(t, allocator, alloc_conf) for t in views]
        fig = None
        if deep:
            pattern = layers.block_pattern(steps[0].blocks_path)
            fig = figures_extrapolated((views[0], views[1]), (counters[0], counters[1]), pattern,
                                       TRACE_BLOCKS, stage_layers)
            if fig is None:  # the regions did not line up: trace the full depth instead
                sys.stderr.write("memplan: block extrapolation not applicable here; tracing the full depth\n")
                full = _cached_capture(config, stage_layers if plan.layers != total_layers else None, plan.setup,
                                       device, None, plan.traced_layout if traced else None, plan.traced_rank)
                steps, views = [full], [_device_view(transform(full), full, plan.setup, device, profile)]
                counters = [replay_counters(views[0], allocator, alloc_conf)]
            else:
                method = "extrapolated"
        if fig is None:
            fig = figures_full(views[-1], counters[-1])
        if layout.world_size > 1:
            parallel = "modelled" if not traced else "traced" if plan.traced_transform is None else \
                "traced + modelled"
        if plan.rank == 0:
            if len(steps) == 2:
                parameters = int(round(float(layers.extrapolate(steps[0].parameters, steps[1].parameters,
                                                                TRACE_BLOCKS, total_layers or 0))))
                f = [float(np.nansum(s.trace.ops["flops"])) for s in steps]
                b = [float(np.nansum(s.trace.ops["bytes_moved"])) for s in steps]
                flops = float(layers.extrapolate(f[0], f[1], TRACE_BLOCKS, stage_layers))
                moved = float(layers.extrapolate(b[0], b[1], TRACE_BLOCKS, stage_layers))
                if profile is not None:
                    r = [step_seconds(s.trace, profile, matmul_dtype(plan.setup)) for s in steps]
                    roofline = float(layers.extrapolate(r[0], r[1], TRACE_BLOCKS, stage_layers))
            else:
                parameters = steps[0].parameters if layout.pp == 1 else models.count_parameters(config)
                flops = float(np.nansum(steps[0].trace.ops["flops"]))
                moved = float(np.nansum(steps[0].trace.ops["bytes_moved"]))
                if profile is not None:
                    roofline = step_seconds(steps[0].trace, profile, matmul_dtype(plan.setup))
            if layout.pp > 1 and len(steps) == 2:
                parameters = models.count_parameters(config)
        context = profile.cuda_context_bytes if (profile is not None and device == "cuda") else 0
        if cuda_context is not None and device == "cuda":
            context = cuda_context
        nccl = profile.nccl_bytes(plan.communicators) if (profile is not None and device == "cuda") else 0
        used = fig.peak_reserved_bytes + context + nccl
        per_rank.append(RankEstimate(plan.rank, fig.peak_allocated_bytes, fig.peak_reserved_bytes, used,
                                     fig.breakdown, fig.peak_phase, plan.same_as))
    return Estimate(
        model=name, parameters=parameters, setup=setup.to_dict(), layout=layout.to_dict(), per_rank=per_rank,
        capacity_bytes=capacity, device=device, allocator=allocator, gpu=gpu, method=method, parallel=parallel,
        elapsed_s=time.perf_counter() - start, flops=flops, bytes_moved=moved, roofline_s=roofline,
    )


def _device_view(trace: Trace, step: StepTrace, setup: Any, device: str, profile: DeviceProfile | None) -> Trace:
    """A rank's trace plus what its device adds that the capture cannot see: the GPU
    terms (`gpu_view`) for cuda, the checkpoints' CPU RNG states for cpu."""
    if device == "cuda":
        return gpu_view(StepTrace(trace, step.blocks_path, step.parameters, step.heads, step.head_dim, step.seq,
                                  step.layers), setup, profile)
    return trace_edit.with_extra_buffers(trace, checkpoint_rng_states(trace, step.blocks_path, setup))


CPU_RNG_STATE_BYTES = 5056  # torch.get_rng_state(): the CPU generator's mt19937 state


def checkpoint_rng_states(trace: Trace, blocks_path: str, setup: Any) -> list[trace_edit.ExtraBuffer]:
    """The CPU RNG state `torch.utils.checkpoint` saves per checkpointed call
    (`preserve_rng_state=True`: full and attention-only checkpointing, not torchtitan's
    op-level policy), from the block's forward to the end of its backward. It is made by
    `torch.get_rng_state()` outside the dispatcher, so the recorder does not see it; on a
    GPU it is host memory (and the CUDA generator's state a host tensor too), so only a
    cpu job's memory holds it."""
    from memplan.parallel.transform import block_spans

    if setup.checkpointing not in ("full", "selective"):
        return []
    device = int(np.bincount(trace.buffers["device"]).argmax()) if trace.num_buffers else 0
    return [trace_edit.ExtraBuffer(CPU_RNG_STATE_BYTES, spans["forward"][0], spans["backward"][1], "other", "forward",
                                  device=device)
            for spans in block_spans(trace, blocks_path).values() if "forward" in spans and "backward" in spans]


def _traced_view(device: str, rest: Any) -> Any:
    """How a traced parallel step becomes the rank's trace: gloo's staging buffers for a
    cpu job, then the modelled rest of the layout (`RankPlan.traced_transform`), if any."""
    def view(step: StepTrace) -> Trace:
        trace = _gloo_view(step) if device == "cpu" else step.trace
        if rest is None:
            return trace
        from dataclasses import replace

        return rest(replace(step, trace=trace))
    return view


def _gloo_view(step: StepTrace) -> Trace:
    """A traced parallel cpu step plus gloo's all-gather staging buffers."""
    from memplan.parallel.traced import gloo_staging_buffers

    return trace_edit.with_extra_buffers(step.trace, gloo_staging_buffers(step.trace))


def _cached_capture(config: Any, depth: int | None, setup: Any, device: str,
                    cache: dict[Any, StepTrace] | None, layout: Any = None, rank: int = 0) -> StepTrace:
    """The step at `depth` blocks: single-device, or (`layout` given) `rank` of the
    parallel step traced on a fake process group (`memplan.parallel.traced`)."""
    import json

    pipelined = layout is not None and layout.pp > 1
    if pipelined and depth is not None:  # `depth` blocks per stage: every stage's blocks are built
        target = with_layers(config, depth * layout.pp)
    else:
        target = with_layers(config, depth) if depth is not None else config
    key = (json.dumps(target.to_dict(), sort_keys=True, default=str), json.dumps(setup.to_dict(), sort_keys=True),
           device, json.dumps(layout.to_dict(), sort_keys=True) if layout is not None else None, rank)
    if cache is not None and key in cache:
        return cache[key]
    if layout is None:
        step = capture_step(target, setup, device)
    elif pipelined:
        step = capture_pipeline_rank(target, setup, layout, rank // (layout.dp * layout.tp), device)
    else:
        step = capture_parallel_step(target, setup, layout, rank, device)
    if cache is not None:
        cache[key] = step
    return step


def capture_parallel_step(config: Any, setup: Any, layout: Any, rank: int, device: str) -> StepTrace:
    """`rank` of `layout`, traced with FSDP2 / DTensor TP on a fake process group."""
    from memplan.models import sequence_length
    from memplan.parallel.traced import capture_rank

    trace, meta = capture_rank(config, setup, layout, rank, device)
    heads = int(getattr(config, "num_attention_heads", 1) or 1)
    head_dim = getattr(config, "head_dim", None) or (int(getattr(config, "hidden_size", heads)) // heads)
    return StepTrace(trace, meta["blocks_path"], int(meta["parameters"]), heads, int(head_dim),
                     sequence_length(setup, config), int(meta["layers"]))


def capture_pipeline_rank(config: Any, setup: Any, layout: Any, stage: int, device: str) -> StepTrace:
    """The first rank of pipeline `stage` of `layout`: its 1F1B step with DTensor TP on a
    fake process group (`memplan.parallel.traced.capture_stage_rank`)."""
    from memplan.models import sequence_length
    from memplan.parallel.traced import capture_stage_rank

    trace, meta = capture_stage_rank(config, setup, layout, stage, device)
    heads = int(getattr(config, "num_attention_heads", 1) or 1)
    head_dim = getattr(config, "head_dim", None) or (int(getattr(config, "hidden_size", heads)) // heads)
    return StepTrace(trace, meta["blocks_path"], int(meta["parameters"]), heads, int(head_dim),
                     sequence_length(setup, config), int(meta["layers"]))
