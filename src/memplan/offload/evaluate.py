"""One call from a trace and hardware to the figures `memplan offload` reports.

Plans the trace (TERAIO-style, `planner.plan_lifetimes`), simulates the plan, runs the
baselines in the same simulator (`baselines.run_baselines`) and returns the issue's
JSON keys: `ideal_step_s`, `planned_step_s`, `throughput_vs_ideal`, `baselines`
(name -> step_s, throughput_vs_ideal, feasible), `offloaded_bytes`,
`peak_device_bytes`, `plan_elapsed_s`.
"""

from __future__ import annotations

from typing import Any

from memplan.offload.baselines import run_baselines
from memplan.offload.hardware import Hardware
from memplan.offload.lifetimes import analyse, roofline_op_durations_s
from memplan.offload.planner import OffloadPlan, plan_lifetimes
from memplan.offload.simulate import simulate_plan
from memplan.trace.model import Trace


def default_budget_bytes(hardware: Hardware) -> int:
    """Device capacity less what never reaches PyTorch's allocator (CUDA context, cuBLAS workspace)."""
    gpu = hardware.gpu
    return int(gpu.capacity_bytes - gpu.cuda_context_bytes - gpu.cublas_workspace_bytes)


def evaluate(trace: Trace, hardware: Hardware, budget_bytes: int | None = None,
             checkpointed_trace: Trace | None = None) -> tuple[dict[str, Any], OffloadPlan]:
    """Plan, simulate and compare; returns (the report, the plan). `checkpointed_trace`: the
    same step with full activation checkpointing, the ZeRO baselines' second way (their only
    activation offload, DeepSpeed's `cpu_checkpointing`, needs it)."""
    budget = default_budget_bytes(hardware) if budget_bytes is None else int(budget_bytes)
    lt = analyse(trace, roofline_op_durations_s(trace, hardware.gpu))
    offload_plan = plan_lifetimes(trace, lt, hardware, budget)
    sim = simulate_plan(lt, offload_plan, hardware.link_bytes_per_s())
    ideal_s = lt.step_s
    checkpointed = None
    if checkpointed_trace is not None:
        checkpointed = (checkpointed_trace, analyse(checkpointed_trace,
                                                    roofline_op_durations_s(checkpointed_trace, hardware.gpu)))
    baselines = run_baselines(trace, lt, hardware, budget, checkpointed)
    report = {
        "ideal_step_s": ideal_s,
        "planned_step_s": sim.step_s,
        "throughput_vs_ideal": ideal_s / sim.step_s if sim.step_s > 0 else 0.0,
        "feasible": offload_plan.feasible and sim.within_budget,
        "stall_s": sim.stall_s,
        "baselines": {name: r.to_json(ideal_s) for name, r in baselines.items() if name != "ideal"},
        "offloaded_bytes": offload_plan.offloaded_bytes,
        "peak_device_bytes": sim.peak_device_bytes,
        "peak_device_bytes_without_offload": int(lt.op_bytes.max()),
        "budget_bytes": budget,
        "plan_elapsed_s": offload_plan.plan_elapsed_s,
        "transfers": len(offload_plan.transfers),
        "urgent_transfers": sum(t.urgent for t in offload_plan.transfers),
        "bytes_by_tier": {
            tier: sum(t.nbytes for t in offload_plan.transfers if t.tier == tier) for tier in ("ssd", "host")
        },
        "link_utilisation": sim.link_utilisation,
        "hardware": hardware.to_json(),
    }
    return report, offload_plan
