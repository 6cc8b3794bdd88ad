"""The cheapest changes that make an RL step fit, over the RL knobs.

Each candidate is one change of the job, tried in the order of what it costs the run:
first the knobs that only move memory between phases, re-assembled from the figures
already traced (`memplan.rl.phases.assemble_phases`; the engine re-sized where its budget
changes): the engine's sleep mode, a lower `gpu_memory_utilization` (the highest one
below the job's that fits, in steps of 0.05), the reference as the disabled LoRA adapter, no reference
(`beta=0`), the rollout on GPUs of its own (a vLLM server); then, while `max_traces`
allows, the knobs that change the training step and are traced again: half the
micro-batch (twice the steps per generation), the optimizer state on the host. The answer
lists each candidate that fits, cheapest first, with its peak phase and margin.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from memplan.errors import UserError
from memplan.rl.estimate import RLEstimate, RLJob, engine_flags, run_job
from memplan.rl.trainers import trainer_rules

UTILIZATION_STEP = 0.05


def what_fits(result: RLEstimate, *, max_traces: int = 2, tried: list[str] | None = None) -> list[dict[str, Any]]:
    """The changes of `result.job` that fit (module docstring), cheapest first; `tried`
    collects the label of every change estimated. Nothing is tried for a job that fits."""
    if result.fits:
        return []
    job = result.job
    rules = trainer_rules(job.trainer)
    candidates: list[tuple[str, RLJob]] = []
    if job.rollout == "vllm-colocate":
        if (job.sleep_level if job.sleep_level is not None else rules.default_sleep_level) == 0:
            candidates.append((f"sleep the engine (level {rules.sleep_level_when_on})",
                               replace(job, sleep_level=rules.sleep_level_when_on)))
        lowered = _lower_utilization(job, rules)
    reference = result.settings["reference"]
    if reference == "copy" and job.setup.lora_rank > 0:
        candidates.append(("reference = the disabled LoRA adapter", replace(job, reference="peft")))
    if reference != "none" and job.algo != "dpo":
        candidates.append(("no reference model (beta 0)", replace(job, reference="none", beta=0.0)))
    if job.rollout == "vllm-colocate" and "vllm-server" in rules.rollouts:
        candidates.append(("rollout on GPUs of its own (vLLM server)", replace(job, rollout="vllm-server",
                                                                             sleep_level=None)))
    out = [_tried(label, run_job(candidate)) for label, candidate in candidates]
    if job.rollout == "vllm-colocate":
        out += _first_fitting(lowered)
        if lowered:
            candidates.append((f"gpu_memory_utilization {lowered[-1][0].split()[-1]} to "
                               f"{lowered[0][0].split()[-1]}", job))
    traced = []
    if job.setup.batch >= 2:
        traced.append(("half the micro-batch", replace(job, setup=replace(job.setup, batch=job.setup.batch // 2,
                                                                         grad_accum=job.setup.grad_accum * 2))))
    if job.setup.cpu_offload == "none" and job.setup.optimizer in ("adamw", "adam"):
        traced.append(("optimizer state on the host", replace(job, setup=replace(job.setup,
                                                                                 cpu_offload="optimizer"))))
    for label, candidate in traced[:max_traces]:
        try:
            out.append(_tried(label, run_job(candidate)))
            candidates.append((label, candidate))
        except UserError:
            continue
    if tried is not None:
        tried.extend(label for label, _ in candidates)
    return [c for c in out if c["fits"]]


def _lower_utilization(job: RLJob, rules: Any) -> list[tuple[str, RLJob]]:
    """The utilisations below the job's, in steps of 0.05 (the lowest one that fits wins)."""
    current = engine_flags(job, rules)["gpu_memory_utilization"]
    steps = int(round(current / UTILIZATION_STEP)) - 1
    values = [round(UTILIZATION_STEP * k, 2) for k in range(steps, 0, -1)]
    return [(f"gpu_memory_utilization {u}", replace(job, engine={**job.engine, "gpu_memory_utilization": u}))
            for u in values]


def _first_fitting(candidates: list[tuple[str, RLJob]]) -> list[dict[str, Any]]:
    """The first of `candidates` that fits, or none."""
    for label, candidate in candidates:
        tried = _tried(label, run_job(candidate))
        if tried["fits"]:
            return [tried]
    return []


def _tried(label: str, result: RLEstimate) -> dict[str, Any]:
    peak = result.peak_phase
    return {"change": label, "fits": result.fits, "peak_phase": peak.name, "peak_bytes": peak.needed_bytes,
            "margin_bytes": result.usable_bytes - peak.needed_bytes,
            "failing_phase": result.failing_phase.name if result.failing_phase else None}

