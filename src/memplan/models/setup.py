"""The training setup: everything about a training step except the model itself.

One dataclass, `TrainingSetup` (its command-line flags are `memplan.cli.setup_flags`, the
same flags on every subcommand that takes a model). Defaults are what PyTorch and Hugging Face do when
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
