"""Lifetime-aware offloading (TERAIO, arXiv 2506.06472): lifetimes, planner, validator, simulator, runtime.

`plan_offload(trace, hardware, budget=...)` returns a validated `OffloadPlan`;
`simulate_offload_plan(...)` runs it through the event-driven simulator next to the baselines;
`run(model, optimizer, plan, RunOptions(directory=...))` applies a plan of the captured step to
real training, tensor by tensor (`OffloadPlan.tensors`, a `TensorSchedule`);
`load_offload_plan(path)` reads a plan `memplan offload --plan-output` wrote;
`captured_steps(config, setup, ...)` / `traced_steps(trace)` are the traces an evaluation takes
(`memplan.offload.steps`).
"""

from memplan.hardware.links import Hardware, make_hardware, parse_nvme_spec
from memplan.offload.lifetimes import (
    Lifetimes,
    analyse_lifetimes,
    measured_op_durations_s,
)
from memplan.offload.plan_file import OffloadPlan, Transfer, load_offload_plan, save_offload_plan
from memplan.offload.planner import default_budget_bytes, plan_offload
from memplan.offload.runtime import OffloadError, RunOptions, run
from memplan.offload.schedule import TensorSchedule, runtime_categories
from memplan.offload.simulate import OffloadSim, simulate_offload_plan
from memplan.offload.validate import OffloadPlanBug, validate_plan

__all__ = [
    "Hardware",
    "Lifetimes",
    "OffloadError",
    "OffloadPlan",
    "OffloadPlanBug",
    "OffloadSim",
    "RunOptions",
    "TensorSchedule",
    "Transfer",
    "analyse_lifetimes",
    "default_budget_bytes",
    "load_offload_plan",
    "make_hardware",
    "measured_op_durations_s",
    "parse_nvme_spec",
    "plan_offload",
        "run",
    "runtime_categories",
    "save_offload_plan",
    "simulate_offload_plan",
    "validate_plan",
]
