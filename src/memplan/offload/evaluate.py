"""One call from a trace and hardware to the figures `memplan offload` reports.

Plans the trace (TERAIO-style, `planner.plan_lifetimes`), simulates the plan, runs the
baselines in the same simulator (`baselines.run_baselines`) and returns the JSON keys of
`memplan offload --json`: `ideal_step_s`, `planned_step_s`, `throughput_vs_ideal`, `baselines`
(name -> step_s, throughput_vs_ideal, feasible), `offloaded_bytes`,
`peak_device_bytes`, `plan_elapsed_s`; `step_lower_bound_s` and `throughput_upper_bound`
(no plan on these links does better: `bounds.step_lower_bound_s`); with a checkpointing
search, also `checkpointing` (the policy of the plan reported) and `checkpointing_search`
(every policy's figures).
"""

from __future__ import annotations

import math
from typing import Any

from memplan.hardware.links import Hardware
from memplan.hardware.roofline import op_seconds
from memplan.offload.baselines import run_baselines
from memplan.offload.bounds import step_lower_bound_s
from memplan.offload.lifetimes import analyse_lifetimes
from memplan.offload.plan_file import OffloadPlan
from memplan.offload.planner import default_budget_bytes, plan_lifetimes
from memplan.offload.simulate import simulate_offload_plan
from memplan.trace.model import Trace

RECOMPUTE_POLICIES = ("selective", "selective-op", "full")


def _planned(trace: Trace, hardware: Hardware, budget: int) -> tuple[Any, OffloadPlan, Any, float]:
    """(lifetimes, plan, simulated step, the links' lower bound on any plan's step) of one trace."""
    lt = analyse_lifetimes(trace, op_seconds(trace, hardware.gpu))
    offload_plan = plan_lifetimes(trace, lt, hardware, budget)
    bound = step_lower_bound_s(trace, lt, hardware, budget)
    return lt, offload_plan, simulate_offload_plan(lt, offload_plan, hardware.link_bytes_per_s()), bound


def _bound_keys(bound_s: float, ideal_s: float) -> dict[str, float | None]:
    """`step_lower_bound_s` (no plan on these links is faster; None: no link to move bytes
    over) and `throughput_upper_bound` (ideal / bound)."""
    if not math.isfinite(bound_s):
        return {"step_lower_bound_s": None, "throughput_upper_bound": 0.0}
    return {"step_lower_bound_s": bound_s, "throughput_upper_bound": ideal_s / bound_s if bound_s > 0 else 0.0}


def evaluate(trace: Trace, hardware: Hardware, budget_bytes: int | None = None,
             checkpointed_trace: Trace | None = None,
             alternatives: dict[str, Trace] | None = None,
             baseline_trace: Trace | None = None,
             with_baselines: bool = True) -> tuple[dict[str, Any], OffloadPlan]:
    """Plan, simulate and compare; returns (the report, the plan).

    `checkpointed_trace`: the same step with full activation checkpointing, the ZeRO
    baselines' second way (their only activation offload, DeepSpeed's `cpu_checkpointing`,
    needs it). `alternatives`: the same step under activation-checkpointing policies (name ->
    trace); each is planned too, and the report is the fastest plan's, measured against the
    ideal step of `trace` (no recomputation): offloading and recomputation composed. Every
    policy's figures are in `checkpointing_search`, and `plan_elapsed_s` is their sum.
    `baseline_trace`: the whole step the ZeRO baselines run on when `trace` is one FSDP2
    rank's (they shard by `hardware.gpus` themselves; `checkpointed_trace` is then the whole
    checkpointed step too); default `trace`. `with_baselines=False` leaves `baselines` empty,
    for a caller that runs them itself on other hardware (the benchmark gives them the
    paper's 1.5 TB of host memory)."""
    budget = default_budget_bytes(hardware) if budget_bytes is None else int(budget_bytes)
    lt, offload_plan, sim, bound = _planned(trace, hardware, budget)
    ideal_s = lt.step_s
    search: dict[str, dict[str, Any]] = {}
    candidates = [("none", trace, lt, offload_plan, sim, bound)]
    for name, alt in (alternatives or {}).items():
        candidates.append((name, alt, *_planned(alt, hardware, budget)))
    for name, _tr, _lt, p, sm, bd in candidates:
        search[name] = {
            "planned_step_s": sm.step_s,
            "throughput_vs_ideal": ideal_s / sm.step_s if sm.step_s > 0 else 0.0,
            "feasible": p.feasible and sm.within_budget,
            "urgent_transfers": sum(t.urgent for t in p.transfers),
            "plan_elapsed_s": p.plan_elapsed_s,
            **_bound_keys(bd, ideal_s),
        }
    feasible = [c for c in candidates if search[c[0]]["feasible"]] or candidates[:1]
    chosen, _tr, _lt, offload_plan, sim, bound = min(feasible, key=lambda c: c[4].step_s)
    baselines = {}
    if with_baselines:
        checkpointed = None
        if checkpointed_trace is not None:
            checkpointed = (checkpointed_trace, analyse_lifetimes(checkpointed_trace,
                                                        op_seconds(checkpointed_trace, hardware.gpu)))
        if baseline_trace is None:
            baselines = run_baselines(trace, lt, hardware, budget, checkpointed)
        else:
            whole = analyse_lifetimes(baseline_trace, op_seconds(baseline_trace, hardware.gpu))
            baselines = run_baselines(baseline_trace, whole, hardware, budget, checkpointed)
    report = {
        "ideal_step_s": ideal_s,
        "planned_step_s": sim.step_s,
        "throughput_vs_ideal": ideal_s / sim.step_s if sim.step_s > 0 else 0.0,
        **_bound_keys(bound, ideal_s),
        "feasible": offload_plan.feasible and sim.within_budget,
        "checkpointing": chosen,
        "stall_s": sim.stall_s,
        "baselines": {name: r.to_json(ideal_s) for name, r in baselines.items() if name != "ideal"},
        "offloaded_bytes": offload_plan.offloaded_bytes,
        "peak_device_bytes": sim.peak_device_bytes,
        "peak_device_bytes_without_offload": int(lt.op_bytes.max()),
        "budget_bytes": budget,
        "plan_elapsed_s": sum(v["plan_elapsed_s"] for v in search.values()),
        "transfers": len(offload_plan.transfers),
        "urgent_transfers": sum(t.urgent for t in offload_plan.transfers),
        "bytes_by_tier": {
            tier: sum(t.nbytes for t in offload_plan.transfers if t.tier == tier) for tier in ("ssd", "host")
        },
        "link_utilisation": sim.link_utilisation,
        "hardware": hardware.to_json(),
    }
    if alternatives:
        report["checkpointing_search"] = search
    return report, offload_plan
