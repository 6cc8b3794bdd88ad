"""The training-setup flags shared by every subcommand that takes a model, and the
`memplan.models.TrainingSetup` they describe (its fields and defaults: `memplan.models.setup`)."""

from __future__ import annotations

import argparse

from memplan.models.setup import (
    ATTENTIONS,
    AUTOCASTS,
    CHECKPOINTINGS,
    DEFAULT_MAX_SEQ,
    DTYPES,
    HEADS,
    OPTIMIZER_IMPLS,
    OPTIMIZERS,
    ZERO_GRADS,
    TrainingSetup,
)


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
