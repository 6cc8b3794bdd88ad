"""Running a plan on real training: the planned allocator (STWeaver/STAlloc's runtime).

`planned_allocator(plan)` serves a training step's CPU allocations from one arena at
the planned offsets; `planned_allocator.from_step(step_fn)` records, plans and returns
it in one call. The C++ core compiles on first use (`memplan.runtime.build`).
"""

from memplan.runtime.allocator import FALLBACK_REASONS, PlannedAllocator, planned_allocator
from memplan.runtime.recording import plan_steady_state, record_step, trace_from_recording

__all__ = [
    "FALLBACK_REASONS",
    "PlannedAllocator",
    "plan_steady_state",
    "planned_allocator",
    "record_step",
    "trace_from_recording",
]
