"""The training-setup flags shared by every subcommand that takes a model, and the
`memplan.models.TrainingSetup` they describe (its fields and defaults: `memplan.models.setup`)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from memplan.cli.from_file import add_model_input_flags
from memplan.errors import MemplanBug, UserError
from memplan.models.moe import experts_of
from memplan.models.registry import load_config
from memplan.models.setup import (
    ACTIVATION_OFFLOADS,
    ALL_LINEAR,
    ATTENTIONS,
    AUTOCASTS,
    CHECKPOINTINGS,
    COMPILES,
    CPU_OFFLOADS,
    DEFAULT_LOSS_CHUNKS,
    DEFAULT_MAX_SEQ,
    DTYPES,
    HEADS,
    IMPLS,
    OPTIMIZER_IMPLS,
    OPTIMIZERS,
    QUANT_STORAGES,
    QUANTS,
    ZERO_GRADS,
    TrainingSetup,
)


def add_setup_flags(parser: argparse.ArgumentParser, *, model_input: bool = True) -> None:
    """Add the training-setup flags shared by every subcommand that takes a model;
    `model_input=False` leaves out `--from` and `--trust-remote-code` (a subcommand that
    reads its own kind of configuration file)."""
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
    group.add_argument("--routing", default=None, metavar="balanced|worst|capacity:F|router",
                       help="mixture-of-experts models: the token-to-expert assignment the step runs with "
                            "(default balanced; worst: every token to the same top-k experts; capacity:F: "
                            "experts filled to F x tokens x k / experts; router: the model's own, real tensors)")
    _add_technique_flags(parser)
    if model_input:
        add_model_input_flags(parser)


def _add_technique_flags(parser: argparse.ArgumentParser) -> None:
    """The memory techniques of `TrainingSetup` (quantised base, optimizers' placement,
    losses, compile, activation offloading, LoRA variants, the model's implementation)."""
    group = parser.add_argument_group("memory techniques")
    group.add_argument("--quant", choices=QUANTS, default="none",
                       help="quantise the frozen base weights with bitsandbytes (nf4/fp4: Linear4bit, int8: "
                            "Linear8bitLt); with --lora-rank this is QLoRA")
    group.add_argument("--double-quant", action="store_true", help="4-bit: quantise the quantisation constants too")
    group.add_argument("--quant-storage", choices=QUANT_STORAGES, default="uint8",
                       help="4-bit: the dtype packed weights are stored in (default uint8)")
    group.add_argument("--compute-dtype", choices=DTYPES, default=None,
                       help="the dtype quantised matmuls dequantise to (default: --autocast's, else --dtype)")
    group.add_argument("--no-kbit-prep", dest="kbit_prep", action="store_false",
                       help="skip peft's prepare_model_for_kbit_training (freezes the base, casts its "
                            "unquantised fp16/bf16 parameters to fp32)")
    group.add_argument("--frozen-base", action="store_true",
                       help="with --quant and no LoRA: train only what is not quantised")
    group.add_argument("--optimizer-in-backward", action="store_true",
                       help="step each parameter in its gradient's post-accumulate hook (needs --grad-accum 1)")
    group.add_argument("--cpu-offload", choices=CPU_OFFLOADS, default="none",
                       help="optimizer: state and step on the host (ZeRO-Offload); params: FSDP2 "
                            "CPUOffloadPolicy (needs --zero 3)")
    group.add_argument("--loss", default="full", metavar="full|chunked[:N]|fused-linear",
                       help=f"LM loss: the model's own (full), head + cross-entropy in N chunks (chunked, "
                            f"N={DEFAULT_LOSS_CHUNKS}), or fused linear cross-entropy (no [B, S, V] logits)")
    group.add_argument("--compile", choices=COMPILES, default="none", nargs="?", const="blocks",
                       help="torch.compile: blocks (each transformer block and the loss, as torchtitan; the "
                            "bare flag) or model (the whole model)")
    # no argparse choices: TrainingSetup names the valid ones and answers `memplan` with `memplan offload`
    group.add_argument("--activation-offload", metavar="{" + ",".join(ACTIVATION_OFFLOADS) + "}", default="none",
                       nargs="?",
                       const="torchtune",
                       help="saved activations to pinned host memory as torchtune's OffloadActivations does "
                            "(memplan's own planner: `memplan offload`)")
    group.add_argument("--lora-targets", default=None, metavar=f"NAME,NAME|{ALL_LINEAR}",
                       help="LoRA target module names (default: peft's for the family)")
    group.add_argument("--lora-alpha", type=float, default=None, metavar="A", help="LoRA alpha (default 2 x rank)")
    group.add_argument("--dora", action="store_true", help="weight-decomposed LoRA (peft's use_dora)")
    group.add_argument("--impl", choices=IMPLS, default="hf",
                       help="whose code defines the model: hf (transformers, default) or litgpt")


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
        allow_long_seq=getattr(args, "allow_long_seq", False),  # set by --from, not a flag
        routing=_routing(args),
        **_technique_fields(args),
    )


def _routing(args: argparse.Namespace) -> str:
    """`--routing`, refused (one line) when given for a dense model; "balanced" when not given."""
    routing = getattr(args, "routing", None)
    if routing is None:
        return "balanced"
    spec = getattr(args, "model", None)
    is_trace = spec is not None and Path(spec).is_file() and Path(spec).suffix != ".json"
    if spec is not None and not is_trace:
        if experts_of(load_config(spec)) is None:
            raise UserError(f"--routing describes how a mixture-of-experts model routes its tokens; {spec} has no "
                            "experts: leave --routing out")
    return routing


def _technique_fields(args: argparse.Namespace) -> dict:
    """The `TrainingSetup` fields of `_add_technique_flags` (defaults where a parser lacks them)."""
    defaults = TrainingSetup()
    names = ("quant", "double_quant", "quant_storage", "compute_dtype", "kbit_prep", "frozen_base",
             "optimizer_in_backward", "cpu_offload", "loss", "compile", "activation_offload", "lora_alpha",
             "dora", "impl")
    fields = {name: getattr(args, name, getattr(defaults, name)) for name in names}
    targets = getattr(args, "lora_targets", None)
    fields["lora_targets"] = tuple(t.strip() for t in targets.split(",") if t.strip()) if targets else None
    return fields


def flags_of(values: dict, defaults: dict, add_flags: Callable[[argparse.ArgumentParser], None]) -> list[str]:
    """The command-line flags `add_flags` defines that give `values` where they differ
    from `defaults` (what a parser of those flags turns back into `values`)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_flags(parser)
    actions = {a.dest: a for a in parser._actions if a.option_strings}
    argv: list[str] = []
    for name, value in values.items():
        if value == defaults.get(name):
            continue
        action = actions.get(name)
        if action is None:
            raise MemplanBug(f"no command-line flag sets {name}={value!r}")
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            argv.append(action.option_strings[0])
        else:
            text = ",".join(value) if isinstance(value, (list, tuple)) else str(value)
            argv += [action.option_strings[0], text]
    return argv


def setup_argv(setup: TrainingSetup) -> list[str]:
    """The setup flags that describe `setup` (`setup_from_args` of them gives it back)."""
    values = setup.to_dict()
    values.pop("seed")  # the seed of real-tensor weights: no flag, no effect on memory
    return flags_of(values, TrainingSetup().to_dict(), add_setup_flags)
