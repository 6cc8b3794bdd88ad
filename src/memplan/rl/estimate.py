"""`estimate_rl`: the memory of one RL post-training step, phase by phase, on one GPU.

The step's figures come from memplan's own engines, each traced or modelled once:

1. the **training step** of the policy at `P + C` tokens and the micro-batch, with the
   trainer's own loss (`memplan.models.rl_losses`, e.g. TRL's GRPO objective on its fused
   chunked log-probability head), estimated by `memplan.estimation.estimate` (its layout,
   its allocator replay, its GPU terms);
2. the **no-gradient passes** (old policy's and reference's log-probabilities, a reward
   model's score) traced by `memplan.rl.passes`;
3. the **rollout**: a colocated or separate vLLM engine sized by
   `memplan.inference.estimate_serving` with the flags the trainer passes it (and what the
   trainer already holds when it starts), or the transformers rollout (`model.generate` on
   the policy) traced by `memplan generate`'s `estimate_generation` with the trainer's own
   generation settings (`memplan.rl.rollout`);
4. the **weight sync**'s transient: the full parameters gathered at once (one parameter at
   a time under ZeRO-3, the largest one bounding it; the whole model for a PEFT model
   under ZeRO-3 in TRL).

`memplan.rl.phases.assemble_phases` lays them out in the trainer's order with the rules
of `memplan.rl.trainers`; the verdict is what each phase needs (`Phase.needed_bytes`)
against the GPU's capacity less the margin, and the engine's own refusal at start-up.

Assumes one GPU per rank with the same residents on every rank (the heaviest rank of the
training estimate stands for all), every completion at its full length, the reference
sharded as the policy, ZeRO-3 shards without padding, and the trainers' own defaults
where the job does not say (`memplan.rl.trainers`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from typing import Any

from memplan.errors import UserError
from memplan.estimation import Estimate, estimate
from memplan.estimation.pipeline import model_parameters
from memplan.hardware.devices import device_profile
from memplan.inference import estimate_serving
from memplan.inference.weights import meta_parameters
from memplan.models.depth import num_layers
from memplan.models.dtypes import TORCH_DTYPES
from memplan.models.registry import FactorySpec, load_config
from memplan.models.setup import TrainingSetup
from memplan.parallel.layout import Layout
from memplan.rl.passes import no_grad_pass
from memplan.rl.phases import EngineFigures, Phase, PhaseOptions, StepFigures, assemble_phases
from memplan.rl.rollout import (
    TRL_GENERATION_DEFAULTS,
    TrainerGeneration,
    rollout_figures,
    trainer_generation,
)
from memplan.rl.trainers import REFERENCES, TrainerRules, trainer_rules

DEFAULT_MARGIN = 0.05  # as memplan estimate's verdict


@dataclass(frozen=True)
class RLJob:
    """The inputs of one RL estimate (see `estimate_rl`)."""

    model: str
    algo: str
    trainer: str
    rollout: str
    prompt_len: int
    completion_len: int
    num_generations: int
    setup: TrainingSetup
    layout: Layout
    gpu: str
    device: str = "cuda"
    sleep_level: int | None = None
    reference: str | None = None
    beta: float | None = None
    critic: str | None = None
    reward_model: str | None = None
    engine: dict[str, Any] = field(default_factory=dict)  # vLLM flags: gpu_memory_utilization, tp, ...
    margin: float = DEFAULT_MARGIN
    generation: dict[str, Any] = field(default_factory=dict)  # TRL's generation settings (rollout.TRL_GENERATION_DEFAULTS)
    offload: tuple[str, ...] = ()  # what the trainer keeps on the host between phases (trainers.OFFLOADS)


@dataclass
class RLEstimate:
    """What `memplan rl` reports; `to_json()` is its `--json` object."""

    job: RLJob
    capacity_bytes: int
    phases: list[Phase]
    settings: dict[str, Any]
    train: dict[str, Any]
    engine: dict[str, Any] | None
    assumptions: list[str]
    what_fits: list[dict[str, Any]] = field(default_factory=list)
    what_fits_tried: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def usable_bytes(self) -> int:
        return int(self.capacity_bytes * (1 - self.job.margin))

    @property
    def peak_phase(self) -> Phase:
        """The phase that needs the most memory (`Phase.needed_bytes`); among equals, the one
        holding the most device memory."""
        return max(self.phases, key=lambda p: (p.needed_bytes, p.device_used_bytes))

    @property
    def failing_phase(self) -> Phase | None:
        """The first phase that cannot run: the engine refuses, or what it needs does not fit."""
        return next((p for p in self.phases if p.fails or p.needed_bytes > self.usable_bytes), None)

    @property
    def fits(self) -> bool:
        return self.failing_phase is None

    def to_json(self) -> dict[str, Any]:
        peak, failing = self.peak_phase, self.failing_phase
        return {
            "model": self.job.model, "algo": self.job.algo, "trainer": self.job.trainer, "rollout": self.job.rollout,
            "gpu": self.job.gpu, "device": self.job.device, "capacity_bytes": self.capacity_bytes,
            "margin": self.job.margin, "usable_bytes": self.usable_bytes, "settings": self.settings,
            "phases": [p.to_json() for p in self.phases], "peak_phase": peak.name,
            "peak_bytes": peak.needed_bytes, "peak_device_used_bytes": peak.device_used_bytes, "fits": self.fits,
            "failing_phase": None if failing is None else failing.name,
            "over_by_bytes": 0 if failing is None else max(failing.needed_bytes - self.usable_bytes, 0),
            "margin_bytes": self.usable_bytes - peak.needed_bytes,
            "train": self.train, "engine": self.engine, "what_fits": self.what_fits,
            "what_fits_tried": self.what_fits_tried,
            "assumptions": self.assumptions, "elapsed_s": round(self.elapsed_s, 3),
        }


def estimate_rl(model: str, algo: str = "grpo", trainer: str = "trl", *, rollout: str = "vllm-colocate",
                prompt_len: int = 512, completion_len: int = 1024, num_generations: int = 8,
                setup: TrainingSetup | None = None, layout: Layout | None = None, gpu: str = "h100-80gb",
                device: str = "cuda", sleep_level: int | None = None, reference: str | None = None,
                beta: float | None = None, critic: str | None = None, reward_model: str | None = None,
                engine: dict[str, Any] | None = None, margin: float = DEFAULT_MARGIN,
                generation: dict[str, Any] | None = None, offload: tuple[str, ...] = ()) -> RLEstimate:
    """The phases of one step of RL post-training `model` (module docstring). `setup` is the
    policy's training setup (its `batch` the micro-batch of completions per GPU, its
    `grad_accum` the steps per generation); `engine` the vLLM flags (`gpu_memory_utilization`,
    `tp`, `max_num_seqs`, `max_num_batched_tokens`, `max_model_len`, `enforce_eager`,
    `engine_version`); `generation` TRL's generation settings for the transformers rollout
    (`temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty`, `cache_implementation`,
    `ds3_gather_for_generation`; TRL's defaults where not given); `offload` what the trainer
    keeps on the host between phases: `params` (verl's `param_offload`), `optimizer` (verl's
    `optimizer_offload`, OpenRLHF's `--ds.enable_sleep`)."""
    job = RLJob(model, algo, trainer, rollout, prompt_len, completion_len, num_generations,
                setup or TrainingSetup(), layout or Layout(), gpu, device, sleep_level, reference, beta, critic,
                reward_model, dict(engine or {}), margin, dict(generation or {}), tuple(offload))
    return run_job(job)


def run_job(job: RLJob) -> RLEstimate:
    """`estimate_rl` of a resolved job."""
    start = time.perf_counter()
    rules = check_job(job)
    job = with_trainer_layout(job, rules)
    figures, train, engine = step_figures(job, rules)
    options = phase_options(job, rules)
    phases = assemble_phases(figures, options)
    profile = device_profile(job.gpu)
    result = RLEstimate(job, profile.capacity_bytes, phases, settings(job, rules), train,
                        engine.serving if engine is not None else None, assumptions(job, rules))
    result.elapsed_s = time.perf_counter() - start
    return result


def check_job(job: RLJob) -> TrainerRules:
    """`UserError` for inputs no trainer takes; the trainer's rules otherwise."""
    rules = trainer_rules(job.trainer)
    rules.check(job.algo, job.rollout, job.sleep_level, resolved_reference(job, rules), job.critic)
    rules.check_offload(job.offload)
    if job.reference is not None and job.reference not in REFERENCES:
        raise UserError(f"--reference {job.reference!r}: one of {', '.join(REFERENCES)}")
    if job.reference == "peft" and job.setup.lora_rank == 0:
        raise UserError("--reference peft disables the LoRA adapter to score the reference: add --lora-rank R")
    if job.prompt_len < 1 or job.completion_len < 1:
        raise UserError("--prompt-len and --completion-len are at least 1")
    if job.num_generations < 1:
        raise UserError("--num-generations is at least 1")
    if not 0 <= job.margin < 1:
        raise UserError(f"--margin {job.margin} must be in [0, 1)")
    rows = job.setup.batch * job.setup.grad_accum * job.layout.world_size
    if rules.name == "trl" and job.algo in ("grpo", "rloo") and rows % job.num_generations:
        raise UserError(f"the generation batch ({job.setup.batch} x {job.setup.grad_accum} steps x "
                        f"{job.layout.world_size} GPUs = {rows}) is not a multiple of --num-generations "
                        f"{job.num_generations}: every prompt's completions must fall in one batch")
    return rules


def with_trainer_layout(job: RLJob, rules: TrainerRules) -> RLJob:
    """The job with the sharding library the trainer uses under ZeRO where it gives none
    (OpenRLHF: DeepSpeed's ZeRO optimizers)."""
    if rules.engine_for_zero is None or job.layout.zero == 0 or job.layout.engine is not None:
        return job
    return replace(job, layout=replace(job.layout, engine=rules.engine_for_zero))


def resolved_beta(job: RLJob, rules: TrainerRules) -> float:
    return rules.default_beta if job.beta is None else job.beta


def resolved_reference(job: RLJob, rules: TrainerRules) -> str:
    """none | copy | peft: the trainer's choice unless given (TRL: none at beta 0, the
    disabled adapter for PEFT, a second model otherwise)."""
    if job.reference is not None:
        return job.reference
    if job.algo != "dpo" and resolved_beta(job, rules) == 0.0:
        return "none"
    return "peft" if job.setup.lora_rank > 0 else "copy"


def resolved_sleep(job: RLJob, rules: TrainerRules) -> int:
    if job.rollout != "vllm-colocate":
        return 0
    return rules.default_sleep_level if job.sleep_level is None else job.sleep_level


def loss_kinds(job: RLJob, rules: TrainerRules) -> dict[str, str]:
    """The trainer's scoring code (`memplan.models.rl_losses`) for its training step, the
    old policy's pass and the reference's pass: verl's own full-logit code for verl (the
    actor's entropy except for LoRA), TRL's fused head otherwise."""
    if rules.name == "verl":
        old = "verl-ref-logprobs" if job.setup.lora_rank > 0 else "verl-logprobs"
        return {"train": "verl-ppo", "old": old, "reference": "verl-ref-logprobs"}
    train = "trl-grpo"
    if job.algo == "dpo":  # TRL scores the reference inside the step unless it has none
        train = "trl-dpo" if resolved_reference(job, rules) == "none" else "trl-dpo-ref"
    return {"train": train, "old": "trl-logprobs", "reference": "trl-logprobs"}


def policy_setup(job: RLJob, kind: str) -> TrainingSetup:
    """The policy's setup for the training step (`kind` trl-grpo / trl-dpo) or a
    no-gradient pass (trl-logprobs): `P + C` tokens, the trainer's scoring of C of them."""
    rows = job.setup.batch * (2 if job.algo == "dpo" else 1)
    return replace(job.setup, batch=rows, seq=job.prompt_len + job.completion_len, allow_long_seq=True,
                   loss=f"{kind}:{job.completion_len}",
                   grad_accum=1 if "logprobs" in kind else job.setup.grad_accum)


def phase_options(job: RLJob, rules: TrainerRules) -> PhaseOptions:
    vllm = job.rollout in ("vllm-colocate", "vllm-server")
    reference = resolved_reference(job, rules)
    return PhaseOptions(rollout=job.rollout, sleep_level=resolved_sleep(job, rules),
                        empty_cache_before_wake=rules.empty_cache_before_wake,
                        old_logprobs=vllm or job.algo == "ppo",
                        reference_logprobs=reference != "none" and job.algo != "dpo",
                        algo=job.algo, caching=job.device == "cuda", params_on_host="params" in job.offload,
                        optimizer_on_host="optimizer" in job.offload,
                        empty_cache_after_update=any(o in rules.offload_empties_cache for o in job.offload))


def step_figures(job: RLJob, rules: TrainerRules) -> tuple[StepFigures, dict[str, Any], EngineFigures | None]:
    """The traced and sized figures the phases are assembled from."""
    profile = device_profile(job.gpu)
    config = load_config(job.model)
    if isinstance(config, FactorySpec):
        raise UserError(f"model '{job.model}' is a factory: memplan rl needs a config (registry name, config.json "
                        "or Hub id)")
    kinds = loss_kinds(job, rules)
    train = train_estimate(config, policy_setup(job, kinds["train"]), job.layout, job.device, job.gpu)
    rank = max(train.per_rank, key=lambda r: r.device_used_bytes)
    lp = no_grad_pass(config, policy_setup(job, kinds["old"]), job.device, profile)
    reference = resolved_reference(job, rules)
    ref_lp = no_grad_pass(config, policy_setup(job, kinds["reference"]), job.device, profile) \
        if phase_options(job, rules).reference_logprobs else lp
    shards = job.layout.world_size if job.layout.zero == 3 else 1
    policy = lp.parameters_bytes // shards
    block = lp.parameters_bytes // max(num_layers(config) or 1, 1)
    zero3_block = block if job.layout.zero == 3 else 0
    host_reference = reference == "copy" and rules.reference_on_host
    outside = rank.device_used_bytes - rank.peak_reserved_bytes
    critic_resident, critic_extra, contexts = _critic(job, rules, profile, shards)
    reward_resident, reward_transient = _reward(job, profile, shards)
    if reward_resident and "reward" in rules.separate_processes and job.device == "cuda":
        contexts["reward"] = profile.context_bytes()
    if reference == "copy" and "reference" in rules.separate_processes and job.device == "cuda":
        contexts["reference"] = profile.context_bytes()
    if job.rollout == "vllm-colocate" and "engine" in rules.separate_processes and job.device == "cuda":
        contexts["engine"] = profile.context_bytes()
    figures = StepFigures(
        outside_bytes=outside, extra_contexts=contexts, policy_bytes=policy,
        optimizer_bytes=rank.breakdown["optimizer_state"],
        reference_bytes=lp.parameters_bytes // shards if reference == "copy" and not host_reference else 0,
        critic_bytes=critic_resident, reward_bytes=reward_resident,
        train_allocated_bytes=rank.peak_allocated_bytes, train_reserved_bytes=rank.peak_reserved_bytes,
        logprob_transient_bytes=lp.transient_bytes + zero3_block,
        reference_transient_bytes=ref_lp.transient_bytes + (block if host_reference else zero3_block),
        logprob_cached_bytes=max(lp.cached_bytes, ref_lp.cached_bytes),
        reward_transient_bytes=reward_transient, critic_train_extra_bytes=critic_extra,
        sync_gather_bytes=sync_gather_bytes(job, rules, config, lp.parameters_bytes, shards), engine=None)
    if job.rollout == "hf" and job.algo != "dpo":
        gathered = generation_gather_bytes(job, lp.parameters_bytes, shards, zero3_block)
        rollout = rollout_figures(config, job.setup, hf_generation(job), device=job.device, profile=profile,
                                  gpu=job.gpu, gather_bytes=gathered)
        figures.generation_transient_bytes = rollout.transient_bytes
        figures.generation_cached_bytes = rollout.cached_bytes
        figures.generation_gather_bytes = rollout.gather_bytes
    engine = _engine(job, rules, figures) if job.rollout == "vllm-colocate" else None
    figures.engine = engine
    return figures, train.to_json(), engine


def hf_generation(job: RLJob) -> TrainerGeneration:
    """TRL's generate() call on one rank: the generation batch's `batch x steps per
    generation` rows, P prompt tokens, C new tokens, the job's generation settings."""
    settings = {k: v for k, v in job.generation.items() if k != "ds3_gather_for_generation"}
    return trainer_generation(job.setup.batch * job.setup.grad_accum, job.prompt_len, job.completion_len, settings)


def generation_gather_bytes(job: RLJob, full_bytes: int, shards: int, block_bytes: int) -> int:
    """Full parameters the transformers rollout holds beyond the rank's shards: under ZeRO-3,
    the whole model with `ds3_gather_for_generation` (TRL's default) unless the sharding is
    FSDP's (TRL gathers only DeepSpeed's), else one gathered block as the forward reaches it;
    nothing without ZeRO-3."""
    if job.layout.zero != 3:
        return 0
    gather = job.generation.get("ds3_gather_for_generation", TRL_GENERATION_DEFAULTS["ds3_gather_for_generation"])
    if gather and job.layout.engine not in ("fsdp1", "fsdp2"):
        return full_bytes - full_bytes // shards
    return block_bytes


_TRAIN: dict[str, Estimate] = {}


def train_estimate(config: Any, setup: TrainingSetup, layout: Layout, device: str, gpu: str) -> Estimate:
    """`memplan.estimate` of a training step, once per inputs (what-fits re-assembles the
    phases of many jobs that share it)."""
    key = json.dumps([config.to_dict(), setup.to_dict(), layout.to_dict(), device, gpu], sort_keys=True, default=str)
    if key not in _TRAIN:
        _TRAIN[key] = estimate(config, setup, layout, device, "caching" if device == "cuda" else "none", gpu=gpu)
    return _TRAIN[key]


def sync_gather_bytes(job: RLJob, rules: TrainerRules, config: Any, full_bytes: int, shards: int) -> int:
    """Full parameters the weight sync holds at once beyond the rank's shards: nothing
    without ZeRO-3 (the parameters are whole), the largest parameter under ZeRO-3, the
    whole model for a PEFT model under ZeRO-3 in TRL."""
    if job.layout.zero != 3:
        return 0
    if job.setup.lora_rank > 0 and rules.peft_zero3_whole_gather:
        return full_bytes - full_bytes // shards
    element = TORCH_DTYPES[job.setup.dtype].itemsize
    largest = max((_numel(shape) for _, shape in meta_parameters(config)), default=0)
    return largest * element


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for s in shape:
        out *= int(s)
    return out


def _critic(job: RLJob, rules: TrainerRules, profile: Any, shards: int) -> tuple[int, int, dict[str, int]]:
    """(resident bytes, training-step bytes above them, CUDA contexts) of PPO's value model:
    its step traced as a one-output sequence-regression head over `P + C` tokens."""
    contexts: dict[str, int] = {}
    if job.critic is None:
        return 0, 0, contexts
    setup = replace(job.setup, seq=job.prompt_len + job.completion_len, allow_long_seq=True, head="seq-cls",
                    num_labels=1, loss="full")
    result = train_estimate(load_config(job.critic), setup, job.layout, job.device, job.gpu)
    rank = max(result.per_rank, key=lambda r: r.device_used_bytes)
    params = model_parameters(load_config(job.critic)) * TORCH_DTYPES[job.setup.dtype].itemsize // shards
    resident = params + rank.breakdown["optimizer_state"]
    if "critic" in rules.separate_processes and job.device == "cuda":
        contexts["critic"] = profile.context_bytes()
    return resident, max(rank.peak_reserved_bytes - resident, 0), contexts


def _reward(job: RLJob, profile: Any, shards: int) -> tuple[int, int]:
    """(resident bytes, pass transient) of a reward model scoring `P + C` tokens."""
    if job.reward_model is None:
        return 0, 0
    setup = replace(job.setup, seq=job.prompt_len + job.completion_len, allow_long_seq=True, head="seq-cls",
                    num_labels=1, loss="full", lora_rank=0, lora_alpha=None, lora_targets=None, dora=False,
                    grad_accum=1)
    figures = no_grad_pass(load_config(job.reward_model), setup, job.device, profile)
    return figures.parameters_bytes // shards, figures.transient_bytes


def engine_flags(job: RLJob, rules: TrainerRules) -> dict[str, Any]:
    """The vLLM flags the trainer starts its engine with, the user's winning."""
    flags = dict(job.engine)
    tp = int(flags.pop("tp", 1) or 1)
    if rules.max_num_seqs_per_row:
        flags.setdefault("max_num_seqs", job.setup.batch * job.setup.grad_accum * tp)
    elif rules.max_num_seqs is not None:
        flags.setdefault("max_num_seqs", rules.max_num_seqs)
    if rules.max_num_batched_tokens is not None:
        flags.setdefault("max_num_batched_tokens", rules.max_num_batched_tokens)
    if flags.get("gpu_memory_utilization") is None:
        flags["gpu_memory_utilization"] = rules.default_utilization
    return {"tp": tp, **{k: v for k, v in flags.items() if v is not None}}


def _engine(job: RLJob, rules: TrainerRules, f: StepFigures) -> EngineFigures:
    """The colocated engine, started while the trainer holds its parameters (no optimizer
    state yet)."""
    at_start = f.policy_bytes + f.reference_bytes + f.reward_bytes + f.critic_bytes \
        + sum(f.extra_contexts.values())
    flags = engine_flags(job, rules)
    serving = estimate_serving(job.model, "vllm", job.gpu, dtype=_engine_dtype(job.setup), entry="llm",
                               resident_bytes=at_start, **flags)
    return EngineFigures(
        weights_bytes=serving.weights.total_bytes, kv_bytes=int(serving.kv["bytes"]),
        activation_bytes=serving.activation.total_bytes, graphs_bytes=int(serving.graphs["pool_bytes"]),
        non_torch_bytes=serving.non_torch_rise_bytes, nccl_bytes=int(serving.outside_budget_bytes["nccl_bytes"]),
        refusal=serving.refusal, serving=serving.to_json())


def _engine_dtype(setup: TrainingSetup) -> str:
    """The engine's weights dtype: the policy's 16-bit dtype (TRL and verl load the engine
    in the training dtype), bf16 for an fp32 policy trained under bf16 autocast."""
    if setup.dtype == "fp16" or setup.autocast == "fp16":
        return "float16"
    return "bfloat16"


def settings(job: RLJob, rules: TrainerRules) -> dict[str, Any]:
    return {
        "trainer_version": rules.version, "prompt_len": job.prompt_len, "completion_len": job.completion_len,
        "num_generations": job.num_generations, "micro_batch": job.setup.batch,
        "steps_per_generation": job.setup.grad_accum, "setup": job.setup.to_dict(), "layout": job.layout.to_dict(),
        "sleep_level": resolved_sleep(job, rules), "reference": resolved_reference(job, rules),
        "beta": resolved_beta(job, rules), "critic": job.critic, "reward_model": job.reward_model,
        "engine": engine_flags(job, rules) if job.rollout != "hf" else None,
        "generation": hf_generation(job).to_dict() if job.rollout == "hf" and job.algo != "dpo" else None,
        "empty_cache_before_wake": rules.empty_cache_before_wake, "offload_between_phases": list(job.offload),
        "reference_on_host": resolved_reference(job, rules) == "copy" and rules.reference_on_host,
    }


def assumptions(job: RLJob, rules: TrainerRules) -> list[str]:
    scorer = {"trl": "TRL's fused chunked head (trl/kernels/chunked_logprob.py)",
              "verl": "verl's full logits (verl/workers/actor/dp_actor.py, verl/utils/torch_functional.py)",
              "openrlhf": "TRL's fused chunked head: OpenRLHF's own log-prob code is not reproduced"}[rules.name]
    out = [f"{rules.name} {rules.version}'s placement and phase order (docs/rl.md)",
           f"log-probabilities scored by {scorer}; every completion at its full length, no padding",
           "the optimizer state exists from the second step on: the engine starts without it"]
    if job.rollout == "hf" and job.algo != "dpo":
        out.append(f"rollout: one generate() call of {job.setup.batch * job.setup.grad_accum} rows on the policy, "
                   f"traced as memplan generate traces it: exactly {job.completion_len} new tokens per row "
                   "(min_new_tokens = max_new_tokens), sampling with the trainer's processors, the model in eval "
                   "mode (TRL's is in train mode: the same for a model without dropout)")
    if job.layout.zero == 3:
        out.append("ZeRO-3 log-prob passes hold one gathered block beyond the shards (no prefetch bucket)")
    if job.critic is not None:
        out.append("the critic's value head traced as a one-output sequence-regression head")
    if resolved_reference(job, rules) == "copy" and rules.reference_on_host:
        out.append(f"the reference on the host ({rules.name}: FSDP's CPU offload), one block gathered at a time")
    if "params" in job.offload:
        out.append(f"the policy's parameters on the host between phases ({rules.offload_flags}): on the GPU for the "
                   "weight sync, the log-prob passes and the update")
    if "optimizer" in job.offload:
        out.append(f"the policy's optimizer state on the host between phases ({rules.offload_flags}): on the GPU "
                   "for the update only")
    return out
