"""The transformers rollout of an RL step (`--rollout hf`): TRL's GRPOTrainer generating with
`model.generate` on the policy itself, sized by `memplan generate` (`estimate_generation`).

What TRL 1.16.0 runs (`trl/trainer/grpo_trainer.py`, `_generate_single_turn` L1763-1890, the
regular generation path L1815-1875):

- one `generate()` call per generation batch on each rank: the rank's
  `per_device_train_batch_size x steps_per_generation` rows (the sampler repeats each prompt
  `num_generations` times into them, L1253-1275), left-padded to the longest prompt;
- with the trainer's `GenerationConfig` (L1154-1175): `do_sample=True`, `temperature`,
  `top_p`, `top_k`, `min_p`, `repetition_penalty`, `cache_implementation`, and
  `generation_kwargs` over them; `max_new_tokens = max_completion_length`;
- under `torch.no_grad()`, on the model `unwrap_model_for_generation` yields
  (`trl/models/utils.py` L202-243, `_unwrap_model_for_generation` L105-155): gradient
  checkpointing switched off, and under DeepSpeed ZeRO-3 with `ds3_gather_for_generation`
  (default True, `grpo_config.py` L498-506) every parameter gathered at once
  (`deepspeed.zero.GatheredParameters(model.parameters())`); without that gather, and under
  FSDP2 (`DistributedBackend.summon_full_params` is a no-op for it, `trl/distributed.py`
  L74-90), the sharded modules gather their own parameters as each forward reaches them;
- the model is the one accelerate prepared: under native mixed precision (`bf16=True`, TRL's
  default) its forward runs under autocast with fp32 outputs (`memplan.inference.gen_capture.
  autocast_forward`); the trainer's policy dtype and autocast are the setup's.

The call is traced as `memplan generate` traces one (`memplan.inference.generate`): the
fixed-shape rule applies, every prompt P tokens and exactly C new tokens per row (what
`min_new_tokens = max_new_tokens = C` makes; the CPU ground truth passes it). The rollout's
figures are what the call adds above the policy's weights (`RolloutFigures`); the phase model
(`memplan.rl.phases`) puts them on top of the trainer's residents.

Assumes the model traced in eval mode: TRL generates inside `Trainer.training_step`, after
`model.train()`, which is the same computation for a model without dropout (Qwen2, Llama:
`attention_dropout` 0) but not for one with dropout or with LoRA dropout (the adapter's
own matmuls are not traced here: the base model generates).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memplan.errors import UserError
from memplan.hardware.devices import DeviceProfile
from memplan.inference import estimate_generation
from memplan.inference.gen_capture import CACHE_IMPLEMENTATIONS, GenerationSetup
from memplan.models.setup import TrainingSetup

# TRL 1.16.0 GRPOConfig's generation defaults (grpo_config.py L532-584)
TRL_GENERATION_DEFAULTS: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": None,
                                           "repetition_penalty": 1.0, "cache_implementation": None,
                                           "ds3_gather_for_generation": True}
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass
class TrainerGeneration(GenerationSetup):
    """One `generate()` call as an RL trainer makes it: `GenerationSetup`'s fixed shape, and
    multinomial sampling of one sequence per row with the trainer's logits processors
    (transformers adds each only where its value changes the scores:
    `generation/utils.py` L1597-1640)."""

    do_sample: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float | None = None
    repetition_penalty: float = 1.0

    def generate_kwargs(self) -> dict[str, Any]:
        kwargs = super().generate_kwargs()
        kwargs.update(do_sample=self.do_sample, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                      min_p=self.min_p, repetition_penalty=self.repetition_penalty)
        return kwargs


@dataclass(frozen=True)
class RolloutFigures:
    """A transformers rollout above the policy's resident weights, bytes per GPU."""

    transient_bytes: int  # what generate() allocates above the full weights at its peak
    cached_bytes: int  # what the caching allocator keeps reserved above that peak
    gather_bytes: int  # full parameters gathered beyond the rank's shards while it generates
    peak_phase: str  # prefill or decode step i
    generation: dict[str, Any]


def cache_of(implementation: str | None) -> str:
    """memplan generate's `--cache` for transformers' `cache_implementation` (None: dynamic)."""
    if implementation is None:
        return "dynamic"
    names = {impl: cache for cache, (impl, config) in CACHE_IMPLEMENTATIONS.items() if config is None}
    if implementation not in names:
        raise UserError(f"cache_implementation={implementation!r}: memplan rl traces "
                        f"{', '.join(repr(n) for n in names)} (None: dynamic)")
    return names[implementation]


def trainer_generation(rows: int, prompt_len: int, completion_len: int, settings: dict[str, Any]) -> TrainerGeneration:
    """The call TRL makes for `rows` rows with the job's generation `settings`
    (`TRL_GENERATION_DEFAULTS` where it gives none)."""
    values = {**TRL_GENERATION_DEFAULTS, **settings}
    unknown = set(values) - set(TRL_GENERATION_DEFAULTS)
    if unknown:
        raise UserError(f"generation settings {', '.join(sorted(unknown))}: memplan rl reads "
                        f"{', '.join(TRL_GENERATION_DEFAULTS)}")
    return TrainerGeneration(batch=rows, input_len=prompt_len, new_tokens=completion_len,
                             cache=cache_of(values["cache_implementation"]),
                             **{k: values[k] for k in SAMPLING_KEYS})


def rollout_figures(config: Any, setup: TrainingSetup, generation: TrainerGeneration, *, device: str,
                    profile: DeviceProfile | None, gpu: str | None, gather_bytes: int) -> RolloutFigures:
    """The generate() call of `generation` on the policy (the model fields of `setup`: dtype,
    attention, quantised base, autocast; `memplan.inference.gen_capture.model_setup`), traced by `estimate_generation` on `device` with the allocator that device
    has (PyTorch's caching allocator on CUDA, tensor bytes on cpu)."""
    cuda = device == "cuda"
    result = estimate_generation(config, generation, setup, device=device, allocator="caching" if cuda else "none",
                                 gpu=gpu if cuda and profile is not None else None)
    weights = result.breakdown["weights"]
    return RolloutFigures(transient_bytes=max(result.peak_allocated_bytes - weights, 0),
                          cached_bytes=max(result.peak_reserved_bytes - result.peak_allocated_bytes, 0),
                          gather_bytes=gather_bytes, peak_phase=result.peak_phase,
                          generation=generation.to_dict())
