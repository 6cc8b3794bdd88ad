"""Parallel layouts: DP / ZeRO 0-3 (FSDP2 for stage 3, HSDP), TP (+ sequence parallel), PP, CP, EP.

`Layout` holds the degrees and checks them against a model. Which ranks differ, and how
each is estimated, is `memplan.parallel.plans`.

`engine` is the library that shards (ZeRO stages 1-3): `fsdp2` (`fully_shard`, the
default for stage 3), `fsdp1` (`FullyShardedDataParallel` `FULL_SHARD`, stage 3) or `deepspeed` (DeepSpeed's ZeRO optimizers, the default
for stages 1 and 2, which only DeepSpeed implements as such). None: the stage's default.

Rank numbering follows torchtitan's device mesh (`torchtitan/distributed/parallel_dims.py`,
`ParallelDims.build_mesh`: pp, dp_replicate, dp_shard, cp, tp): pp outermost, then dp,
then cp, then tp; world size = dp x cp x tp x pp. Expert
parallelism (`ep`) borrows its ranks from dp x tp (`memplan.parallel.expert`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any, Literal, get_args

from memplan.errors import UserError
from memplan.models.fields import check_choices, option
from memplan.models.setup import TrainingSetup

if TYPE_CHECKING:  # transformers takes a second to import; only its config class is named here
    from transformers import PretrainedConfig

Schedule = Literal["1f1b", "interleaved", "interleaved-zb", "zbv"]
FsdpParamDtype = Literal["bf16", "fp16", "fp32"]
Engine = Literal["fsdp2", "fsdp1", "deepspeed"]
ZeroStage = Literal[0, 1, 2, 3]

SCHEDULES: tuple[str, ...] = get_args(Schedule)
# PyTorch's multi-stage schedules (`memplan.parallel.schedules`): interleaved 1F1B, interleaved
# zero bubble (ZB1P) and ZB-V, each with INTERLEAVED_CHUNKS model chunks ("stages") per rank
MULTI_STAGE_SCHEDULES = ("interleaved", "interleaved-zb", "zbv")
FSDP_PARAM_DTYPES: tuple[str, ...] = get_args(FsdpParamDtype)
INTERLEAVED_CHUNKS = 2  # model chunks per rank with a multi-stage schedule (ZB-V requires exactly 2)
ENGINES: tuple[str, ...] = get_args(Engine)
# FSDP1's ZeRO-2 (`SHARD_GRAD_OP`) is left out: with `use_orig_params=True` on a CPU group it
# fails in torch 2.13 ("If skipped using sharded views, the unsharded flat parameter should be
# allocated", `FlatParamHandle`), so it cannot be checked against a real run here
ENGINE_STAGES = {"fsdp2": (3,), "fsdp1": (3,), "deepspeed": (1, 2, 3)}  # the ZeRO stages each implements


@dataclass(frozen=True)
class DeepSpeedConfig:
    """The ZeRO knobs the model uses (DeepSpeed's defaults: `memplan.parallel.deepspeed`); `Layout.deepspeed`."""

    reduce_bucket_size: int = option(500_000_000, "reduce_bucket_size: one bucket of N model-dtype elements",
                                     "deepspeed", flag="--ds-reduce-bucket-size", metavar="N")
    prefetch_bucket_size: int = option(50_000_000, "stage3_prefetch_bucket_size", "deepspeed",
                                       flag="--ds-prefetch-bucket-size", metavar="N")
    param_persistence_threshold: int = option(100_000, "stage3_param_persistence_threshold: parameters this "
                                              "small stay whole", "deepspeed",
                                              flag="--ds-param-persistence-threshold", metavar="N")
    max_live_parameters: int = option(1_000_000_000, "stage3_max_live_parameters", "deepspeed",
                                      flag="--ds-max-live-parameters", metavar="N")
    overlap_comm: bool = option(False, "overlap_comm for stages 1-2: two reduce buckets", "deepspeed",
                                flag="--ds-overlap-comm")

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "overlap_comm" and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise UserError(f"`deepspeed.{f.name}` must be a whole number of elements >= 0, not {value!r}")


@dataclass
class Layout:
    """Degrees of parallelism. `world_size` None: tp x pp x cp (x 1 data-parallel rank).
    Each field's help, section and flag are declared here (`memplan.models.fields`)."""

    world_size: int | None = option(None, "GPUs in the job", "parallelism", metavar="N", default_text="tp x pp x cp")
    zero: ZeroStage = option(0, "0 DDP, 1-2 DeepSpeed ZeRO, 3 FSDP2 fully_shard (engine picks another)",
                             "parallelism")
    shard_size: int | None = option(None, "HSDP: shard over N ranks (zero 3)", "parallelism", metavar="N")
    tp: int = option(1, "tensor-parallel degree (DTensor, torchtitan's Llama plan)", "parallelism", metavar="T")
    pp: int = option(1, "pipeline-parallel degree", "parallelism", metavar="P")
    cp: int = option(1, "context-parallel degree: PyTorch's context_parallel ring attention, with zero 3",
                     "parallelism", metavar="C")  # `memplan.parallel.context`
    microbatches: int = option(1, "pipeline micro-batches", "parallelism", metavar="M")
    schedule: Schedule = option("1f1b", "pipeline schedule", "parallelism")
    # FSDP's mixed precision (zero 3): gather and compute in this dtype, reduce in fp32; derived from the setup's
    # precision (`memplan.parallel.apply.traced_precision`), no flag of its own
    fsdp_param_dtype: FsdpParamDtype | None = option(None, "FSDP mixed precision: gather and compute in this dtype",
                                                     "parallelism", cli=False)
    engine: Engine | None = option(None, "who shards under zero: fsdp2 (fully_shard; stage 3), fsdp1 "
                                   "(FullyShardedDataParallel as HF Trainer / accelerate set it up; stage 3) or "
                                   "deepspeed (stages 1-3)", "parallelism",
                                   default_text="fsdp2 for stage 3, deepspeed for 1-2")
    ep: int = option(1, "expert-parallel degree (mixture-of-experts, with zero 3): routed experts split over E "
                     "ranks taken from dp x tp, tokens exchanged by all-to-all", "parallelism", metavar="E")
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)  # DeepSpeed's ZeRO knobs

    def __post_init__(self) -> None:
        if isinstance(self.deepspeed, dict):  # as `to_dict` writes it
            self.deepspeed = DeepSpeedConfig(**self.deepspeed)
        for name in ("tp", "pp", "cp", "microbatches", "ep"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UserError(f"`{name}` must be a whole number >= 1, not {value!r}")
        if self.world_size is None:
            self.world_size = self.tp * self.pp * self.cp
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise UserError(f"`world_size` must be a whole number >= 1, not {self.world_size!r}")
        check_choices(self)
        if self.world_size % (self.tp * self.pp * self.cp):
            raise UserError(f"`world_size` {self.world_size} is not divisible by tp x pp x cp = {self.tp} x "
                            f"{self.pp} x {self.cp}: use a world size that is a multiple of "
                            f"{self.tp * self.pp * self.cp}")
        if self.shard_size is not None:
            if self.zero != 3:
                raise UserError("`shard_size` (HSDP) needs `zero=3`")
            if self.shard_size < 1 or self.dp % self.shard_size:
                raise UserError(f"`shard_size` {self.shard_size} must divide the data-parallel degree {self.dp}")
        if self.fsdp_param_dtype is not None and self.zero != 3:
            raise UserError("`fsdp_param_dtype` (FSDP2's mixed-precision policy) needs `zero=3`")
        self._check_engine()
        if self.ep > 1:
            self._check_expert_parallel()

    def _check_expert_parallel(self) -> None:
        """UserError (one line) for an EP degree the ranks cannot hold: EP takes its ranks
        from dp x tp, a multiple of the TP group (transformers' `DistributedConfig`:
        "ep_size must be a multiple of tp_size and divide fsdp_size * tp_size"; torchtitan's
        `ParallelDims` with expert TP 1), and runs with FSDP2, as torchtitan applies it
        whenever EP is on."""
        if self.tp == 1 and self.dp % self.ep:
            raise UserError(f"`ep={self.ep}` does not divide the data-parallel degree {self.dp} (EP takes its "
                            f"ranks from data parallelism): pick a divisor of {self.dp}")
        if self.ep % self.tp or (self.dp * self.tp) % self.ep:
            raise UserError(f"`ep={self.ep}` must be a multiple of `tp={self.tp}` and divide dp x tp = "
                            f"{self.dp * self.tp} (EP takes its ranks from the data- and tensor-parallel ones)")
        if self.zero != 3:
            raise UserError("`ep` shards the dense parts and the experts with FSDP2: add `zero=3`")
        if self.pp > 1 or self.cp > 1 or self.shard_size is not None:
            raise UserError("`ep` is estimated with FSDP2 and TP only: leave out `pp`, `cp` and `shard_size`")

    def _check_engine(self) -> None:
        if self.deepspeed != DeepSpeedConfig() and self.zero_engine != "deepspeed":
            given = next(f.name for f in fields(DeepSpeedConfig)
                         if getattr(self.deepspeed, f.name) != getattr(DeepSpeedConfig(), f.name))
            raise UserError(f"`deepspeed.{given}` configures DeepSpeed's ZeRO: add `zero=1|2|3` "
                            "`engine=deepspeed`")
        if self.engine is None:
            return
        if self.zero == 0:
            raise UserError(f"`engine={self.engine}` picks who shards with ZeRO; `zero=0` (DDP) shards nothing: "
                            "add `zero=1|2|3` or leave `engine` out")
        stages = ENGINE_STAGES[self.engine]
        if self.zero not in stages:
            raise UserError(f"`engine={self.engine}` implements ZeRO stage {' and '.join(map(str, stages))}, "
                            f"not {self.zero}: use `engine=deepspeed` for stage {self.zero}")
        if self.engine != "fsdp2" and (self.tp > 1 or self.pp > 1 or self.cp > 1 or self.ep > 1
                                       or self.shard_size is not None):
            raise UserError(f"`engine={self.engine}` is estimated alone (data parallel only): leave out `tp`, "
                            "`pp`, `cp`, `ep` and `shard_size`, or use `engine=fsdp2`")
        if self.engine == "deepspeed" and self.fsdp_param_dtype is not None:
            raise UserError("`fsdp_param_dtype` is FSDP's mixed precision: DeepSpeed trains in the setup's "
                            "`dtype`; leave it out")

    @property
    def zero_engine(self) -> str | None:
        """Who shards: the `engine` given, else the stage's default (fsdp2 for 3,
        deepspeed for 1 and 2); None without ZeRO."""
        if self.zero == 0:
            return None
        return self.engine or ("fsdp2" if self.zero == 3 else "deepspeed")

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp * self.cp)  # type: ignore[operator]

    @property
    def shard_degree(self) -> int:
        """Ranks that share one copy of the sharded state (ZeRO / FSDP group; with CP, FSDP2
        shards over the data-parallel x CP ranks, torchtitan's "dp_shard_cp")."""
        if self.zero == 0:
            return 1
        return (self.shard_size if self.shard_size is not None else self.dp) * self.cp

    @property
    def efsdp(self) -> int:
        """Ranks that hold the same experts and FSDP2-shard them (dp x tp / ep)."""
        return self.dp * self.tp // self.ep

    def check(self, config: PretrainedConfig, setup: TrainingSetup) -> None:
        """Raise `UserError` when the model cannot take this layout."""
        from memplan.models.depth import num_layers
        from memplan.models.registry import FactorySpec

        if self.ep > 1:
            self._check_experts(config, setup)
        if isinstance(config, FactorySpec) and (self.tp > 1 or self.pp > 1):
            raise UserError(f"`tp` and `pp` split the heads and blocks of a Hugging Face config; the factory "
                            f"{config.spec} builds its own model: estimate it on one GPU, or data-parallel "
                            "with `world_size`")
        if setup.impl != "hf" and (self.tp > 1 or self.pp > 1):
            raise UserError(f"`tp` and `pp` split Hugging Face modules; `impl={setup.impl}` builds LitGPT's GPT: "
                            "use data parallelism (`world_size`, `zero`) with it")
        heads = getattr(config, "num_attention_heads", None)
        kv = getattr(config, "num_key_value_heads", None) or heads
        if self.tp > 1:
            if not heads or heads % self.tp:
                raise UserError(f"`tp={self.tp}` does not divide the {heads} attention heads: pick a divisor of "
                                f"{heads}")
            if kv % self.tp:
                raise UserError(f"`tp={self.tp}` does not divide the {kv} key/value heads: pick a divisor of {kv}")
        if self.pp > 1:
            blocks = num_layers(config) or 0
            chunks = self.pp * (INTERLEAVED_CHUNKS if self.schedule in MULTI_STAGE_SCHEDULES else 1)
            if blocks % chunks:
                raise UserError(f"{blocks} blocks do not split evenly over {chunks} pipeline chunks"
                                f" (pp {self.pp}{f', {self.schedule} x2' if chunks != self.pp else ''})")
            if setup.grad_accum != 1:
                raise UserError("with `pp`, give micro-batches with `microbatches`, not `grad_accum`")
            if setup.loss != "full" or setup.activation_offload != "none":
                raise UserError("a pipeline stage runs its own head, loss and forward: `loss` and "
                                "`activation_offload` are estimated without `pp`")
        if self.tp > 1 and setup.loss == "fused-linear":
            raise UserError("`loss=fused-linear` takes the whole output weight, which `tp` shards over the "
                            "vocabulary: use `loss=chunked` with `tp`")
        from memplan.models.rl_losses import (
            RL_LOSSES,  # torch, which the declaration alone does not need
        )

        if self.tp > 1 and setup.loss.partition(":")[0] in RL_LOSSES:
            raise UserError(f"`loss={setup.loss}` (an RL trainer's own scoring of the head) is estimated without `tp`")
        if self.cp > 1:
            self._check_context_parallel(config, setup)
        self._check_offload(setup)

    def _check_experts(self, config: PretrainedConfig, setup: TrainingSetup) -> None:
        """`UserError` for expert parallelism over a model without as many routed experts."""
        from memplan.models.moe import experts_of
        from memplan.models.registry import FactorySpec

        experts = None if isinstance(config, FactorySpec) else experts_of(config)
        if experts is None:
            name = getattr(config, "spec", None) or repr(getattr(config, "model_type", "?"))
            raise UserError(f"`ep` splits the routed experts of a mixture-of-experts model; {name} has none: "
                            "leave `ep` out")
        if experts[0] % self.ep:
            raise UserError(f"`ep={self.ep}` does not divide the {experts[0]} experts: pick a divisor of "
                            f"{experts[0]}")
        if setup.lora_rank:
            raise UserError("`ep` with `lora_rank` is not supported by this version of memplan")

    def _check_offload(self, setup: TrainingSetup) -> None:
        """`UserError` for CPU offloading this layout cannot take (docs/estimation.md)."""
        if setup.cpu_offload == "none":
            return
        if self.tp > 1 or self.pp > 1 or self.cp > 1 or self.ep > 1:
            raise UserError("`cpu_offload` is estimated for data parallelism only: leave out `tp`, `pp`, `cp` "
                            "and `ep`")
        if setup.cpu_offload == "params" and (self.zero != 3 or self.dp < 2):
            raise UserError("`cpu_offload=params` is FSDP2's CPUOffloadPolicy: add `zero=3` and `world_size=2` "
                            "or more")
        if setup.cpu_offload == "optimizer" and self.dp > 1 and self.zero < 2:
            raise UserError("`cpu_offload=optimizer` over several GPUs is DeepSpeed's ZeRO-Offload, which "
                            "partitions gradients to the host as ZeRO-2 does: add `zero=2` or 3")

    def _check_context_parallel(self, config: PretrainedConfig, setup: TrainingSetup) -> None:
        """What PyTorch's `context_parallel` (and memplan's application of it) needs."""
        from memplan.models.build import sequence_length
        from memplan.models.registry import FactorySpec

        if self.pp > 1 or self.tp > 1 or self.shard_size is not None:
            raise UserError("`cp` is applied with FSDP2 alone here, not composed with `pp`, `tp` or `shard_size`: "
                            "drop one of them")
        if self.zero != 3:
            raise UserError("`cp` runs with FSDP2 over the data-parallel x CP ranks (as torchtitan and accelerate "
                            "apply it): add `zero=3`")
        if setup.attn == "eager":
            raise UserError("`cp` needs `attn=sdpa` or flash: context_parallel shards SDPA's fused kernels, and "
                            "eager attention is plain matmuls it does not split")
        if isinstance(config, FactorySpec) or not hasattr(config, "vocab_size"):
            raise UserError("`cp` splits the sequence of a Hugging Face causal LM; a factory model builds its own")
        if setup.head != "lm":
            raise UserError("`cp` splits a causal LM's tokens and labels: use `head=lm`")
        seq = sequence_length(setup, config)
        if seq % (2 * self.cp):
            raise UserError(f"`cp={self.cp}` splits the sequence into 2 x {self.cp} equal chunks (PyTorch's "
                            f"load balancer): sequence {seq} is not divisible by {2 * self.cp}")

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["dp"] = self.dp
        data["engine"] = self.zero_engine
        return data
