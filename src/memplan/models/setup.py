"""The training setup: everything about a training step except the model itself.

One dataclass, `TrainingSetup`, and the command-line flags that fill it (the same flags on
every subcommand that takes a model). Defaults are what PyTorch and Hugging Face do when
the user says nothing:

- `batch=1` sequences per micro-batch, `grad_accum=1` micro-batch per optimizer step;
- `seq=None`: the model's maximum positions, capped at 1024 (GPT-2's context; a
  realistic fine-tuning length that does not blow up memory on long-context models);
- `dtype="fp32"` parameters (PyTorch's default dtype), `autocast="none"`;
- `optimizer="adamw"` (HF Trainer's default); `optimizer_impl=None` resolves like
  PyTorch's `_default_to_fused_or_foreach`: "foreach" when the parameters live on CUDA,
  the per-parameter "loop" otherwise;
- `checkpointing="none"`, `lora_rank=0`, `attn="sdpa"` (HF's default where available);
  checkpointing "full" recomputes every block, "selective" the attention modules,
  "selective-op" is torchtitan's op-level policy (every block; saves the outputs of the
  attention kernels and of every other matmul, recomputes the rest);
- `head="lm"`: the model's language-model head and loss (causal or masked LM). `head="seq-cls"`
  is what an HF Trainer classification fine-tune builds: `AutoModelForSequenceClassification`
  with `num_labels` classes (HF's default 2), integer class labels and cross-entropy
  (one label: regression, float targets and mean-squared error, as HF infers `problem_type`);
- `zero_grad="none"`: `optimizer.zero_grad()` frees the gradients (`set_to_none=True`,
  PyTorch's default since 2.0); `"zeros"` keeps them allocated and zeroed between steps
  (`set_to_none=False`, the default of PyTorch 1.x and of training loops written for it).
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, fields
from typing import Any

from memplan.errors import UserError

DTYPES = ("fp32", "bf16", "fp16")
AUTOCASTS = ("none", "bf16", "fp16")
OPTIMIZERS = ("adamw", "adam", "sgd", "adafactor")
OPTIMIZER_IMPLS = ("foreach", "fused", "loop")
CHECKPOINTINGS = ("none", "full", "selective", "selective-op")
ZERO_GRADS = ("none", "zeros")
ATTENTIONS = ("eager", "sdpa", "flash")
HEADS = ("lm", "seq-cls")

DEFAULT_MAX_SEQ = 1024


@dataclass
class TrainingSetup:
    """How one training step runs. See the module docstring for the defaults.

    `batch` is the micro-batch (sequences per forward); one optimizer step runs
    `grad_accum` micro-batches. `allow_long_seq` permits `seq` beyond the model's
    maximum positions (for models whose position encoding extrapolates, e.g. RoPE).
    `lora_targets` overrides the family's default LoRA target modules. `seed` makes
    real-tensor weights and batches deterministic. `head` picks the task head (see the
    module docstring); `num_labels` is the classifier's width for `head="seq-cls"`.
    """

    batch: int = 1
    seq: int | None = None
    dtype: str = "fp32"
    autocast: str = "none"
    optimizer: str = "adamw"
    optimizer_impl: str | None = None
    checkpointing: str = "none"
    lora_rank: int = 0
    grad_accum: int = 1
    attn: str = "sdpa"
    allow_long_seq: bool = False
    lora_targets: tuple[str, ...] | None = None
    seed: int = 0
    head: str = "lm"
    num_labels: int = 2
    zero_grad: str = "none"

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise `UserError` for a field that no training step can have."""
        for name, value, allowed in (
            ("dtype", self.dtype, DTYPES),
            ("autocast", self.autocast, AUTOCASTS),
            ("optimizer", self.optimizer, OPTIMIZERS),
            ("checkpointing", self.checkpointing, CHECKPOINTINGS),
            ("attn", self.attn, ATTENTIONS),
            ("head", self.head, HEADS),
            ("zero_grad", self.zero_grad, ZERO_GRADS),
        ):
            if value not in allowed:
                raise UserError(f"{name} must be one of {', '.join(allowed)}, not '{value}'")
        if self.optimizer_impl is not None and self.optimizer_impl not in OPTIMIZER_IMPLS:
            raise UserError(f"optimizer_impl must be one of {', '.join(OPTIMIZER_IMPLS)}, not '{self.optimizer_impl}'")
        for name in ("batch", "grad_accum"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise UserError(f"{name} must be a whole number >= 1, not {value!r}")
        if self.seq is not None and (not isinstance(self.seq, int) or self.seq < 1):
            raise UserError(f"seq must be a whole number >= 1, not {self.seq!r}")
        if isinstance(self.num_labels, bool) or not isinstance(self.num_labels, int) or self.num_labels < 1:
            raise UserError(f"num_labels must be a whole number >= 1, not {self.num_labels!r}")
        if not isinstance(self.lora_rank, int) or self.lora_rank < 0:
            raise UserError(f"lora_rank must be a whole number >= 0, not {self.lora_rank!r}")
        if self.optimizer_impl == "fused" and self.optimizer == "adafactor":
            raise UserError("torch.optim.Adafactor has no fused implementation: use --optimizer-impl foreach or loop")
        if self.lora_targets is not None:
            self.lora_targets = tuple(self.lora_targets)

    def resolved_optimizer_impl(self, device: str) -> str:
        """The optimizer implementation PyTorch would pick for parameters on `device`."""
        if self.optimizer_impl is not None:
            return self.optimizer_impl
        return "foreach" if str(device).startswith("cuda") else "loop"

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able fields, for trace metadata."""
        data = asdict(self)
        if data["lora_targets"] is not None:
            data["lora_targets"] = list(data["lora_targets"])
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainingSetup:
        """Inverse of `to_dict`; unknown keys are an error (a typo should not pass silently)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise UserError(f"unknown training setup field(s): {', '.join(unknown)}")
        return cls(**data)


def add_setup_flags(parser: argparse.ArgumentParser) -> None:
    """Add the training-setup flags shared by every subcommand that takes a model."""
    group = parser.add_argument_group("training setup")
    group.add_argument("--batch", type=int, default=1, metavar="N", help="sequences per micro-batch (default 1)")
    group.add_argument("--seq", type=int, default=None, metavar="N",
                       help=f"sequence length (default: the model's max positions, at most {DEFAULT_MAX_SEQ})")
    group.add_argument("--dtype", choices=DTYPES, default="fp32", help="parameter dtype (default fp32)")
    group.add_argument("--autocast", choices=AUTOCASTS, default="none", help="autocast dtype (default none)")
    group.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw", help="optimizer (default adamw)")
    group.add_argument("--optimizer-impl", choices=OPTIMIZER_IMPLS, default=None,
                       help="optimizer kernels (default: foreach on CUDA, loop on CPU, as PyTorch)")
    group.add_argument("--checkpointing", choices=CHECKPOINTINGS, default="none",
                       help="activation checkpointing: full blocks, or selective (attention only)")
    group.add_argument("--lora-rank", type=int, default=0, metavar="R", help="LoRA rank; 0 trains all weights")
    group.add_argument("--grad-accum", type=int, default=1, metavar="N", help="micro-batches per optimizer step")
    group.add_argument("--attn", choices=ATTENTIONS, default="sdpa",
                       help="attention implementation (flash: memory-efficient SDPA kernels)")
    group.add_argument("--head", choices=HEADS, default="lm",
                       help="task head: lm (the model's language-model head, default) or seq-cls "
                            "(AutoModelForSequenceClassification, as an HF Trainer classification fine-tune)")
    group.add_argument("--num-labels", type=int, default=2, metavar="N",
                       help="classes of the seq-cls head (default 2; 1 is regression)")
    group.add_argument("--zero-grad", choices=ZERO_GRADS, default="none",
                       help="what optimizer.zero_grad() leaves between steps: none (set_to_none=True, "
                            "PyTorch >= 2.0, default) or zeros (set_to_none=False: gradients stay allocated)")


def setup_from_args(args: argparse.Namespace) -> TrainingSetup:
    """The `TrainingSetup` the flags of `add_setup_flags` describe."""
    return TrainingSetup(
        batch=args.batch,
        seq=args.seq,
        dtype=args.dtype,
        autocast=args.autocast,
        optimizer=args.optimizer,
        optimizer_impl=args.optimizer_impl,
        checkpointing=args.checkpointing,
        lora_rank=args.lora_rank,
        grad_accum=args.grad_accum,
        attn=args.attn,
        # subcommands that build their own parser without these flags keep the defaults
        head=getattr(args, "head", "lm"),
        num_labels=getattr(args, "num_labels", 2),
        zero_grad=getattr(args, "zero_grad", "none"),
    )
