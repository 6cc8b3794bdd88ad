"""Parallel layouts applied to a traced step: DP, ZeRO 0-3 / FSDP2 / HSDP, TP + SP, PP.

`Layout` (degrees and their checks), `plans.rank_plans` (the ranks that differ),
`apply.apply_layout` (DDP / FSDP2 / TP applied to a model, for real or on a fake process
group), `traced.capture_rank_step` (one rank's step traced on a fake process group),
`groundtruth.measure_rank_peaks` (real gloo runs measured with torch.profiler) and
`rank_trace` (one rank's trace, modelled from the single-device trace). See each module.
"""

import importlib
from typing import Any

# Each public name -> its module, imported on first use (`Layout` is read without torch).
_LAZY_NAMES = {"SCHEDULES": "memplan.parallel.layout", "Layout": "memplan.parallel.layout",
               "RankPlan": "memplan.parallel.plans", "rank_plans": "memplan.parallel.plans",
               "rank_trace": "memplan.parallel.transform"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY_NAMES:
        raise AttributeError(f"module 'memplan.parallel' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY_NAMES[name]), name)


__all__ = ["SCHEDULES", "Layout", "RankPlan", "rank_plans", "rank_trace"]
