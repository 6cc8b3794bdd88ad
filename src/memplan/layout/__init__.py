"""Address planning: exact and greedy solvers for buffer offsets (`pack`), and the
STWeaver training-step planner (`plan_addresses`, returning an `AddressPlan`)."""

from memplan.layout.greedy import greedy_by_size, greedy_offsets
from memplan.layout.pack import pack
from memplan.layout.plan import AddressPlan, load_address_plan, save_address_plan
from memplan.layout.problem import Gap, Problem, Solution
from memplan.layout.stweaver import plan_addresses
from memplan.layout.validate import LayoutBug, check_given_offsets, check_offsets

__all__ = [
    "AddressPlan",
    "Gap",
    "LayoutBug",
    "Problem",
    "Solution",
    "check_given_offsets",
    "check_offsets",
    "greedy_by_size",
    "greedy_offsets",
    "load_address_plan",
    "pack",
    "plan_addresses",
    "save_address_plan",
]
