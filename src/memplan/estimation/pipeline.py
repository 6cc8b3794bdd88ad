"""`estimate(model, setup, layout)`: per-GPU peak memory of one training step.

Pipeline (LLMem, IJCAI 2024, arXiv 2404.10933, measures memory after framework
initialisation and adds analytic terms; memplan instead *traces* the whole step on fake
tensors and adds only what a CPU trace cannot see). `estimate` runs these stages, one
function each:

1. **rank plans** (`memplan.parallel.plans.rank_plans`): the ranks of the layout whose
   memory differs, and for each what is traced and what is modelled;
2. **capture** (`capture_rank_steps`): the step on fake cpu tensors with the target
   device's code paths (`memplan.capture.step.capture_step`), at full depth or, for deep
   models, at `TRACE_BLOCKS` blocks; where the layout can be traced, the rank's own step
   with FSDP2 / DTensor TP applied on a fake process group
   (`memplan.parallel.traced.capture_rank_step`, CP ranks included; PP x TP:
   `memplan.parallel.traced.capture_stage_step`, the first rank of each distinct
   pipeline stage, its 1F1B step with the stage's modules under the TP plan, at
   `TRACE_BLOCKS` blocks per stage for deep models; under PyTorch's multi-stage schedules,
   every pipeline rank's row of the schedule, at full depth). TP that cannot be traced is
   refused (`UserError`) unless `parallel_tracing=False`; CP and the multi-stage
   schedules are refused wherever they are not traced;
3. **rank view** (`rank_views`): the rank's trace, modelled from the single-device trace
   by the layout rules (`memplan.parallel.transform.rank_trace`: DDP, ZeRO-1/2, PP
   without TP, or `parallel_tracing=False`), or the traced rank with the modelled rest
   (`RankPlan.traced_transform`) and, for a cpu job, gloo's all-gather staging buffers;
   plus what the device adds that the capture cannot see: the GPU-only terms
   (`memplan.trace.edit`: SDPA kernel workspaces, cuBLAS workspace) for cuda, the
   checkpoints' CPU RNG states and oneDNN's matmul scratchpads
   (`memplan.capture.onednn`) for cpu;
4. **unroll** (`memplan.estimation.unroll`): a deep model's view, its middle block's
   events repeated up to the full depth, so that what follows sees the full-depth step
   (where the trace does not have the shape unrolling needs, the full depth is traced);
5. **figures** (`memplan.estimation.figures.rank_estimate`, the one way every trace
   becomes a rank's figures): the allocator simulator (PyTorch's request rounding,
   `--alloc-conf` included; caching / expandable segments / a static plan; `none` counts
   tensor bytes only) for peak allocated (`max_memory_allocated`) and peak reserved
   (`max_memory_reserved`), replayed within the usable memory, capacity x (1 - margin),
   as the caching allocator frees its cache and retries there; the breakdown and phase
   at the allocated peak; device used = reserved + CUDA context + NCCL buffers (device
   profile); fits = device used <= capacity x (1 - margin).

Every term is listed, with how it was validated, in docs/estimation.md.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from memplan.alloc import AllocConf
from memplan.capture.onednn import onednn_workspaces
from memplan.capture.step import StepTrace, capture_step
from memplan.errors import UserError
from memplan.estimation.assumptions import job_assumptions
from memplan.estimation.figures import (  # noqa: F401 - re-exported: callers import them from here
    BREAKDOWN_KEYS,
    DEFAULT_MARGIN,
    Counters,
    Figures,
    HostFigures,
    RankEstimate,
    charged_bytes,
    check_margin,
    figures_full,
    host_at,
    host_figures,
    host_series,
    rank_estimate,
    replay_counters,
    usable_bytes_of,
)
from memplan.estimation.unroll import ops_at_depth, unroll
from memplan.hardware.devices import DeviceProfile, device_profile
from memplan.hardware.roofline import matmul_dtype, step_seconds
from memplan.models.build import count_parameters
from memplan.models.depth import block_kinds, num_layers, with_layers
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
from memplan.trace.model import Trace

if TYPE_CHECKING:  # transformers takes a second to import; only its config class is named here
    from transformers import PretrainedConfig

ESTIMATE_ALLOCATORS = ("caching", "expandable", "planned", "none")
MIN_BLOCKS_TO_EXTRAPOLATE = 6  # below this, tracing the full depth is as fast
TRACE_BLOCKS = 4  # deep models are traced at 4 blocks (after leading ones of another kind): 2 middle blocks
DEFAULT_CUBLAS_WORKSPACE_BYTES = 8_519_680  # without a device profile (memplan.hardware.devices)
CPU_RNG_STATE_BYTES = 5056  # torch.get_rng_state(): the CPU generator's mt19937 state

StepCache = dict[tuple[Any, ...], StepTrace]  # captured steps, keyed by model, setup, device, layout, rank


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
    margin: float = DEFAULT_MARGIN  # headroom kept free of the capacity
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
    def usable_bytes(self) -> int | None:
        """Capacity x (1 - margin): what the step may use (None: no capacity given)."""
        return usable_bytes_of(self.capacity_bytes, self.margin)

    @property
    def fits(self) -> bool | None:
        """Device used <= usable on every rank (None: no capacity given)."""
        usable = self.usable_bytes
        if usable is None:
            return None
        return self.device_used_bytes <= usable

    @property
    def phase_peaks(self) -> dict[str, int]:
        """Peak allocated in each phase of the step, the largest over the ranks."""
        out: dict[str, int] = {}
        for r in self.per_rank:
            for phase, value in r.phase_peaks.items():
                out[phase] = max(value, out.get(phase, 0))
        return out

    @property
    def oom(self) -> dict[str, Any] | None:
        """The first rank's request the allocator could not serve within the usable memory."""
        return next((r.oom for r in self.per_rank if r.oom is not None), None)

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
            "margin": self.margin,
            "usable_bytes": self.usable_bytes,
            "fits": self.fits,
            "oom": self.oom,
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
    usable_bytes: int | None  # capacity x (1 - margin); None: no limit
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
    margin: float = DEFAULT_MARGIN,
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
    takes about 1 GB more. `margin`: the share of the capacity kept free; the step fits
    when its device memory is at most capacity x (1 - margin), the usable memory its
    allocator is replayed within (`memplan.estimation.figures`).
    """
    start = time.perf_counter()
    setup = setup if setup is not None else TrainingSetup()
    layout = layout if layout is not None else Layout()
    check_options(device, allocator, alloc_conf, cuda_context)
    margin = check_margin(margin)
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
                      cuda_context, usable_bytes_of(capacity, margin), extrapolate, parallel_tracing, progress, cache)
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
        margin=margin,
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
    """One rank's figures: capture, rank view, unroll, replay (module docstring)."""
    # PyTorch's multi-stage schedules interleave the rank's two chunks: traced at full depth
    scheduled = job.layout.pp > 1 and job.layout.schedule in MULTI_STAGE_SCHEDULES
    depth = unroll_depth(job.config, plan.layers, job.layout.pp) if job.extrapolate and not scheduled else None
    deep = depth is not None
    traced = job.parallel_tracing and plan.traceable
    step = capture_rank_steps(job, plan, [depth] if deep else [plan.layers], traced)[0]
    transform = _traced_view(job.device, plan.traced_transform) if traced else plan.transform
    if job.progress:
        sys.stderr.write(f"traced rank {plan.rank} at {step.layers} blocks\n")
    full = unrolled_step(step, depth, plan.layers, job.cache) if deep else step
    if full is None:  # the trace does not have the shape unrolling needs: trace the full depth
        sys.stderr.write("memplan: block extrapolation not applicable here; tracing the full depth\n")
        depth = plan.layers if plan.layers != job.total_layers else None
        step = full = capture_rank_steps(job, plan, [depth], traced, cache=False)[0]
    view = rank_views(job, plan, transform, [full])[0]
    rank = rank_estimate(view, rank=plan.rank, allocator=job.allocator, alloc_conf=job.alloc_conf,
                         overhead_bytes=_device_overhead_bytes(job, plan), usable_bytes=job.usable_bytes,
                         same_as=plan.same_as)
    parallel = "modelled" if not traced else "traced" if plan.traced_transform is None else "traced + modelled"
    unrolled = full is not step
    totals = step_totals(job, plan, step, depth if unrolled else None) if plan.rank == 0 else None
    return RankResult(rank, unrolled, parallel, totals)


def unroll_depth(config: PretrainedConfig | FactorySpec, layers: int | None, stages: int = 1) -> int | None:
    """The depth to trace a model of `layers` blocks (per pipeline stage) at, to unroll it
    (`memplan.estimation.unroll`): `TRACE_BLOCKS` after its leading blocks of another kind
    (DeepSeek's dense blocks before its MoE ones); None where it is traced at full depth: a
    shallow model, or blocks that alternate kinds (`memplan.models.depth.block_kinds`:
    sliding-window and full attention, MoE every other block), which copies of one block
    cannot stand for."""
    if layers is None or layers < MIN_BLOCKS_TO_EXTRAPOLATE:
        return None
    kinds = [] if isinstance(config, FactorySpec) else block_kinds(config)
    last = kinds[-1] if kinds else None
    leading = next((i for i, kind in enumerate(kinds) if kind == last), 0)
    if any(kind != last for kind in kinds[leading:]) or (stages > 1 and leading):
        return None
    depth = leading + TRACE_BLOCKS
    return depth if depth < layers else None


def unrolled_step(step: StepTrace, depth: int, layers: int, cache: StepCache | None) -> StepTrace | None:
    """`step` (traced at `depth` blocks) unrolled to `layers` blocks
    (`memplan.estimation.unroll`), kept in `cache` with the step; None where it cannot be."""
    key = ("unrolled", id(step), layers)
    if cache is not None and key in cache:
        return cache[key]
    trace = unroll(step.trace, step.blocks_path, depth, layers)
    if trace is None:
        return None
    full = replace(step, trace=trace, layers=layers)
    if cache is not None:
        cache[key] = full
    return full


def _device_overhead_bytes(job: EstimateJob, plan: RankPlan) -> int:
    """CUDA context plus NCCL buffers of the rank's communicators (device profile), for cuda."""
    if job.device != "cuda":
        return 0
    context = job.profile.context_bytes(job.cuda_context_bytes) if job.profile is not None else 0
    if job.cuda_context_bytes is not None:
        context = job.cuda_context_bytes
    nccl = job.profile.nccl_bytes(plan.communicators) if job.profile is not None else 0
    return context + nccl


def step_totals(job: EstimateJob, plan: RankPlan, step: StepTrace, depth: int | None) -> StepTotals:
    """Rank 0's parameters, FLOPs, bytes moved and roofline seconds: of the traced step, or,
    unrolled from `depth` blocks, as at the full depth (`memplan.estimation.unroll`)."""
    trace = step.trace
    if depth is not None:
        ops = ops_at_depth(trace, step.blocks_path, depth, plan.layers)
        trace = replace(trace, ops=ops) if ops is not None else trace
    totals = StepTotals(flops=float(np.nansum(trace.ops["flops"])),
                        bytes_moved=float(np.nansum(trace.ops["bytes_moved"])))
    if job.profile is not None:
        totals.roofline_s = step_seconds(trace, job.profile, matmul_dtype(plan.setup))
    if job.layout.pp > 1:
        totals.parameters = model_parameters(job.config)
    elif depth is not None:
        per_block = step.block_parameters
        if per_block is None:  # a step traced on a fake process group counts the model's parameters
            per_block = model_parameters(with_layers(job.config, depth)) - \
                model_parameters(with_layers(job.config, depth - 1))
        totals.parameters = step.parameters + per_block * ((job.total_layers or depth) - depth)
    else:
        totals.parameters = step.parameters
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


def _device_view(trace: Trace, step: StepTrace, setup: TrainingSetup, device: str,
                 profile: DeviceProfile | None) -> Trace:
    """A rank's trace plus what its device adds that the capture cannot see: the GPU
    terms (`gpu_view`) for cuda; for cpu, the checkpoints' CPU RNG states and the
    scratchpads of the matmuls this host runs with oneDNN
    (`memplan.capture.onednn.onednn_workspaces`)."""
    if device == "cuda":
        return gpu_view(replace(step, trace=trace), setup, profile)
    extras = checkpoint_rng_states(trace, step.blocks_path, setup) + onednn_workspaces(trace)
    return trace_edit.with_extra_buffers(trace, extras)


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
