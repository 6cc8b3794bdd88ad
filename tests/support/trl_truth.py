"""Real TRL GRPOTrainer and DPOTrainer steps on a tiny model on CPU, each phase measured by
torch.profiler (`memplan.capture.groundtruth`): the ground truth of `memplan rl --device cpu`.

The model is the tiny random version of a registry model (`tiny_config`), its tokenizer a
word-level one built in memory (no download): each prompt is P words and so P tokens, and
generation runs C new tokens (`min_new_tokens`), so every row has P + C tokens as memplan
assumes. A phase is measured from its first call to its last, with every tensor alive
before it given to the profiler (`carried`): the rollout (`_generate_single_turn`: the
transformers `generate`), the reference log-probability pass
(`_get_per_token_logps_and_entropies` without gradients) and the training step (from
`compute_loss` to the end of `optimizer.step`), both in the last step of the run (the
optimizer state exists).
"""

from __future__ import annotations

import contextlib
import tempfile
from typing import Any

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from torch.optim.optimizer import register_optimizer_step_post_hook
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from memplan.capture.groundtruth import memory_profiler, timeline_peak_bytes

WORDS = 500


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"[PAD]": 0, "[EOS]": 1, **{f"w{i}": i + 2 for i in range(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[PAD]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", eos_token="[EOS]")


def prompts(n: int, length: int) -> list[str]:
    return [" ".join(f"w{(i * 7 + j) % WORDS}" for j in range(length)) for i in range(n)]


def completions(n: int, length: int) -> list[str]:
    """DPO's completions: a space first (TRL tokenizes prompt + completion as one string, so
    the two words must not merge), `length - 1` words, then the end-of-sequence token as a
    word of its own (TRL appends it where it is missing): `length` tokens."""
    return [" " + " ".join(f"w{(i * 3 + j) % WORDS}" for j in range(length - 1)) + " [EOS]" for i in range(n)]


def _alive(trainer: Any) -> list[torch.Tensor]:
    out = [p for p in trainer.model.parameters()] + [b for b in trainer.model.buffers()]
    if getattr(trainer, "ref_model", None) is not None:
        out += list(trainer.ref_model.parameters()) + list(trainer.ref_model.buffers())
    out += [p.grad for p in trainer.model.parameters() if p.grad is not None]
    if trainer.optimizer is not None:
        for state in trainer.optimizer.state.values():
            out += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return out


class PhaseMeter:
    """Starts and stops the profiler around phases; the peak of each, last occurrence kept."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.peaks: dict[str, int] = {}
        self.prof: Any = None
        self.inputs: list[torch.Tensor] = []

    def start(self, extra: Any = ()) -> None:
        self.prof = memory_profiler()
        self.prof.start()
        for t in _alive(self.trainer) + [t for t in extra if isinstance(t, torch.Tensor)]:
            t.view_as(t)

    def stop(self, name: str) -> None:
        self.prof.stop()
        self.peaks[name] = timeline_peak_bytes(self.prof, "cpu")
        self.prof = None


def _instrument(trainer: Any, meter: PhaseMeter, *, logprobs: bool) -> None:
    if logprobs:
        original = trainer._get_per_token_logps_and_entropies

        def scored(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, *args: Any, **kw: Any) -> Any:
            if torch.is_grad_enabled():
                return original(model, input_ids, attention_mask, *args, **kw)
            meter.start([input_ids, attention_mask])
            try:
                return original(model, input_ids, attention_mask, *args, **kw)
            finally:
                meter.stop("reference log-probs" if model is trainer.ref_model else "policy log-probs")

        trainer._get_per_token_logps_and_entropies = scored
    if hasattr(trainer, "_generate_single_turn"):
        generate = trainer._generate_single_turn

        def generated(*args: Any, **kw: Any) -> Any:
            meter.start()
            try:
                return generate(*args, **kw)
            finally:
                meter.stop("rollout")

        trainer._generate_single_turn = generated
    loss = trainer.compute_loss

    def compute_loss(model: Any, inputs: Any, *args: Any, **kw: Any) -> Any:
        meter.start([v for v in inputs.values() if isinstance(v, torch.Tensor)])
        return loss(model, inputs, *args, **kw)

    trainer.compute_loss = compute_loss



@contextlib.contextmanager
def _optimizer_hook(meter: PhaseMeter) -> Any:
    def after_step(optimizer: Any, *_: Any) -> None:
        if meter.prof is not None:
            meter.stop("training step")

    handle = register_optimizer_step_post_hook(after_step)
    try:
        yield
    finally:
        handle.remove()


def tiny_model(config: Any, directory: str) -> str:
    """The tiny random model saved to `directory` (TRL loads its policy and its reference
    from a path), as its path."""
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    return directory


def grpo_phases(config: Any, *, prompt_len: int, completion_len: int, batch: int, generations: int,
                beta: float, steps: int = 2) -> dict[str, int]:
    """Peak bytes of each phase of the last of `steps` GRPO steps (HF rollout)."""
    from trl import GRPOConfig, GRPOTrainer

    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(output_dir=out, per_device_train_batch_size=batch, num_generations=generations,
                          max_completion_length=completion_len, beta=beta, max_steps=steps, bf16=False,
                          gradient_checkpointing=False, logging_steps=1000, save_strategy="no", report_to=[],
                          use_cpu=True, generation_kwargs={"min_new_tokens": completion_len}, seed=0,
                          dataloader_num_workers=0, disable_tqdm=True)
        data = Dataset.from_dict({"prompt": prompts(8 * batch, prompt_len)})
        trainer = GRPOTrainer(model=tiny_model(config, f"{out}/model"), reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                              args=args, train_dataset=data, processing_class=tokenizer())
        meter = PhaseMeter(trainer)
        _instrument(trainer, meter, logprobs=True)
        with _optimizer_hook(meter):
            trainer.train()
    return meter.peaks


def dpo_phases(config: Any, *, prompt_len: int, completion_len: int, batch: int, steps: int = 2) -> dict[str, int]:
    """Peak bytes of the last of `steps` DPO training steps (reference scored inside the step)."""
    from trl import DPOConfig, DPOTrainer

    with tempfile.TemporaryDirectory() as out:
        args = DPOConfig(output_dir=out, per_device_train_batch_size=batch, max_steps=steps, bf16=False,
                         gradient_checkpointing=False, logging_steps=1000, save_strategy="no", report_to=[],
                         use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True, max_length=None)
        n = 8 * batch
        data = Dataset.from_dict({"prompt": prompts(n, prompt_len), "chosen": completions(n, completion_len),
                                  "rejected": completions(n, completion_len)})
        trainer = DPOTrainer(model=tiny_model(config, f"{out}/model"), args=args, train_dataset=data,
                             processing_class=tokenizer())
        meter = PhaseMeter(trainer)
        _instrument(trainer, meter, logprobs=False)
        with _optimizer_hook(meter):
            trainer.train()
    return meter.peaks
