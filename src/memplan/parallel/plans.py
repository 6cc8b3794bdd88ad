"""The ranks of a parallel layout whose memory differs, and how each one is estimated.

`rank_plans` lists one rank per pipeline stage role (with PP, the first stage, a middle
stage and the last, or every stage under a multi-stage schedule, whose rows of actions
differ by rank; without, rank 0 stands for every rank) and, for each, the training
setup its trace runs with, how to reshape a single-device trace to the rank
(`memplan.parallel.transform.rank_trace`) and what of the layout is traced on a fake
process group instead (`memplan.parallel.apply.traced_part`).

Rank numbering follows torchtitan's device mesh: pp outermost, then dp, then cp, then tp.
With CP, each CP coordinate is a plan of its own (the ring differs by rank).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from memplan.capture.step import StepTrace
from memplan.models.setup import TrainingSetup
from memplan.parallel.apply import modelled_rest, traced_part
from memplan.parallel.layout import MULTI_STAGE_SCHEDULES, Layout
from memplan.parallel.transform import data_parallel_trace, optimizer_offload_trace, rank_trace
from memplan.trace.model import Trace

if TYPE_CHECKING:  # transformers takes a second to import; only its config class is named here
    from transformers import PretrainedConfig


@dataclass
class RankPlan:
    """How to estimate one distinct rank."""

    rank: int
    stage: int
    setup: TrainingSetup
    layers: int | None
    transform: Callable[[StepTrace], Trace]
    communicators: int
    same_as: list[int] = field(default_factory=list)
    # what is traced on a fake process group (`memplan.parallel.apply.traced_part`): the
    # whole layout, its TP (x PP) part, or nothing (None: `transform` models the rank)
    traced_layout: Layout | None = None
    traced_rank: int = 0  # this rank's number in `traced_layout`
    # the modelled rest, applied to the traced step (None: the trace is the rank's)
    traced_transform: Callable[[StepTrace], Trace] | None = None

    @property
    def traceable(self) -> bool:
        return self.traced_layout is not None


def rank_plans(layout: Layout, config: PretrainedConfig, setup: TrainingSetup,
               total_layers: int | None) -> list[RankPlan]:
    """One plan per distinct rank (see the module docstring)."""
    # process groups a rank communicates over: FSDP2's / DDP's (with CP, "dp_shard_cp"), CP's
    # ring, TP, PP, HSDP's replicas
    communicators = (int(layout.dp > 1 or layout.cp > 1) + int(layout.cp > 1) + int(layout.tp > 1)
                     + int(layout.pp > 1) + int(layout.shard_size is not None))
    if layout.cp > 1:
        return _context_parallel_plans(layout, config, setup, total_layers, communicators)
    per_stage = layout.dp * layout.tp
    every_stage = layout.schedule in MULTI_STAGE_SCHEDULES  # each rank's row of the schedule differs
    if layout.pp == 1:
        stages = [0]
    else:
        stages = list(range(layout.pp)) if every_stage else sorted({0, min(1, layout.pp - 1), layout.pp - 1})
    plans = []
    # DeepSpeed's ZeRO-Offload over several ranks: the plain step, traced or modelled,
    # then its optimizer moved to the host (`optimizer_offload_trace`); on one device,
    # torchao's CPUOffloadOptimizer is traced with the step itself
    offload = setup.cpu_offload == "optimizer" and layout.dp > 1
    for stage in stages:
        layers = total_layers if layout.pp == 1 or total_layers is None else total_layers // layout.pp
        stage_setup = setup if layout.pp == 1 else replace(setup, grad_accum=1)
        if offload:
            stage_setup = replace(stage_setup, cpu_offload="none")
        if layout.pp > 1:
            alone = every_stage or stage in (0, layout.pp - 1)
            covered = [stage] if alone else list(range(1, layout.pp - 1))
        else:
            covered = [0]
        ranks = [s * per_stage + i for s in covered for i in range(per_stage)]

        def transform(step: StepTrace, stage: int = stage) -> Trace:
            return rank_trace(step, layout, setup, stage)

        part = traced_part(layout, config, setup)
        traced_rank = stage * part.dp * part.tp if part is not None else 0

        def rest(step: StepTrace) -> Trace:
            return data_parallel_trace(step, layout, setup)

        traced_rest = rest if modelled_rest(layout, part) else None
        plans.append(RankPlan(stage * per_stage, stage, stage_setup, layers,
                              _offloaded(transform) if offload else transform, communicators, ranks, part,
                              traced_rank, _offloaded(traced_rest) if offload else traced_rest))
    return plans


def _offloaded(transform: Callable[[StepTrace], Trace] | None) -> Callable[[StepTrace], Trace]:
    """`transform` (None: the traced step itself), then DeepSpeed's ZeRO-Offload."""
    def view(step: StepTrace) -> Trace:
        return optimizer_offload_trace(transform(step) if transform is not None else step.trace)
    return view


def _context_parallel_plans(layout: Layout, config: PretrainedConfig, setup: TrainingSetup,
                            total_layers: int | None, communicators: int) -> list[RankPlan]:
    """One plan per CP rank: the ring differs by rank (`_templated_ring_attention`: at step
    i, a rank whose ring source comes before it attends with its whole query block to the
    first half of the received keys, the others with the second half of their queries to
    all of them), so each CP coordinate is traced; the data-parallel ranks with the same
    CP coordinate (global rank = dp index x cp + cp index, torchtitan's mesh order) hold
    the same shapes."""
    part = traced_part(layout, config, setup)

    def transform(step: StepTrace) -> Trace:
        return rank_trace(step, layout, setup, 0)

    return [RankPlan(c * layout.tp, 0, setup, total_layers, transform, communicators,
                     [(d * layout.cp + c) * layout.tp + t for d in range(layout.dp) for t in range(layout.tp)],
                     part, c * layout.tp, None)
            for c in range(layout.cp)]
