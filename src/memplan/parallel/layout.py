"""Parallel layouts: DP / ZeRO 0-3 (FSDP2 for stage 3, HSDP), TP (+ sequence parallel), PP, EP.

`Layout` holds the degrees and checks them against a model. Which ranks differ, and how
each is estimated, is `memplan.parallel.plans`.

Rank numbering follows torchtitan's device mesh: pp outermost, then dp, then tp. Expert
parallelism (`ep`) borrows its ranks from dp x tp (`memplan.parallel.expert`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from memplan.errors import UserError
from memplan.models.depth import num_layers
from memplan.models.moe import experts_of
from memplan.models.registry import FactorySpec
from memplan.models.setup import TrainingSetup

if TYPE_CHECKING:  # transformers takes a second to import; only its config class is named here
    from transformers import PretrainedConfig

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
    ep: int = 1  # expert parallelism: routed experts split over ep ranks taken from dp x tp

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "microbatches", "ep"):
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
        if self.ep > 1:
            self._check_expert_parallel()

    def _check_expert_parallel(self) -> None:
        """UserError (one line) for an EP degree the ranks cannot hold: EP takes its ranks
        from dp x tp, a multiple of the TP group (transformers' `DistributedConfig`:
        "ep_size must be a multiple of tp_size and divide fsdp_size * tp_size"; torchtitan's
        `ParallelDims` with expert TP 1), and runs with FSDP2, as torchtitan applies it
        whenever EP is on."""
        if self.tp == 1 and self.dp % self.ep:
            raise UserError(f"--ep {self.ep} does not divide the data-parallel degree {self.dp} (EP takes its ranks "
                            f"from data parallelism): pick a divisor of {self.dp}")
        if self.ep % self.tp or (self.dp * self.tp) % self.ep:
            raise UserError(f"--ep {self.ep} must be a multiple of --tp {self.tp} and divide dp x tp = "
                            f"{self.dp * self.tp} (EP takes its ranks from the data- and tensor-parallel ones)")
        if self.zero != 3:
            raise UserError("--ep shards the dense parts and the experts with FSDP2: add --zero 3")
        if self.pp > 1 or self.shard_size is not None:
            raise UserError("--ep is estimated with FSDP2 and TP only: leave out --pp and --shard-size")

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)  # type: ignore[operator]

    @property
    def shard_degree(self) -> int:
        """Ranks that share one copy of the sharded state (ZeRO / FSDP group)."""
        if self.zero == 0:
            return 1
        return self.shard_size if self.shard_size is not None else self.dp

    @property
    def efsdp(self) -> int:
        """Ranks that hold the same experts and FSDP2-shard them (dp x tp / ep)."""
        return self.dp * self.tp // self.ep

    def check(self, config: PretrainedConfig, setup: TrainingSetup) -> None:
        """Raise `UserError` when the model cannot take this layout."""
        if self.ep > 1:
            experts = None if isinstance(config, FactorySpec) else experts_of(config)
            if experts is None:
                name = getattr(config, "spec", None) or repr(getattr(config, "model_type", "?"))
                raise UserError(f"--ep splits the routed experts of a mixture-of-experts model; {name} has none: "
                                "leave --ep out")
            if experts[0] % self.ep:
                raise UserError(f"--ep {self.ep} does not divide the {experts[0]} experts: pick a divisor of "
                                f"{experts[0]}")
            if setup.lora_rank:
                raise UserError("--ep with --lora-rank is not supported by this version of memplan")
        if isinstance(config, FactorySpec) and (self.tp > 1 or self.pp > 1):
            raise UserError(f"--tp and --pp split the heads and blocks of a Hugging Face config; the factory "
                            f"{config.spec} builds its own model: estimate it on one GPU, or data-parallel "
                            "with --world-size")
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
