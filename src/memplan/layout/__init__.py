"""Offset planning: exact and greedy solvers for buffer offsets, and the STWeaver training-step planner."""

from memplan.layout.greedy import greedy_by_size, greedy_offsets
from memplan.layout.pack import pack
from memplan.layout.plan import Plan, load_plan, save_plan
from memplan.layout.problem import Gap, Problem, Solution
from memplan.layout.stweaver import plan
from memplan.layout.validate import LayoutError, check_offsets

__all__ = [
    "Gap",
    "LayoutError",
    "Plan",
    "Problem",
    "Solution",
    "check_offsets",
    "greedy_by_size",
    "greedy_offsets",
    "load_plan",
    "pack",
    "plan",
    "save_plan",
]
