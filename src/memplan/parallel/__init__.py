"""Parallel layouts applied to a traced step: DP, ZeRO 0-3 / FSDP2 / HSDP, TP + SP, PP.

`Layout` (degrees and their checks), `plans.rank_plans` (the ranks that differ),
`apply.apply_layout` (DDP / FSDP2 / TP applied to a model, for real or on a fake process
group), `traced.capture_rank_step` (one rank's step traced on a fake process group),
`groundtruth.measure_rank_peaks` (real gloo runs measured with torch.profiler) and
`rank_trace` (one rank's trace, modelled from the single-device trace). See each module.
"""

from memplan.parallel.layout import SCHEDULES, Layout
from memplan.parallel.plans import RankPlan, rank_plans
from memplan.parallel.transform import rank_trace

__all__ = ["SCHEDULES", "Layout", "RankPlan", "rank_plans", "rank_trace"]
