"""Lifetime-aware offloading (TERAIO, arXiv 2506.06472): lifetimes, planner, validator, simulator, runtime.

`plan(trace, hardware, budget=...)` returns a validated `OffloadPlan`;
`simulate_plan(...)` runs it through the event-driven simulator next to the baselines;
`run(model, optimizer, plan)` applies a plan of the captured step to real training, tensor by
tensor (`OffloadPlan.tensors`, a `TensorSchedule`).
"""

from memplan.hardware.links import Hardware, make_hardware, parse_nvme_spec
from memplan.offload.lifetimes import (
    Lifetimes,
    analyse,
    measured_op_durations_s,
    roofline_op_durations_s,
)
from memplan.offload.planner import OffloadPlan, Transfer, load_plan, plan
from memplan.offload.runtime import run
from memplan.offload.schedule import TensorSchedule, runtime_categories
from memplan.offload.validate import PlanError, validate_plan

__all__ = [
    "Hardware",
    "Lifetimes",
    "OffloadPlan",
    "PlanError",
    "TensorSchedule",
    "Transfer",
    "analyse",
    "load_plan",
    "make_hardware",
    "measured_op_durations_s",
    "parse_nvme_spec",
    "plan",
    "roofline_op_durations_s",
    "runtime_categories",
    "run",
    "validate_plan",
]
