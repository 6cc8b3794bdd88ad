"""Command-line flags of a parallel layout, shared by `memplan estimate` and `memplan fit`."""

from __future__ import annotations

import argparse

from memplan.cli.setup_flags import flags_of
from memplan.parallel.layout import FSDP_PARAM_DTYPES, SCHEDULES, Layout


def add_layout_flags(parser: argparse.ArgumentParser, *, world_size: bool = True) -> None:
    """The layout flags; `world_size=False` leaves --world-size out (`memplan fit` takes --gpus)."""
    group = parser.add_argument_group("parallel layout")
    if world_size:
        group.add_argument("--world-size", type=int, default=None, metavar="N",
                           help="GPUs in the job (default tp x pp)")
    group.add_argument("--zero", type=int, default=0, metavar="STAGE",
                       help="0 DDP, 1-2 DeepSpeed ZeRO, 3 FSDP2 fully_shard (default 0)")
    group.add_argument("--shard-size", type=int, default=None, metavar="N", help="HSDP: shard over N ranks (zero 3)")
    group.add_argument("--tp", type=int, default=1, metavar="T", help="tensor-parallel degree (DTensor, torchtitan's Llama plan)")
    group.add_argument("--pp", type=int, default=1, metavar="P", help="pipeline-parallel degree")
    group.add_argument("--microbatches", type=int, default=1, metavar="M", help="pipeline micro-batches")
    group.add_argument("--schedule", default="1f1b", metavar="NAME", help=f"pipeline schedule: {', '.join(SCHEDULES)}")
    group.add_argument("--fsdp-param-dtype", choices=FSDP_PARAM_DTYPES, default=None,
                       help="FSDP2 mixed precision (zero 3): gather and compute in this dtype, reduce in fp32")


def layout_from_args(args: argparse.Namespace, world_size: int | None = None) -> Layout:
    """The layout the flags describe; `world_size` where the command takes it another way."""
    return Layout(world_size=world_size if world_size is not None else args.world_size, zero=args.zero,
                  shard_size=args.shard_size, tp=args.tp, pp=args.pp, microbatches=args.microbatches,
                  schedule=args.schedule, fsdp_param_dtype=getattr(args, "fsdp_param_dtype", None))


def layout_argv(layout: Layout) -> list[str]:
    """The layout flags of `memplan estimate` that describe `layout`."""
    values = layout.to_dict()
    values.pop("dp")  # derived: world size / (tp x pp)
    defaults = {**Layout().to_dict(), "world_size": None}
    return flags_of(values, defaults, add_layout_flags)


def custom_layout_flags(args: argparse.Namespace) -> list[str]:
    """The layout flags given with other than their default values."""
    parser = argparse.ArgumentParser(add_help=False)
    add_layout_flags(parser, world_size=False)
    defaults = vars(parser.parse_args([]))
    return [f"--{name.replace('_', '-')}" for name, default in defaults.items()
            if getattr(args, name, default) != default]
