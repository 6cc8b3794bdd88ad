"""`fit(model, gpu, gpus, setup)`: the layouts that fit, fastest first.

LLMem's method selection (arXiv 2404.10933: pick the fastest of DP / sharded DP / TP /
DP+TP that does not run out of memory), over the whole space: data-parallel degree,
ZeRO stage 0-3, TP and PP degrees, micro-batch size, activation checkpointing (full,
torchtitan's op-level selective policy, none) and the
allocator (caching, else expandable segments when only those fit). Each candidate's
memory is a full `estimate` (captured steps are shared between candidates through the
estimate cache, so a search costs a few traces plus one replay per candidate). The search
uses the modelled layout rules (`estimate(..., parallel_tracing=False)`): tracing FSDP2 / TP
on a fake process group for every candidate would cost a trace per candidate; re-run
`memplan estimate` on the chosen configuration for the traced figure.

Step time is a roofline model over the device profile, as PyTorch's
`torch.distributed._tools.runtime_estimator.RuntimeEstimator` does in roofline mode:
compute = sum over the traced ops of max(FLOPs / peak FLOP/s, bytes / HBM bandwidth),
divided by the TP degree, times the micro-batches of a step and the pipeline bubble
(1 + (p - 1) / m); communication = bytes each rank sends over the interconnect
(ring all-reduce 2(n-1)/n x gradients for DDP / ZeRO-1/2, 3(n-1)/n x parameters for
ZeRO-3's all-gathers and reduce-scatter, 8(t-1)/t x B S H per block for TP with
sequence parallel), divided by the link bandwidth; data-parallel communication is
assumed to overlap compute (step = compute + max(0, dp_comm - compute) + tp_comm).
Candidates are ranked by seconds per token (the micro-batch varies across them).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from memplan.errors import UserError
from memplan.estimation.pipeline import Estimate, StepCache, estimate
from memplan.hardware.devices import DeviceProfile, device_profile
from memplan.hardware.roofline import matmul_dtype
from memplan.models.depth import num_layers
from memplan.models.registry import FactorySpec, load_config
from memplan.models.setup import TrainingSetup
from memplan.parallel.layout import Layout

if TYPE_CHECKING:  # transformers takes a second to import; only its config class is named here
    from transformers import PretrainedConfig

MICRO_BATCHES = (1, 2, 4)
CHECKPOINTING = ("full", "selective-op", "none")
MAX_TP = 8  # TP beyond one NVLink domain is not worth searching
PP_MICROBATCHES_PER_STAGE = 2  # pipeline micro-batches = 2 x stages (bubble 1/(2)) by default


@dataclass
class Candidate:
    layout: Layout
    micro_batch: int
    checkpointing: str
    allocator: str


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(config: PretrainedConfig, gpus: int) -> Iterator[Candidate]:
    heads = getattr(config, "num_attention_heads", 1) or 1
    kv = getattr(config, "num_key_value_heads", None) or heads
    blocks = num_layers(config) or 1
    for tp in _divisors(gpus):
        if tp > MAX_TP or heads % tp or kv % tp:
            continue
        for pp in _divisors(gpus // tp):
            if pp > 8 or blocks % pp:
                continue
            dp = gpus // (tp * pp)
            for zero in ((0, 1, 2, 3) if dp > 1 else (0,)):
                for ckpt in CHECKPOINTING:
                    for mb in MICRO_BATCHES:
                        micro = PP_MICROBATCHES_PER_STAGE * pp if pp > 1 else 1
                        yield Candidate(Layout(world_size=gpus, zero=zero, tp=tp, pp=pp, microbatches=micro),
                                        mb, ckpt, "caching")


def step_seconds(result: Estimate, cand: Candidate, config: PretrainedConfig, profile: DeviceProfile,
                 setup: TrainingSetup) -> dict[str, float]:
    """Roofline step time of one candidate (see the module docstring)."""
    lay = cand.layout
    element = 4 if matmul_dtype(setup) == "fp32" else 2
    micro = lay.microbatches if lay.pp > 1 else setup.grad_accum
    compute = result.roofline_s / lay.tp * micro * (1 + (lay.pp - 1) / max(micro, 1) if lay.pp > 1 else 1)
    params = result.parameters / (lay.tp * lay.pp)
    link = profile.interconnect_bytes_per_s
    dp = lay.dp
    if dp > 1 and lay.zero == 3:
        dp_bytes = 3 * (dp - 1) / dp * params * element
    elif dp > 1:
        dp_bytes = 2 * (dp - 1) / dp * params * element
    else:
        dp_bytes = 0.0
    hidden = getattr(config, "hidden_size", 0) or 0
    seq = setup.seq or 1024
    tp_bytes = 0.0
    if lay.tp > 1:
        blocks = (num_layers(config) or 1) / lay.pp
        tp_bytes = 8 * (lay.tp - 1) / lay.tp * cand.micro_batch * seq * hidden * element * blocks * micro
    dp_s, tp_s = dp_bytes / link, tp_bytes / link
    total = compute + max(0.0, dp_s - compute) + tp_s
    tokens = cand.micro_batch * seq * micro * dp
    return {"step_s": total, "compute_s": compute, "dp_comm_s": dp_s, "tp_comm_s": tp_s, "tokens_per_step": tokens,
            "s_per_token": total / tokens}


def fit(model: str | PretrainedConfig | FactorySpec, gpu: str, gpus: int, setup: TrainingSetup | None = None, *,
        progress: bool = True, top: int | None = None) -> list[dict[str, Any]]:
    """The configurations that fit on `gpus` x `gpu`, fastest (seconds per token) first."""
    if not isinstance(gpus, int) or gpus < 1:
        raise UserError(f"--gpus must be a whole number >= 1, not {gpus!r}")
    profile = device_profile(gpu)
    setup = setup if setup is not None else TrainingSetup()
    if setup.cpu_offload == "params":
        raise UserError("memplan fit searches with the modelled layout rules, and FSDP2's CPU offload is estimated "
                        "where FSDP2 is traced: use memplan estimate --zero 3 --cpu-offload params")
    config = load_config(model) if isinstance(model, str) else model
    todo = [cand for cand in candidates(config, gpus) if _layout_takes(cand.layout, config, setup)]
    cache: StepCache = {}
    fitting = []
    bar = _progress(len(todo)) if progress else None
    try:
        for cand in todo:
            trial = replace(setup, batch=cand.micro_batch, checkpointing=cand.checkpointing,
                            grad_accum=1 if cand.layout.pp > 1 else setup.grad_accum)
            result = None
            for allocator in ("caching", "expandable"):
                result = estimate(config, trial, cand.layout, gpu=gpu, allocator=allocator, cache=cache,
                                  parallel_tracing=False)
                if result.fits:
                    cand = replace(cand, allocator=allocator)
                    break
            if bar is not None:
                bar[0].update(bar[1], advance=1)
            if result is None or not result.fits:
                continue
            timing = step_seconds(result, cand, config, profile, trial)
            fitting.append({
                "world_size": gpus, "dp": cand.layout.dp, "zero": cand.layout.zero, "tp": cand.layout.tp,
                "pp": cand.layout.pp, "microbatches": cand.layout.microbatches, "micro_batch": cand.micro_batch,
                "checkpointing": cand.checkpointing, "allocator": cand.allocator,
                "alloc_conf": "expandable_segments:True" if cand.allocator == "expandable" else None,
                "peak_allocated_bytes": result.peak_allocated_bytes,
                "peak_reserved_bytes": result.peak_reserved_bytes,
                "device_used_bytes": result.device_used_bytes, "capacity_bytes": result.capacity_bytes,
                **{k: round(v, 6) if isinstance(v, float) else v for k, v in timing.items()},
            })
    finally:
        if bar is not None:
            bar[0].stop()
    fitting.sort(key=lambda c: (c["s_per_token"], c["device_used_bytes"]))
    return fitting[:top] if top else fitting


def _layout_takes(layout: Layout, config: PretrainedConfig, setup: TrainingSetup) -> bool:
    """Whether `layout` can run `setup` (e.g. CPU offload needs ZeRO-2/3 over several GPUs)."""
    try:
        layout.check(config, setup)
    except UserError:
        return False
    return True


def _progress(total: int) -> tuple[Any, Any]:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn("searching layouts"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   console=Console(file=sys.stderr), transient=True)
    bar.start()
    return bar, bar.add_task("fit", total=total)
