"""Parallel layouts: DP / ZeRO 0-3 (FSDP2 for stage 3, HSDP), TP (+ sequence parallel), PP.

`Layout` holds the degrees and checks them against a model; `rank_plans` lists the
ranks whose memory differs (one per pipeline stage role: with PP, the first stage,
a middle stage and the last; without, rank 0 stands for every rank) and, for each,
the training setup its trace runs with and how to reshape that trace to the rank
(`memplan.parallel.transform.rank_trace`).

Rank numbering follows torchtitan's device mesh: pp outermost, then dp, then tp.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from memplan.errors import UserError
from memplan.models.depth import num_layers

SCHEDULES = ("1f1b", "interleaved")
FSDP_PARAM_DTYPES = ("bf16", "fp16", "fp32")
INTERLEAVED_CHUNKS = 2  # model chunks per rank with the interleaved schedule


@dataclass
class Layout:
    """Degrees of parallelism. `world_size` None: tp x pp (x 1 data-parallel rank)."""

    world_size: int | None = None
    zero: int = 0
    shard_size: int | None = None
    tp: int = 1
    pp: int = 1
    microbatches: int = 1
    schedule: str = "1f1b"
    fsdp_param_dtype: str | None = None  # FSDP2 MixedPrecisionPolicy(param_dtype=..., reduce_dtype=fp32)

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "microbatches"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise UserError(f"{name.replace('_', '-')} must be a whole number >= 1, not {value!r}")
        if self.world_size is None:
            self.world_size = self.tp * self.pp
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise UserError(f"world size must be a whole number >= 1, not {self.world_size!r}")
        if self.zero not in (0, 1, 2, 3):
            raise UserError(f"zero stage must be 0, 1, 2 or 3, not {self.zero!r}")
        if self.schedule not in SCHEDULES:
            raise UserError(f"schedule must be one of {', '.join(SCHEDULES)}, not {self.schedule!r}")
        if self.world_size % (self.tp * self.pp):
            raise UserError(f"world size {self.world_size} is not divisible by tp x pp = {self.tp} x {self.pp}:"
                            f" use a world size that is a multiple of {self.tp * self.pp}")
        if self.shard_size is not None:
            if self.zero != 3:
                raise UserError("--shard-size (HSDP) needs --zero 3")
            if self.shard_size < 1 or self.dp % self.shard_size:
                raise UserError(f"shard size {self.shard_size} must divide the data-parallel degree {self.dp}")
        if self.fsdp_param_dtype is not None:
            if self.fsdp_param_dtype not in FSDP_PARAM_DTYPES:
                raise UserError(f"fsdp param dtype must be one of {', '.join(FSDP_PARAM_DTYPES)}, "
                                f"not {self.fsdp_param_dtype!r}")
            if self.zero != 3:
                raise UserError("--fsdp-param-dtype (FSDP2's mixed-precision policy) needs --zero 3")
        if self.pp > 1 and self.schedule == "1f1b" and self.microbatches < 1:
            raise UserError("pipeline parallelism needs --microbatches >= 1")

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)  # type: ignore[operator]

    @property
    def shard_degree(self) -> int:
        """Ranks that share one copy of the sharded state (ZeRO / FSDP group)."""
        if self.zero == 0:
            return 1
        return self.shard_size if self.shard_size is not None else self.dp

    def check(self, config: Any, setup: Any) -> None:
        """Raise `UserError` when the model cannot take this layout."""
        heads = getattr(config, "num_attention_heads", None)
        kv = getattr(config, "num_key_value_heads", None) or heads
        if self.tp > 1:
            if not heads or heads % self.tp:
                raise UserError(f"tp {self.tp} does not divide the {heads} attention heads: pick a divisor of {heads}")
            if kv % self.tp:
                raise UserError(f"tp {self.tp} does not divide the {kv} key/value heads: pick a divisor of {kv}")
        if self.pp > 1:
            blocks = num_layers(config) or 0
            chunks = self.pp * (INTERLEAVED_CHUNKS if self.schedule == "interleaved" else 1)
            if blocks % chunks:
                raise UserError(f"{blocks} blocks do not split evenly over {chunks} pipeline chunks"
                                f" (pp {self.pp}{', interleaved x2' if chunks != self.pp else ''})")
            if setup.grad_accum != 1:
                raise UserError("with --pp, give micro-batches with --microbatches, not --grad-accum")

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["dp"] = self.dp
        return data


@dataclass
class RankPlan:
    """How to estimate one distinct rank."""

    rank: int
    stage: int
    setup: Any
    layers: int | None
    transform: Callable[[Any], Any]
    communicators: int
    same_as: list[int] = field(default_factory=list)
    # what is traced on a fake process group (`memplan.parallel.apply.traced_part`): the
    # whole layout, its TP (x PP) part, or nothing (None: `transform` models the rank)
    traced_layout: Any = None
    traced_rank: int = 0  # this rank's number in `traced_layout`
    # the modelled rest, applied to the traced step (None: the trace is the rank's)
    traced_transform: Callable[[Any], Any] | None = None

    @property
    def traceable(self) -> bool:
        return self.traced_layout is not None


def rank_plans(layout: Layout, config: Any, setup: Any, total_layers: int | None) -> list[RankPlan]:
    """One plan per distinct rank (see the module docstring)."""
    from memplan.parallel.apply import modelled_rest, traced_part
    from memplan.parallel.transform import data_parallel_trace, rank_trace

    per_stage = layout.dp * layout.tp
    stages = [0] if layout.pp == 1 else sorted({0, min(1, layout.pp - 1), layout.pp - 1})
    communicators = int(layout.dp > 1) + int(layout.tp > 1) + int(layout.pp > 1) + int(layout.shard_size is not None)
    plans = []
    for stage in stages:
        layers = total_layers if layout.pp == 1 or total_layers is None else total_layers // layout.pp
        stage_setup = setup if layout.pp == 1 else replace(setup, grad_accum=1)
        if layout.pp > 1:
            covered = [stage] if stage in (0, layout.pp - 1) else list(range(1, layout.pp - 1))
        else:
            covered = [0]
        ranks = [s * per_stage + i for s in covered for i in range(per_stage)]

        def transform(step: Any, stage: int = stage) -> Any:
            return rank_trace(step, layout, setup, stage)

        part = traced_part(layout, config, setup)
        traced_rank = stage * part.dp * part.tp if part is not None else 0

        def rest(step: Any) -> Any:
            return data_parallel_trace(step, layout, setup)

        plans.append(RankPlan(stage * per_stage, stage, stage_setup, layers, transform, communicators, ranks,
                              part, traced_rank, rest if modelled_rest(layout, part) else None))
    return plans
