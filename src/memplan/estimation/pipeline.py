"""`estimate(model, setup, layout)`: per-GPU peak memory of one training step.

Pipeline (LLMem, IJCAI 2024, arXiv 2404.10933, measures memory after framework
initialisation and adds analytic terms; memplan instead *traces* the whole step on fake
tensors and adds only what a CPU trace cannot see). `estimate` runs these stages, one
function each:

1. **rank plans** (`memplan.parallel.plans.rank_plans`): the ranks of the layout whose
   memory differs, and for each what is traced and what is modelled;
2. **capture** (`capture_rank_steps`): the step on fake cpu tensors with the target
   device's code paths (`memplan.capture.step.capture_step`), at full depth or, for deep
   models, at 3 and 4 blocks (`memplan.estimation.layers`); where the layout can be
   traced, the rank's own step with FSDP2 / DTensor TP applied on a fake process group
   (`memplan.parallel.traced.capture_rank_step`, CP ranks included; PP x TP:
   `memplan.parallel.traced.capture_stage_step`, the first rank of each distinct
   pipeline stage, its 1F1B step with the stage's modules under the TP plan, at 3 and 4
   blocks per stage for deep models; under PyTorch's multi-stage schedules, every
   pipeline rank's row of the schedule, at full depth). TP that cannot be traced is
   refused (`UserError`) unless `parallel_tracing=False`; CP and the multi-stage
   schedules are refused wherever they are not traced;
3. **rank view** (`rank_views`): the rank's trace, modelled from the single-device trace
   by the layout rules (`memplan.parallel.transform.rank_trace`: DDP, ZeRO-1/2, PP
   without TP, or `parallel_tracing=False`), or the traced rank with the modelled rest
   (`RankPlan.traced_transform`) and, for a cpu job, gloo's all-gather staging buffers;
   plus what the device adds that the capture cannot see: the GPU-only terms
   (`memplan.trace.edit`: SDPA kernel workspaces, cuBLAS workspace) for cuda, the
   checkpoints' CPU RNG states for cpu;
4. **replay** (`replay_counters`): the allocator simulator (PyTorch's request rounding,
   `--alloc-conf` included; caching / expandable segments / a static plan) for peak
   allocated (`max_memory_allocated`) and peak reserved (`max_memory_reserved`);
   `allocator="none"` counts tensor bytes only;
5. **extrapolate** (`rank_figures`): the peaks, breakdown and phase at the allocated
   peak, from the full-depth trace or extrapolated from the 3- and 4-block traces; device
   used = reserved + CUDA context + NCCL buffers (device profile); fits = device used <=
   capacity.

Every term is listed, with how it was validated, in docs/estimation.md.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from memplan.alloc import AllocConf, replay
from memplan.capture.step import StepTrace, capture_step
from memplan.errors import UserError
from memplan.estimation import layers
from memplan.estimation.assumptions import job_assumptions
from memplan.hardware.devices import DeviceProfile, device_profile
from memplan.hardware.roofline import matmul_dtype, step_seconds
from memplan.layout import plan_addresses
from memplan.models.build import count_parameters
from memplan.models.depth import num_layers, with_layers
from memplan.models.moe import experts_of
from memplan.models.optimizers import check_target
from memplan.models.registry import FactorySpec, load_config
from memplan.models.setup import TrainingSetup
from memplan.parallel.apply import (
    traceable,
    traced_part,
    traced_precision,
    untraceable_tensor_parallel,
)
from memplan.parallel.layout import MULTI_STAGE_SCHEDULES, Layout
from memplan.parallel.plans import RankPlan, rank_plans
from memplan.parallel.traced import capture_rank_step, capture_stage_step, gloo_staging_buffers
from memplan.parallel.transform import block_spans
from memplan.trace import edit as trace_edit
from memplan.trace.model import CATEGORY, HOST_KINDS, Trace

if TYPE_CHECKING:  # transformers takes a second to import; only its config class is named here
    from transformers import PretrainedConfig

ESTIMATE_ALLOCATORS = ("caching", "expandable", "planned", "none")
MIN_BLOCKS_TO_EXTRAPOLATE = 6  # below this, tracing the full depth is as fast
TRACE_BLOCKS = 3  # traces at 3 and 4 blocks: a middle block has neighbours on both sides
DEFAULT_CUBLAS_WORKSPACE_BYTES = 8_519_680  # without a device profile (memplan.hardware.devices)
CPU_RNG_STATE_BYTES = 5056  # torch.get_rng_state(): the CPU generator's mt19937 state

BREAKDOWN_KEYS = ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "other")
_CATEGORY_TO_KEY = {
    CATEGORY["parameter"]: 0, CATEGORY["gradient"]: 1, CATEGORY["optimizer_state"]: 2,
    CATEGORY["activation"]: 3, CATEGORY["temporary"]: 4, CATEGORY["input"]: 5, CATEGORY["other"]: 5,
}

StepCache = dict[tuple[Any, ...], StepTrace]  # captured steps, keyed by model, setup, device, layout, rank


@dataclass
class HostFigures:
    """Host memory a rank's step keeps (memplan.models.tracing: offloaded optimizer state,
    parameters and gradients, bitsandbytes' paged state): the peak of its live bytes and,
    at that peak, how much is pinned (page-locked), pageable, and CUDA managed (unified
    memory the driver migrates between host and GPU; backed by the host, outside the
    caching allocator). None of it is in the device figures."""

    peak_bytes: int = 0
    pinned_bytes: int = 0
    pageable_bytes: int = 0
    managed_bytes: int = 0


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
    host: HostFigures = field(default_factory=HostFigures)

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "device_used_bytes": self.device_used_bytes,
            "breakdown": dict(self.breakdown),
            "peak_phase": self.peak_phase,
            "host_peak_bytes": self.host.peak_bytes,
            "host_pinned_bytes": self.host.pinned_bytes,
            "host_pageable_bytes": self.host.pageable_bytes,
            "host_managed_bytes": self.host.managed_bytes,
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
    routing: str | None = None  # a mixture-of-experts model's routing assumption (None: dense)
    assumptions: dict[str, Any] = field(default_factory=dict)  # what it assumed (`memplan.estimation.assumptions`)

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
    def host_peak_bytes(self) -> int:
        return max(r.host.peak_bytes for r in self.per_rank)

    @property
    def impl(self) -> str | None:
        """Whose model code was traced (`TrainingSetup.impl`: hf, litgpt); None for a
        snapshot of a step memplan did not build."""
        return self.setup.get("impl")

    @property
    def fits(self) -> bool | None:
        if self.capacity_bytes is None:
            return None
        return self.device_used_bytes <= self.capacity_bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "impl": self.impl,
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
            "host_peak_bytes": self.host_peak_bytes,
            "capacity_bytes": self.capacity_bytes,
            "fits": self.fits,
            "method": self.method,
            "parallel": self.parallel,
            "routing": self.routing,
            "assumptions": self.assumptions,
            "elapsed_s": round(self.elapsed_s, 3),
        }


@dataclass
class EstimateJob:
    """What every rank's estimate shares: the model, the layout and the options of `estimate`."""

    config: PretrainedConfig
    total_layers: int | None
    setup: TrainingSetup
    layout: Layout
    device: str
    allocator: str
    alloc_conf: str | None
    profile: DeviceProfile | None
    cuda_context_bytes: int | None
    extrapolate: bool
    parallel_tracing: bool
    progress: bool
    cache: StepCache | None


@dataclass
class StepTotals:
    """Rank 0's step totals: parameter count, FLOPs, bytes moved, roofline seconds."""

    parameters: int = 0
    flops: float = 0.0
    bytes_moved: float = 0.0
    roofline_s: float = 0.0


@dataclass
class RankResult:
    """One rank's estimate and how it was made."""

    estimate: RankEstimate
    extrapolated: bool
    parallel: str
    totals: StepTotals | None = None  # rank 0 only


def estimate(
    model: str | PretrainedConfig | FactorySpec,
    setup: TrainingSetup | None = None,
    layout: Layout | None = None,
    device: str = "cuda",
    allocator: str = "caching",
    alloc_conf: str | None = None,
    capacity: int | None = None,
    gpu: str | None = None,
    *,
    extrapolate: bool = True,
    parallel_tracing: bool = True,
    progress: bool = False,
    cache: StepCache | None = None,
    cuda_context: int | None = None,
) -> Estimate:
    """Per-rank peak memory of one training step of `model` under `setup` and `layout`.

    `model`: a registry name, config path, or `PretrainedConfig`. `layout`: a
    `memplan.parallel.Layout` (None: one GPU). `device`: "cuda" (GPU terms added) or
    "cpu" (the step as it runs on the host's CPU: no GPU terms). `allocator`:
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
    start = time.perf_counter()
    setup = setup if setup is not None else TrainingSetup()
    layout = layout if layout is not None else Layout()
    check_options(device, allocator, alloc_conf, cuda_context)
    profile = device_profile(gpu) if gpu is not None else None
    if capacity is None and profile is not None:
        capacity = profile.capacity_bytes
    if profile is not None and device == "cuda":
        refused = profile.unmodelled(attn=setup.attn, world_size=layout.world_size, context_override=cuda_context)
        if refused is not None:
            raise UserError(refused)
    name = model if isinstance(model, str) else (getattr(model, "name_or_path", "") or type(model).__name__)
    config = load_config(model) if isinstance(model, str) else model
    total_layers = num_layers(config)
    layout.check(config, setup)
    check_target(setup, device)
    traced_setup, traced_layout, precision = traced_precision(setup, layout, config, parallel_tracing)
    _check_parallel_tracing(traced_layout, config, traced_setup, parallel_tracing)
    job = EstimateJob(config, total_layers, traced_setup, traced_layout, device, allocator, alloc_conf, profile,
                      cuda_context, extrapolate, parallel_tracing, progress, cache)
    results = [estimate_rank(job, plan) for plan in rank_plans(traced_layout, config, traced_setup, total_layers)]
    totals = next((r.totals for r in results if r.totals is not None), StepTotals())
    return Estimate(
        model=name, parameters=totals.parameters, setup=setup.to_dict(), layout=layout.to_dict(),
        per_rank=[r.estimate for r in results], capacity_bytes=capacity, device=device, allocator=allocator,
        gpu=gpu, method="extrapolated" if any(r.extrapolated for r in results) else "full",
        parallel=results[-1].parallel if layout.world_size > 1 or traced_part(traced_layout, config, traced_setup)
        else "single device",
        assumptions=job_assumptions(config, setup, layout, precision, device=device, allocator=allocator),
        elapsed_s=time.perf_counter() - start, flops=totals.flops, bytes_moved=totals.bytes_moved,
        roofline_s=totals.roofline_s,
        routing=setup.routing if not isinstance(config, FactorySpec) and experts_of(config) else None,
    )


def check_options(device: str, allocator: str, alloc_conf: str | None, cuda_context: int | None) -> None:
    """`UserError` for an option no estimate can take, before any tracing."""
    if device not in ("cuda", "cpu"):
        raise UserError(f"unknown device {device!r}: use cuda or cpu")
    if allocator not in ESTIMATE_ALLOCATORS:
        raise UserError(f"unknown allocator {allocator!r}: choose one of {', '.join(ESTIMATE_ALLOCATORS)}")
    if cuda_context is not None and (isinstance(cuda_context, bool) or not isinstance(cuda_context, int)
                                     or cuda_context < 0):
        raise UserError(f"the CUDA context must be a size >= 0, not {cuda_context!r}")
    if alloc_conf is not None:
        AllocConf.parse(alloc_conf)  # a bad string is a UserError before any tracing


def _check_parallel_tracing(layout: Layout, config: PretrainedConfig, setup: TrainingSetup,
                            parallel_tracing: bool) -> None:
    """`UserError` for TP that cannot be traced, for an FSDP2 mixed-precision or CPU
    offload policy where FSDP2 is not traced, and for EP without tracing
    (docs/estimation.md)."""
    if layout.ep > 1 and not parallel_tracing:
        raise UserError("`ep` is estimated by tracing it on a fake process group: leave out --modelled-layout")
    if parallel_tracing and setup.quant != "none" and (layout.zero == 3 or layout.tp > 1):
        raise UserError("`quant` with `zero=3` or `tp`: FSDP2 and DTensor TP are not traced over bitsandbytes' "
                        "quantised weights by this version of memplan: estimate one GPU, DDP or ZeRO-1/2")
    if parallel_tracing:
        refused = untraceable_tensor_parallel(layout, config, setup)
        if refused is not None:
            raise UserError(refused)
    if layout.fsdp_param_dtype is not None:
        if not parallel_tracing or traced_part(layout, config, setup) != layout:
            raise UserError("`fsdp_param_dtype` is estimated where FSDP itself is traced (`zero=3`, without `pp`)")
    if setup.cpu_offload == "params" and not parallel_tracing:
        raise UserError("`cpu_offload=params` is estimated where FSDP2 itself is traced: leave out --modelled-layout")
    if layout.cp > 1 and (not parallel_tracing or traced_part(layout, config, setup) != layout):
        raise UserError(f"`cp` is estimated only where it is traced: {traceable(layout, config, setup)}")
    if layout.pp > 1 and layout.schedule in MULTI_STAGE_SCHEDULES and \
            (not parallel_tracing or traced_part(layout, config, setup) is None):
        raise UserError(f"`schedule={layout.schedule}` is estimated only where PyTorch's schedule is traced: "
                        f"{traceable(layout, config, setup) or 'tracing is off'}")


def estimate_rank(job: EstimateJob, plan: RankPlan) -> RankResult:
    """One rank's figures: capture, rank view, replay, extrapolate (module docstring)."""
    # PyTorch's multi-stage schedules interleave the rank's two chunks: traced at full depth
    scheduled = job.layout.pp > 1 and job.layout.schedule in MULTI_STAGE_SCHEDULES
    deep = job.extrapolate and plan.layers is not None and plan.layers >= MIN_BLOCKS_TO_EXTRAPOLATE and not scheduled
    traced = job.parallel_tracing and plan.traceable
    steps = capture_rank_steps(job, plan, [TRACE_BLOCKS, TRACE_BLOCKS + 1] if deep else [plan.layers], traced)
    transform = _traced_view(job.device, plan.traced_transform) if traced else plan.transform
    if job.progress:
        sys.stderr.write(f"traced rank {plan.rank} at {', '.join(str(s.layers) for s in steps)} blocks\n")
    views = rank_views(job, plan, transform, steps)
    counters = [replay_counters(trace_edit.without_host(t), job.allocator, job.alloc_conf) for t in views]
    fig = rank_figures(views, counters, steps[0].blocks_path, plan.layers) if deep else None
    extrapolated = fig is not None
    if deep and fig is None:  # the regions did not line up: trace the full depth instead
        sys.stderr.write("memplan: block extrapolation not applicable here; tracing the full depth\n")
        depth = plan.layers if plan.layers != job.total_layers else None
        steps = capture_rank_steps(job, plan, [depth], traced, cache=False)
        views = rank_views(job, plan, transform, steps)
        counters = [replay_counters(trace_edit.without_host(views[0]), job.allocator, job.alloc_conf)]
    if fig is None:
        fig = figures_full(views[-1], counters[-1])
    parallel = "modelled" if not traced else "traced" if plan.traced_transform is None else "traced + modelled"
    rank = RankEstimate(plan.rank, fig.peak_allocated_bytes, fig.peak_reserved_bytes,
                        fig.peak_reserved_bytes + _device_overhead_bytes(job, plan), fig.breakdown, fig.peak_phase,
                        plan.same_as, fig.host)
    return RankResult(rank, extrapolated, parallel, step_totals(job, plan, steps) if plan.rank == 0 else None)


def _device_overhead_bytes(job: EstimateJob, plan: RankPlan) -> int:
    """CUDA context plus NCCL buffers of the rank's communicators (device profile), for cuda."""
    if job.device != "cuda":
        return 0
    context = job.profile.context_bytes(job.cuda_context_bytes) if job.profile is not None else 0
    if job.cuda_context_bytes is not None:
        context = job.cuda_context_bytes
    nccl = job.profile.nccl_bytes(plan.communicators) if job.profile is not None else 0
    return context + nccl


def step_totals(job: EstimateJob, plan: RankPlan, steps: list[StepTrace]) -> StepTotals:
    """Rank 0's parameters, FLOPs, bytes moved and roofline seconds, extrapolated to the
    full depth from two traces or read from one."""
    profile, dtype = job.profile, matmul_dtype(plan.setup)
    totals = StepTotals()
    if len(steps) == 2:
        totals.parameters = int(round(float(layers.extrapolate(steps[0].parameters, steps[1].parameters,
                                                               TRACE_BLOCKS, job.total_layers or 0))))
        f = [float(np.nansum(s.trace.ops["flops"])) for s in steps]
        b = [float(np.nansum(s.trace.ops["bytes_moved"])) for s in steps]
        totals.flops = float(layers.extrapolate(f[0], f[1], TRACE_BLOCKS, plan.layers))
        totals.bytes_moved = float(layers.extrapolate(b[0], b[1], TRACE_BLOCKS, plan.layers))
        if profile is not None:
            r = [step_seconds(s.trace, profile, dtype) for s in steps]
            totals.roofline_s = float(layers.extrapolate(r[0], r[1], TRACE_BLOCKS, plan.layers))
    else:
        totals.parameters = steps[0].parameters if job.layout.pp == 1 else model_parameters(job.config)
        totals.flops = float(np.nansum(steps[0].trace.ops["flops"]))
        totals.bytes_moved = float(np.nansum(steps[0].trace.ops["bytes_moved"]))
        if profile is not None:
            totals.roofline_s = step_seconds(steps[0].trace, profile, dtype)
    if job.layout.pp > 1 and len(steps) == 2:
        totals.parameters = model_parameters(job.config)
    return totals


_PARAMETER_COUNTS: dict[str, int] = {}


def model_parameters(config: PretrainedConfig | FactorySpec) -> int:
    """`count_parameters(config)`, once per config: it builds the whole model on the meta
    device (about a second for 70B), and a search estimates many layouts of one model."""
    key = config.spec if isinstance(config, FactorySpec) else json.dumps(config.to_dict(), sort_keys=True, default=str)
    if key not in _PARAMETER_COUNTS:
        _PARAMETER_COUNTS[key] = count_parameters(config)
    return _PARAMETER_COUNTS[key]


def capture_rank_steps(job: EstimateJob, plan: RankPlan, depths: list[int | None], traced: bool, *,
                       cache: bool = True) -> list[StepTrace]:
    """The steps `plan`'s rank is estimated from, one per depth (None: the model's own):
    single-device captures, or the rank traced on a fake process group when `traced`."""
    layout = plan.traced_layout if traced else None
    return [cached_capture(job.config, depth, plan.setup, job.device, job.cache if cache else None, layout,
                           plan.traced_rank) for depth in depths]


def rank_views(job: EstimateJob, plan: RankPlan, transform: Callable[[StepTrace], Trace],
               steps: list[StepTrace]) -> list[Trace]:
    """Each step as the rank's trace on its device: `transform` (the layout's rules, or
    the traced view), then what the device adds (`_device_view`)."""
    return [_device_view(transform(step), step, plan.setup, job.device, job.profile) for step in steps]


def gpu_view(step: StepTrace, setup: TrainingSetup, profile: DeviceProfile | None) -> Trace:
    """The trace with the GPU-only buffers added (see `memplan.trace.edit`)."""
    extras = trace_edit.attention_kernel_buffers(step.trace, dtype=matmul_dtype(setup), attn=setup.attn,
                                                seq=step.seq, head_dim=step.head_dim)
    workspace = profile.cublas_workspace_bytes if profile is not None else DEFAULT_CUBLAS_WORKSPACE_BYTES
    extras += trace_edit.workspace_buffer(step.trace, workspace)
    return trace_edit.with_extra_buffers(step.trace, extras)


@dataclass
class Counters:
    """Series of one replay: allocated and reserved bytes after each event, and the
    per-buffer sizes the allocator charges (for the breakdown)."""

    allocated: np.ndarray
    reserved: np.ndarray
    charged_nbytes: np.ndarray


def charged_bytes(nbytes: np.ndarray, alloc_conf: str | None) -> np.ndarray:
    """Per buffer, the block size the caching allocator reserves for it under
    `alloc_conf` (`memplan.alloc.conf.AllocConf.round_size`; 0 for an empty buffer)."""
    conf = AllocConf.parse(alloc_conf)
    sizes, inverse = np.unique(nbytes, return_inverse=True)
    rounded = np.array([conf.round_size(int(n)) if n > 0 else 0 for n in sizes], dtype=np.int64)
    return rounded[inverse.reshape(-1)]


def replay_counters(trace: Trace, allocator: str, alloc_conf: str | None) -> Counters:
    """Allocated and reserved series of `trace` under `allocator` (unlimited capacity)."""
    nbytes = trace.buffers["nbytes"]
    if allocator == "none":
        live = trace.live_bytes()
        return Counters(live, live, nbytes)
    if allocator == "planned":
        # STWeaver plan of this very step (validated by the layout work's independent
        # checker before it is returned), replayed with its caching fallback.
        result = replay(trace, "planned", alloc_conf=alloc_conf, plan=plan_addresses(trace), segment_map=False)
    else:
        result = replay(trace, allocator, alloc_conf=alloc_conf, segment_map=False)
    return Counters(result.allocated_bytes, result.reserved_bytes, charged_bytes(nbytes, alloc_conf))


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
    host: HostFigures = field(default_factory=HostFigures)


def figures_full(trace: Trace, counters: Counters) -> Figures:
    """Peaks of a full-depth trace: the device's from `counters` (a replay of the trace's
    device buffers), the host memory's from its host buffers."""
    event = int(np.argmax(counters.allocated)) if counters.allocated.shape[0] else -1
    peak = int(counters.allocated[event]) if event >= 0 else 0
    device = trace_edit.without_host(trace)
    vector = layers.breakdown_vector(device, event, counters.charged_nbytes) if event >= 0 else np.zeros(7)
    return Figures(peak, int(counters.reserved.max()) if counters.reserved.shape[0] else 0,
                   _breakdown(vector, peak), trace.phase_at(event), host_figures(trace))


def host_figures(trace: Trace) -> HostFigures:
    """The host memory of a full-depth trace: its peak, and the kinds at the peak."""
    series = host_series(trace)
    total = series.sum(axis=0)
    if not total.shape[0]:
        return HostFigures()
    return _host_at(series[:, int(np.argmax(total))])


def host_series(trace: Trace) -> np.ndarray:
    """Live host bytes after each event, one row per kind of `HOST_KINDS`."""
    return np.stack([trace.live_bytes(trace.host_mask(kind)) for kind in HOST_KINDS]).reshape(len(HOST_KINDS), -1)


def _host_at(by_kind: np.ndarray) -> HostFigures:
    """`HostFigures` from the live bytes per kind (`HOST_KINDS` order) at the host peak."""
    pinned, pageable, managed = (int(round(max(float(v), 0.0))) for v in by_kind)
    return HostFigures(pinned + pageable + managed, pinned, pageable, managed)


def rank_figures(views: list[Trace], counters: list[Counters], blocks_path: str, target_layers: int) -> Figures | None:
    """The figures at `target_layers` blocks from the rank's views at `TRACE_BLOCKS` and
    one more block (None: their regions differ)."""
    return figures_extrapolated((views[0], views[1]), (counters[0], counters[1]), layers.block_pattern(blocks_path),
                                TRACE_BLOCKS, target_layers)


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
    vectors = [layers.breakdown_vector(trace_edit.without_host(t), int(a.events[win]), c.charged_nbytes)
               for t, a, c in zip(pair, alloc, counters)]
    vector = layers.extrapolate(vectors[0], vectors[1], k, target_layers)
    peak = float(alloc_full[win])
    # The caching allocator's slack (reserved - allocated) does not grow linearly with
    # depth (segments are reused across blocks): keep the deeper trace's slack on top of
    # the extrapolated allocated peak, unless the linear reserved figure is larger.
    slack = float(counters[1].reserved.max() - counters[1].allocated.max())
    reserved = max(float(resv_full.max()), peak + slack)
    return Figures(int(round(peak)), int(round(reserved)), _breakdown(vector, peak),
                   pair[1].phase_at(int(alloc[1].events[win])), _host_extrapolated(pair, reg, k, target_layers))


def _host_extrapolated(pair: tuple[Trace, Trace], reg: list[layers.Regions], k: int, target_layers: int) -> HostFigures:
    """The host figures at `target_layers` blocks, region by region as the device's."""
    series = [host_series(t) for t in pair]
    peaks = [layers.region_peaks(s.sum(axis=0), r) for s, r in zip(series, reg)]
    full = layers.extrapolate(peaks[0].values, peaks[1].values, k, target_layers)
    if not full.shape[0]:
        return HostFigures()
    win = int(np.argmax(full))
    by_kind = layers.extrapolate(series[0][:, int(peaks[0].events[win])], series[1][:, int(peaks[1].events[win])],
                                 k, target_layers)
    return _host_at(by_kind)


def _device_view(trace: Trace, step: StepTrace, setup: TrainingSetup, device: str,
                 profile: DeviceProfile | None) -> Trace:
    """A rank's trace plus what its device adds that the capture cannot see: the GPU
    terms (`gpu_view`) for cuda, the checkpoints' CPU RNG states for cpu."""
    if device == "cuda":
        return gpu_view(replace(step, trace=trace), setup, profile)
    return trace_edit.with_extra_buffers(trace, checkpoint_rng_states(trace, step.blocks_path, setup))


def checkpoint_rng_states(trace: Trace, blocks_path: str, setup: TrainingSetup) -> list[trace_edit.ExtraBuffer]:
    """The CPU RNG state `torch.utils.checkpoint` saves per checkpointed call
    (`preserve_rng_state=True`: full and attention-only checkpointing, not torchtitan's
    op-level policy), from the block's forward to the end of its backward. It is made by
    `torch.get_rng_state()` outside the dispatcher, so the recorder does not see it; on a
    GPU it is host memory (and the CUDA generator's state a host tensor too), so only a
    cpu job's memory holds it. A compiled step checkpoints inside its compiled graphs, where
    the state is saved by `run_and_save_rng_state` (torch/_prims/rng_prims.py), an op the
    recorder sees (`memplan.capture.compiled`): nothing to add."""
    if setup.checkpointing not in ("full", "selective") or setup.compile != "none":
        return []
    device = trace.main_device()
    return [trace_edit.ExtraBuffer(CPU_RNG_STATE_BYTES, spans["forward"][0], spans["backward"][1], "other", "forward",
                                  device=device)
            for spans in block_spans(trace, blocks_path).values() if "forward" in spans and "backward" in spans]


def _traced_view(device: str, rest: Callable[[StepTrace], Trace] | None) -> Callable[[StepTrace], Trace]:
    """How a traced parallel step becomes the rank's trace: gloo's staging buffers for a
    cpu job, then the modelled rest of the layout (`RankPlan.traced_transform`), if any."""
    def view(step: StepTrace) -> Trace:
        trace = _gloo_view(step) if device == "cpu" else step.trace
        if rest is None:
            return trace
        return rest(replace(step, trace=trace))
    return view


def _gloo_view(step: StepTrace) -> Trace:
    """A traced parallel cpu step plus gloo's all-gather staging buffers."""
    return trace_edit.with_extra_buffers(step.trace, gloo_staging_buffers(step.trace))


def cached_capture(config: PretrainedConfig, depth: int | None, setup: TrainingSetup, device: str,
                   cache: StepCache | None, layout: Layout | None = None, rank: int = 0) -> StepTrace:
    """The step at `depth` blocks: single-device (`memplan.capture.step.capture_step`),
    or (`layout` given) `rank` of the parallel step traced on a fake process group
    (`memplan.parallel.traced`); from `cache` when it holds it."""
    pipelined = layout is not None and layout.pp > 1
    if pipelined and depth is not None:  # `depth` blocks per stage: every stage's blocks are built
        target = with_layers(config, depth * layout.pp)
    else:
        target = with_layers(config, depth) if depth is not None else config
    model_key = target.spec if isinstance(target, FactorySpec) else json.dumps(target.to_dict(), sort_keys=True,
                                                                                 default=str)
    # the rank tells traced ranks apart; every rank shares one single-device capture
    key = (model_key, json.dumps(setup.to_dict(), sort_keys=True),
           device, json.dumps(layout.to_dict(), sort_keys=True) if layout is not None else None,
           rank if layout is not None else 0)
    if cache is not None and key in cache:
        return cache[key]
    if layout is None:
        step = capture_step(target, setup, device)
    elif pipelined:
        step = capture_stage_step(target, setup, layout, rank // (layout.dp * layout.tp), device)
    else:
        step = capture_rank_step(target, setup, layout, rank, device)
    if cache is not None:
        cache[key] = step
    return step
