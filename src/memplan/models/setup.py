"""The training setup: everything about a training step except the model itself.

One dataclass, `TrainingSetup`, whose fields are declared with their help, section and flag
(`memplan.models.fields`; the same flags on every subcommand that takes a model). Defaults are what PyTorch and Hugging Face do when
the user says nothing:

- `batch=1` sequences per micro-batch, `grad_accum=1` micro-batch per optimizer step;
- `seq=None`: the model's maximum positions, capped at 1024 (GPT-2's context; a
  realistic fine-tuning length that does not blow up memory on long-context models);
- `precision="bf16-mixed"`: what most people train LLMs with, named as Lightning names it
  (lightning/fabric/plugins/precision/precision.py lines 26-35 and amp.py lines 31-60, Lightning
  2.6.6): fp32 parameters, gradients and optimizer states ("master weights") and a bf16
  forward under `torch.autocast`, as the HF Trainer's `bf16=True` runs (`TrainingArguments`
  leaves the model in fp32 and autocasts). The other precisions: `32-true` (everything fp32,
  PyTorch's own default), `16-mixed` (fp16 autocast over fp32 parameters, with a gradient
  scaler), `bf16-true` and `16-true` (the parameters themselves in bf16 / fp16, no autocast:
  lightning/fabric/plugins/precision/half.py lines 27-45). `dtype` (the parameters' dtype) and
  `autocast_dtype` (the forward's autocast) are derived from it; `autocast` adds an autocast
  that precision cannot say: a `-true` precision whose half-precision weights also run under
  autocast, as axolotl's `bf16: true` and TRL's `torch_dtype=bfloat16` + `bf16=True` run.
  Under FSDP and DeepSpeed a `-mixed` precision is traced as their own mixed precision
  (`memplan.parallel.apply.traced_precision`);
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

The techniques people turn on to make a job fit, each off by default:

- `quant`: the frozen base weights quantised by bitsandbytes (`nf4`/`fp4`: `Linear4bit`,
  `int8`: `Linear8bitLt`), with `double_quant` (4-bit quantisation constants quantised
  again), `quant_storage` (the dtype 4-bit weights are packed in) and `compute_dtype` (the
  dtype each matmul dequantises to; default: the setup's `dtype`, or the autocast dtype);
  `kbit_prep`: peft's `prepare_model_for_kbit_training` (every parameter frozen, every
  unquantised fp16/bf16 one cast to fp32: embeddings, norms, the LM head; on by default).
  A quantised base trains through LoRA
  (`lora_rank > 0`, QLoRA) or, with `frozen_base`, trains only what is not quantised;
- `optimizer` beyond PyTorch's: bitsandbytes' 8-bit and paged AdamW (`adamw8bit`,
  `paged-adamw8bit`, `paged-adamw`) and Lion (`lion`), torchao's low-bit AdamW
  (`ao-adamw8bit`, `ao-adamw4bit`, `ao-adamw-fp8`);
- `optimizer_in_backward`: each parameter's update runs in its gradient's
  post-accumulate hook (the gradient is freed right after), as torchtune's recipes and
  PyTorch's "optimizer step in backward" tutorial do;
- `cpu_offload`: `optimizer` keeps the optimizer state (and its step) on the host, as
  DeepSpeed's ZeRO-Offload and torchao's `CPUOffloadOptimizer` do; `params` keeps the
  sharded parameters, gradients and optimizer on the host (FSDP2's `CPUOffloadPolicy`,
  needs ZeRO-3);
- `loss`: `full` (the model's own head and loss), `chunked` / `chunked:N` (the head and
  cross-entropy in N chunks of the sequence, torchtune's `CEWithChunkedOutputLoss`, N=8
  by default), `fused-linear` (head and loss fused so the [B, S, V] logits never exist
  at once, as Liger's and cut-cross-entropy's kernels);
- `compile`: `model` compiles the whole model, `blocks` each transformer block (as
  torchtitan and torchtune do), both with the loss compiled too;
- `activation_offload`: `torchtune` moves saved activations to pinned host memory with
  a one-layer prefetch window (torchtune's `OffloadActivations`); memplan's own planner
  chooses which tensors to move in `memplan offload` (a plan of the traced step), not here;
- LoRA variants: `lora_targets` (module-name suffixes, or `("all-linear",)` as peft
  spells it), `lora_alpha` (default 2 x rank), `dora` (weight-decomposed LoRA);
- `impl`: whose code defines the model: `hf` (transformers) or `litgpt` (LitGPT's `GPT`).

A mixture-of-experts model routes its tokens by data that fake tensors do not have, so a
traced step states its `routing` (default `balanced`; `worst`, `capacity:F`, or `router`
for the model's own router on real tensors): `memplan.models.moe`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Literal, get_args

from memplan.errors import UserError
from memplan.models.fields import check_choices, option

Dtype = Literal["fp32", "bf16", "fp16"]
Precision = Literal["bf16-mixed", "32-true", "16-mixed", "bf16-true", "16-true"]
Autocast = Literal["none", "bf16", "fp16"]
Optimizer = Literal["adamw", "adam", "sgd", "adafactor", "adamw8bit", "paged-adamw8bit", "paged-adamw", "lion",
                    "ao-adamw8bit", "ao-adamw4bit", "ao-adamw-fp8"]
Quant = Literal["none", "nf4", "fp4", "int8"]
QuantStorage = Literal["uint8", "bf16", "fp16", "fp32"]
CpuOffload = Literal["none", "optimizer", "params"]
Compile = Literal["none", "model", "blocks"]
ActivationOffload = Literal["none", "torchtune"]
Impl = Literal["hf", "litgpt"]
OptimizerImpl = Literal["foreach", "fused", "loop"]
Checkpointing = Literal["none", "full", "selective", "selective-op"]
ZeroGrad = Literal["none", "zeros"]
Attention = Literal["eager", "sdpa", "flash"]
Head = Literal["lm", "seq-cls"]

DTYPES: tuple[str, ...] = get_args(Dtype)
PRECISIONS: tuple[str, ...] = get_args(Precision)
# precision -> (the parameters' dtype, the forward's autocast dtype)
PRECISION_DTYPES = {"32-true": ("fp32", "none"), "bf16-mixed": ("fp32", "bf16"), "16-mixed": ("fp32", "fp16"),
                    "bf16-true": ("bf16", "none"), "16-true": ("fp16", "none")}
AUTOCASTS: tuple[str, ...] = get_args(Autocast)
OPTIMIZERS: tuple[str, ...] = get_args(Optimizer)
TORCH_OPTIMIZERS = ("adamw", "adam", "sgd", "adafactor")  # the ones optimizer_impl applies to
QUANTS: tuple[str, ...] = get_args(Quant)
QUANT_STORAGES: tuple[str, ...] = get_args(QuantStorage)
CPU_OFFLOADS: tuple[str, ...] = get_args(CpuOffload)
COMPILES: tuple[str, ...] = get_args(Compile)
ACTIVATION_OFFLOADS: tuple[str, ...] = get_args(ActivationOffload)
IMPLS: tuple[str, ...] = get_args(Impl)
ALL_LINEAR = "all-linear"  # peft's spelling of "every linear layer but the output head"
DEFAULT_LOSS_CHUNKS = 8  # torchtune's CEWithChunkedOutputLoss(num_output_chunks=8)
OPTIMIZER_IMPLS: tuple[str, ...] = get_args(OptimizerImpl)
CHECKPOINTINGS: tuple[str, ...] = get_args(Checkpointing)
ZERO_GRADS: tuple[str, ...] = get_args(ZeroGrad)
ATTENTIONS: tuple[str, ...] = get_args(Attention)
HEADS: tuple[str, ...] = get_args(Head)

DEFAULT_MAX_SEQ = 1024


@dataclass
class TrainingSetup:
    """How one training step runs. See the module docstring for the defaults.

    `batch` is the micro-batch (sequences per forward); one optimizer step runs
    `grad_accum` micro-batches. `allow_long_seq` permits `seq` beyond the model's
    maximum positions (for models whose position encoding extrapolates, e.g. RoPE).
    `lora_targets` overrides the family's default LoRA target modules.
    The memory techniques (`quant` ... `impl`) and `routing` are described in the module docstring. `seed` makes
    real-tensor weights and batches deterministic. `head` picks the task head (see the
    module docstring); `num_labels` is the classifier's width for `head="seq-cls"`.
    Each field's help, section and flag are declared here (`memplan.models.fields`).
    """

    batch: int = option(1, "sequences per micro-batch", "model", metavar="N")
    seq: int | None = option(None, "sequence length", "model", metavar="N",
                             default_text=f"the model's max positions, at most {DEFAULT_MAX_SEQ}")
    precision: Precision = option("bf16-mixed", "as Lightning names it: bf16-mixed (fp32 weights and optimizer "
                                  "states, bf16 autocast, as HF Trainer's bf16=True), 32-true, 16-mixed, or bf16-true "
                                  "and 16-true (the weights themselves in bf16 / fp16)", "precision")
    autocast: Autocast | None = option(None, "an autocast on top of a -true precision (axolotl's bf16: true, TRL's "
                                       "torch_dtype=bfloat16 with bf16=True)", "precision",
                                       default_text="the precision's own")
    optimizer: Optimizer = option("adamw", "optimizer: torch.optim's, bitsandbytes' (8-bit, paged, lion) or "
                                  "torchao's low-bit AdamW (ao-*)", "optimizer")
    optimizer_impl: OptimizerImpl | None = option(None, "torch.optim kernels", "optimizer",
                                                  default_text="foreach on CUDA, loop on CPU, as PyTorch")
    checkpointing: Checkpointing = option("none", "activation checkpointing: full (every block), selective (the "
                                          "attention modules) or selective-op (torchtitan's op-level policy)",
                                          "activations")
    lora_rank: int = option(0, "LoRA rank; 0 trains all weights", "adapters", metavar="R")
    grad_accum: int = option(1, "micro-batches per optimizer step", "model", metavar="N")
    attn: Attention = option("sdpa", "attention implementation (flash: the memory-efficient SDPA kernels)",
                             "model")
    allow_long_seq: bool = option(False, "allow a sequence beyond the model's max positions (RoPE extrapolates)",
                                  "model")
    lora_targets: tuple[str, ...] | None = option(None, "LoRA target module names", "adapters",
                                                  metavar=f"NAME,NAME|{ALL_LINEAR}",
                                                  default_text="peft's for the family")
    seed: int = option(0, "seed of real-tensor weights and batches", "model", cli=False)
    head: Head = option("lm", "task head: lm (the model's language-model head) or seq-cls "
                        "(AutoModelForSequenceClassification, as an HF Trainer classification fine-tune)", "model")
    num_labels: int = option(2, "classes of the seq-cls head (1: regression)", "model", metavar="N")
    zero_grad: ZeroGrad = option("none", "what optimizer.zero_grad() leaves between steps: none (set_to_none=True, "
                                 "PyTorch >= 2.0) or zeros (set_to_none=False: gradients stay allocated)",
                                 "optimizer")
    quant: Quant = option("none", "quantise the frozen base weights with bitsandbytes (nf4/fp4: Linear4bit, "
                          "int8: Linear8bitLt); with a LoRA rank this is QLoRA", "adapters")
    double_quant: bool = option(False, "4-bit: quantise the quantisation constants too", "adapters")
    quant_storage: QuantStorage = option("uint8", "4-bit: the dtype packed weights are stored in", "adapters")
    compute_dtype: Dtype | None = option(None, "the dtype quantised matmuls dequantise to", "adapters",
                                         default_text="the autocast dtype, else the parameter dtype")
    kbit_prep: bool = option(True, "peft's prepare_model_for_kbit_training (freezes the base, casts its "
                             "unquantised fp16/bf16 parameters to fp32)", "adapters")
    frozen_base: bool = option(False, "with a quantised base and no LoRA: train only what is not quantised",
                               "adapters")
    optimizer_in_backward: bool = option(False, "step each parameter in its gradient's post-accumulate hook "
                                         "(needs grad_accum 1)", "optimizer")
    cpu_offload: CpuOffload = option("none", "optimizer: state and step on the host (ZeRO-Offload); params: "
                                     "FSDP2's CPUOffloadPolicy (needs zero 3)", "optimizer")
    loss: str = option("full", f"LM loss: the model's own (full), head + cross-entropy in N chunks (chunked, "
                       f"N={DEFAULT_LOSS_CHUNKS}), or fused linear cross-entropy (no [B, S, V] logits)", "loss",
                       metavar="full|chunked[:N]|fused-linear")
    compile: Compile = option("none", "torch.compile: blocks (each transformer block and the loss, as "
                              "torchtitan; the bare flag) or model (the whole model)", "activations", bare="blocks")
    activation_offload: ActivationOffload = option("none", "saved activations to pinned host memory as "
                                                   "torchtune's OffloadActivations does (the bare flag; memplan's "
                                                   "own planner is `memplan offload`)", "activations",
                                                   bare="torchtune", class_checks=True)
    lora_alpha: float | None = option(None, "LoRA alpha", "adapters", metavar="A", default_text="2 x rank")
    dora: bool = option(False, "weight-decomposed LoRA (peft's use_dora)", "adapters")
    impl: Impl = option("hf", "whose code defines the model: hf (transformers) or litgpt (LitGPT's GPT)", "model")
    routing: str = option("balanced", "mixture-of-experts models: the token-to-expert assignment the step runs "
                          "with (worst: every token to the same top-k experts; capacity:F: experts filled to F x "
                          "tokens x k / experts; router: the model's own, real tensors)", "model",
                          metavar="balanced|worst|capacity:F|router")

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise `UserError` for a field that no training step can have."""
        if self.activation_offload == "memplan":
            raise UserError("memplan plans which tensors leave the GPU with `memplan offload MODEL --gpu NAME`, "
                            "not inside a traced step: use `activation_offload=torchtune` here")
        check_choices(self)
        for name in ("batch", "grad_accum"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UserError(f"`{name}` must be a whole number >= 1, not {value!r}")
        if self.seq is not None and (isinstance(self.seq, bool) or not isinstance(self.seq, int) or self.seq < 1):
            raise UserError(f"`seq` must be a whole number >= 1, not {self.seq!r}")
        if isinstance(self.num_labels, bool) or not isinstance(self.num_labels, int) or self.num_labels < 1:
            raise UserError(f"`num_labels` must be a whole number >= 1, not {self.num_labels!r}")
        if isinstance(self.lora_rank, bool) or not isinstance(self.lora_rank, int) or self.lora_rank < 0:
            raise UserError(f"`lora_rank` must be a whole number >= 0, not {self.lora_rank!r}")
        if self.optimizer_impl == "fused" and self.optimizer == "adafactor":
            raise UserError("torch.optim.Adafactor has no fused implementation: use `optimizer_impl=foreach` "
                            "or loop")
        if self.lora_targets is not None:
            self.lora_targets = tuple(self.lora_targets)
        self.loss_chunks()  # a loss that does not parse is an error here
        from memplan.models.moe import (
            parse_routing,  # torch, which the declaration alone does not need
        )

        parse_routing(self.routing)  # so is a routing
        self._check_combinations()

    def _check_combinations(self) -> None:
        """`UserError` for techniques that do not go together (one line, with the fix)."""
        if self.optimizer_impl is not None and self.optimizer not in TORCH_OPTIMIZERS:
            raise UserError(f"`optimizer_impl` picks torch.optim kernels; {self.optimizer} brings its own: "
                            "leave `optimizer_impl` out")
        if self.quant != "none" and self.lora_rank == 0 and not self.frozen_base:
            raise UserError(f"full fine-tuning cannot train {self.quant}-quantised weights: add `lora_rank=R` "
                            "(QLoRA), or `frozen_base=True` to train only what is not quantised")
        if self.quant == "none" and (self.double_quant or self.quant_storage != "uint8" or self.frozen_base):
            raise UserError("`double_quant`, `quant_storage` and `frozen_base` describe a quantised base: "
                            "add `quant=nf4|fp4|int8`")
        if self.quant == "int8" and (self.double_quant or self.quant_storage != "uint8"):
            raise UserError("`double_quant` and `quant_storage` are 4-bit options: use `quant=nf4` or fp4")
        if self.optimizer_in_backward and self.grad_accum > 1:
            raise UserError("`optimizer_in_backward` steps as each gradient is ready, so gradients cannot "
                            "accumulate over micro-batches: use `grad_accum=1`")
        self._check_offload()
        if self.loss != "full" and self.head != "lm":
            raise UserError(f"`loss={self.loss}` replaces a language-model head's cross-entropy; the seq-cls "
                            "head has no vocabulary-sized logits: use `loss=full`")
        if self.lora_rank == 0 and (self.dora or self.lora_alpha is not None):
            raise UserError("`dora` and `lora_alpha` configure LoRA: add `lora_rank=R`")
        if self.lora_targets is not None and ALL_LINEAR in self.lora_targets and len(self.lora_targets) > 1:
            raise UserError(f"`lora_targets={ALL_LINEAR}` is peft's name for every linear layer but the output "
                            f"head and stands alone: drop the other names, or list every module without {ALL_LINEAR}")
        if self.impl == "litgpt":
            self._check_litgpt()
        if self.lora_alpha is not None and (isinstance(self.lora_alpha, bool) or not self.lora_alpha > 0):
            raise UserError(f"`lora_alpha` must be a number > 0, not {self.lora_alpha!r}")

    def _check_offload(self) -> None:
        """`UserError` for CPU offloading with what it cannot go with (one line, with the fix)."""
        if self.cpu_offload == "none":
            return
        if self.optimizer not in TORCH_OPTIMIZERS:
            raise UserError(f"`cpu_offload` steps a torch.optim optimizer on the host; {self.optimizer} runs its "
                            f"own GPU kernels: use `optimizer={' or '.join(TORCH_OPTIMIZERS[:2])}` with `cpu_offload`")
        if self.optimizer_in_backward:
            raise UserError("`cpu_offload` steps the optimizer on the host after backward; `optimizer_in_backward` "
                            "steps on the GPU inside it: use one of them")
        if self.cpu_offload == "optimizer" and self.zero_grad != "none":
            raise UserError("`cpu_offload=optimizer` (torchao's CPUOffloadOptimizer) frees the GPU gradients in "
                            "zero_grad(): use `zero_grad=none`")

    def _check_litgpt(self) -> None:
        """`UserError` for what LitGPT's own fine-tuning scripts do differently (memplan.models.litgpt)."""
        if self.loss != "full":
            raise UserError("LitGPT's fine-tuning loop computes its head and loss in 128-position chunks itself: "
                            "use `loss=full` with `impl=litgpt`")
        if self.quant != "none":
            raise UserError("LitGPT quantises through Lightning Fabric's BitsandbytesPrecision, which memplan does "
                            "not trace: use `impl=hf` with `quant`")
        if self.activation_offload != "none" or self.dora:
            raise UserError("`activation_offload` and `dora` are applied to Hugging Face models: use `impl=hf`")

    @property
    def dtype(self) -> str:
        """The parameters' dtype: fp32 under a -mixed precision (the master weights)."""
        return PRECISION_DTYPES[self.precision][0]

    @property
    def autocast_dtype(self) -> str:
        """The forward's autocast dtype ("none": no autocast): `autocast` where given, else
        the precision's."""
        return self.autocast if self.autocast is not None else PRECISION_DTYPES[self.precision][1]

    @classmethod
    def from_dtypes(cls, dtype: str, autocast: str = "none", **fields: Any) -> TrainingSetup:
        """The setup whose parameters are `dtype` and whose forward autocasts to `autocast`
        ("none": not at all): the precision that says both, with `autocast` added where none does."""
        return cls(**precision_fields(dtype, autocast), **fields)

    def loss_chunks(self) -> int:
        """The number of chunks of a `chunked` loss (1 for `full`, `fused-linear` and the RL
        trainers' losses of `memplan.models.rl_losses`)."""
        if self.loss in ("full", "fused-linear"):
            return 1
        name, _, count = self.loss.partition(":")
        if name == "chunked" and not count:
            return DEFAULT_LOSS_CHUNKS
        if name == "chunked" and count.isdigit() and int(count) >= 1:
            return int(count)
        from memplan.models.rl_losses import (
            parse_rl_loss,  # torch, which the other losses do not need
        )

        if parse_rl_loss(self.loss) is not None:
            return 1
        raise UserError(f"`loss` must be full, chunked, chunked:N (N >= 1), fused-linear, trl-grpo:C, trl-dpo:C or "
                        f"trl-logprobs:C, not '{self.loss}'")

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
        """Inverse of `to_dict`; unknown keys are an error (a typo should not pass silently).
        A setup written before precisions (`dtype` and `autocast` fields) is read as the
        precision that says both."""
        data = dict(data)
        if "dtype" in data and "precision" not in data:
            data.update(precision_fields(data.pop("dtype"), data.pop("autocast", None) or "none"))
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise UserError(f"unknown training setup field(s): {', '.join(unknown)}")
        return cls(**data)


def precision_fields(dtype: str, autocast: str = "none") -> dict[str, Any]:
    """`precision` (and `autocast` where the precision alone does not say it) for parameters
    in `dtype` whose forward autocasts to `autocast`."""
    for precision, pair in PRECISION_DTYPES.items():
        if pair == (dtype, autocast):
            return {"precision": precision}
    if dtype not in DTYPES:
        raise UserError(f"`dtype` must be one of {', '.join(DTYPES)}, not {dtype!r}")
    return {"precision": {"fp32": "32-true", "bf16": "bf16-true", "fp16": "16-true"}[dtype], "autocast": autocast}
