"""What each RL trainer puts on a GPU, and in which order: its placement rules.

One `TrainerRules` per trainer, each fact read in the trainer's code (docs/rl.md cites the
file and lines of each):

- every trainer's policy by default: fp32 weights trained under bf16 autocast with
  gradient checkpointing (TRL's `bf16=True` and `gradient_checkpointing=True` defaults
  over a model loaded in float32, `create_model_from_path`; verl's FSDP mixed precision
  and `enable_gradient_checkpointing`), `setup_defaults`, applied by the CLI where no
  flag says otherwise;
- **TRL 1.16.0** (`trl/trainer/grpo_trainer.py`, `trl/trainer/grpo_config.py`,
  `trl/generation/vllm_generation.py`, `trl/trainer/dpo_trainer.py`): the colocated vLLM
  engine runs in the trainer's process (`distributed_executor_backend="external_launcher"`)
  with `max_num_seqs = per_device_train_batch_size x vllm_tensor_parallel_size x
  steps_per_generation` and `max_num_batched_tokens=4096`; `vllm_gpu_memory_utilization`
  0.3; sleep mode off by default, and when on, level 2 right after start-up,
  `empty_cache()` then `wake_up(tags=["weights"])` before the weight sync,
  `wake_up(tags=["kv_cache"])` before generating, `sleep(level=2)` after; the weights are
  pushed one parameter at a time (gathered one at a time under ZeRO-3), or, for a PEFT
  model under ZeRO-3, gathered all at once and merged; no reference model at `beta=0`
  (the default) nor for PEFT (the adapter is disabled instead); the old policy's
  log-probabilities are computed with vLLM (importance-sampling correction, on by
  default) or when generation and optimisation steps are misaligned. No PPO trainer.
- **verl** (`volcengine/verl` at b178a3c): the hybrid engine colocates actor, rollout and
  reference in one process per GPU; the rollout's `gpu_memory_utilization` 0.5,
  `free_cache_engine: True`, `max_num_batched_tokens` 8192, `max_num_seqs` 256
  (`verl/trainer/config/rollout/rollout.yaml` L32, L47, L62, L68); sleep level 2 from
  vLLM 0.8.5 (`verl/third_party/vllm/__init__.py` L33-49); the reference is wrapped with
  FSDP's own CPU offload (`verl/workers/fsdp_workers.py` L526, L552: `CPUOffload(
  offload_params=True)` for every role but the actor), so it lives on the host and each
  FSDP unit comes to the GPU as its forward reaches it; `param_offload` and
  `optimizer_offload` (`fsdp_workers.py` L230-234, default false in
  `verl/trainer/config/engine/fsdp.yaml` L12-17) keep the actor's parameters and optimizer
  state on the host between phases: the parameters are loaded for the log-probability
  passes and the update and offloaded after each (L989-1035, L893-933), the optimizer
  state only for the update (L895-898, L931-933), both offloaded at start-up before the
  engine is built (L811-826); in `rollout_mode` (L677-756) the state dict is taken before
  the parameters are offloaded, so the shards stay on the GPU until the weight sync ends
  (`del params`, L749); `offload_fsdp_model_to_cpu` empties PyTorch's cache
  (`verl/utils/fsdp_utils.py` L144-173); `rollout_mode`
  (`verl/workers/fsdp_workers.py` L677-756) empties PyTorch's cache
  (`aggressive_empty_cache`) before waking the weights, streams each FSDP parameter as one
  full tensor, empties it again and wakes the KV cache; a critic or a reward model runs in
  a worker process of its own (its own CUDA context) on the same GPUs; a reference only
  with `use_kl_loss` (default false, `verl/trainer/config/actor/actor.yaml` L95), whose
  `kl_loss_coef` (0.001, L105) memplan reads as the KL coefficient.
- **OpenRLHF** (`OpenRLHF/OpenRLHF` at 3c3be62, `openrlhf/cli/train_ppo_ray.py`): with
  `--train.colocate_all` (L222-227) the vLLM engines share the GPUs, each in a process of
  its own (a CUDA context); `--vllm.gpu_memory_utilization` 0.95 by default (L251-255,
  meant for dedicated GPUs); `--vllm.enable_sleep` (L245-249) sleeps at level 1
  (`openrlhf/trainer/ray/vllm_engine.py` L138-139: `sleep(level=1)`); the weight broadcast
  wakes the weights without emptying the actor's PyTorch cache
  (`openrlhf/trainer/ppo_trainer.py` L300-319); actor, reference, critic and reward are
  separate Ray actors (processes); `--algo.kl.init_coef` 0.01 (L419) loads a reference;
  the actor is DeepSpeed's (`--ds.zero_stage` 2, `--ds.param_dtype` bf16, gradient
  checkpointing off: L308-315); `--ds.enable_sleep` (L348-352) moves DeepSpeed's optimizer
  states, fp32 master weights and gradient buffers to the host right after the actor is
  built and after every update, and back only for the update
  (`openrlhf/utils/deepspeed/deepspeed_utils.py` L151-209 `offload_deepspeed_states` /
  `reload_deepspeed_states`, each followed by `empty_cache()`; `ppo_trainer.py` L274-287,
  `ppo_actor.py` L580-581): the bf16 parameters stay.
"""

from __future__ import annotations

from dataclasses import dataclass

from memplan.errors import UserError

TRAINERS = ("trl", "verl", "openrlhf")
OFFLOADS = ("params", "optimizer")  # what a trainer can keep on the host between phases
ALGOS = ("grpo", "ppo", "dpo", "rloo")
ROLLOUTS = ("hf", "vllm-colocate", "vllm-server")
REFERENCES = ("none", "copy", "peft")


@dataclass(frozen=True)
class TrainerRules:
    """One trainer's placement and phase order (module docstring)."""

    name: str
    version: str
    algos: tuple[str, ...]
    rollouts: tuple[str, ...]
    default_utilization: float
    default_sleep_level: int  # 0: sleep mode off
    sleep_level_when_on: int
    empty_cache_before_wake: bool
    max_num_batched_tokens: int | None  # what the trainer passes to vLLM (None: vLLM's default)
    max_num_seqs_per_row: bool  # TRL: max_num_seqs = rows the rank generates x engine tp
    max_num_seqs: int | None  # what the trainer passes otherwise (None: vLLM's default)
    default_beta: float
    separate_processes: tuple[str, ...]  # models that live in a process of their own on the same GPU
    peft_zero3_whole_gather: bool  # PEFT + ZeRO-3 gathers the whole model to merge the adapter
    offloads: tuple[str, ...] = ()  # what it can keep on the host between phases (OFFLOADS)
    offload_flags: str = ""  # how the trainer spells them
    offload_empties_cache: tuple[str, ...] = ()  # offloads whose move to the host ends with empty_cache()
    reference_on_host: bool = False  # the reference lives on the host, brought in unit by unit
    engine_for_zero: str | None = None  # who shards the policy under ZeRO (None: memplan's default)
    setup_defaults: tuple[tuple[str, object], ...] = (("precision", "bf16-mixed"),
                                                      ("checkpointing", "full"))

    def check_offload(self, offload: tuple[str, ...]) -> None:
        """`UserError` for an offload between phases this trainer does not have."""
        missing = [o for o in offload if o not in self.offloads]
        if missing:
            has = f"keeps only {', '.join(self.offloads)} on the host ({self.offload_flags})" if self.offloads \
                else "offloads nothing between phases"
            raise UserError(f"--offload-between-phases {','.join(missing)}: {self.name} {self.version} {has}")

    def check(self, algo: str, rollout: str, sleep_level: int | None, reference: str, critic: str | None) -> None:
        """`UserError` for a setting this trainer does not have (one line, with the fix)."""
        if algo not in self.algos:
            raise UserError(f"--algo {algo}: {self.name} {self.version} trains {', '.join(self.algos)}")
        if algo != "dpo" and rollout not in self.rollouts:
            raise UserError(f"--rollout {rollout}: {self.name} generates with {', '.join(self.rollouts)}")
        if sleep_level is not None and rollout != "vllm-colocate":
            raise UserError(f"--sleep-level applies to a colocated vLLM engine; --rollout {rollout} has none: "
                            "leave --sleep-level out or use --rollout vllm-colocate")
        if sleep_level not in (None, 0, self.sleep_level_when_on):
            raise UserError(f"--sleep-level {sleep_level}: {self.name} sleeps its engine at level "
                            f"{self.sleep_level_when_on} (0: sleep mode off)")
        if algo == "dpo" and rollout != "hf":
            raise UserError("--algo dpo trains on a fixed preference data set and generates nothing: leave --rollout "
                            "out (or give hf)")
        if critic is not None and algo != "ppo":
            raise UserError(f"--critic is PPO's value model; --algo {algo} has none")
        if algo == "ppo" and critic is None:
            raise UserError("--algo ppo trains a value model: give it with --critic MODEL (often the policy's model)")


RULES = {
    "trl": TrainerRules(
        name="trl", version="1.16.0", algos=("grpo", "dpo", "rloo"), rollouts=ROLLOUTS, default_utilization=0.3,
        default_sleep_level=0, sleep_level_when_on=2, empty_cache_before_wake=True, max_num_batched_tokens=4096,
        max_num_seqs_per_row=True, max_num_seqs=None, default_beta=0.0, separate_processes=(), peft_zero3_whole_gather=True),
    "verl": TrainerRules(
        name="verl", version="main@b178a3c", algos=("grpo", "ppo", "rloo"), rollouts=("vllm-colocate",),
        default_utilization=0.5, default_sleep_level=2, sleep_level_when_on=2, empty_cache_before_wake=True,
        max_num_batched_tokens=8192, max_num_seqs_per_row=False, max_num_seqs=256, default_beta=0.0,
        separate_processes=("critic", "reward"), peft_zero3_whole_gather=False, offloads=OFFLOADS,
        offload_flags="fsdp_config.param_offload, fsdp_config.optimizer_offload", offload_empties_cache=("params",),
        reference_on_host=True),
    "openrlhf": TrainerRules(
        name="openrlhf", version="main@3c3be62", algos=("grpo", "ppo", "rloo", "dpo"),
        rollouts=("vllm-colocate", "vllm-server"), default_utilization=0.95, default_sleep_level=0,
        sleep_level_when_on=1, empty_cache_before_wake=False, max_num_batched_tokens=None,
        max_num_seqs_per_row=False, max_num_seqs=None, default_beta=0.01,
        separate_processes=("reference", "critic", "reward", "engine"), peft_zero3_whole_gather=False,
        offloads=("optimizer",), offload_flags="--ds.enable_sleep", offload_empties_cache=("optimizer",),
        engine_for_zero="deepspeed",
        setup_defaults=(("precision", "bf16-true"), ("checkpointing", "none"))),
}


def trainer_rules(name: str) -> TrainerRules:
    if name not in RULES:
        raise UserError(f"--trainer {name!r}: one of {', '.join(TRAINERS)}")
    return RULES[name]
