"""Command-line flags of a parallel layout, shared by `memplan estimate` and `memplan fit`."""

from __future__ import annotations

import argparse

from memplan.parallel.layout import DS_KNOBS, ENGINES, FSDP_PARAM_DTYPES, SCHEDULES, Layout


def add_layout_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("parallel layout")
    group.add_argument("--world-size", type=int, default=None, metavar="N", help="GPUs in the job (default tp x pp x cp)")
    group.add_argument("--zero", type=int, default=0, metavar="STAGE",
                       help="0 DDP, 1-2 DeepSpeed ZeRO, 3 FSDP2 fully_shard (default 0; --engine picks another)")
    group.add_argument("--engine", choices=ENGINES, default=None,
                       help="who shards under --zero: fsdp2 (fully_shard; stage 3), fsdp1 (FullyShardedDataParallel "
                            "as HF Trainer / accelerate set it up; stage 3) or deepspeed (stages 1-3); default "
                            "fsdp2 for stage 3, deepspeed for 1-2")
    group.add_argument("--shard-size", type=int, default=None, metavar="N", help="HSDP: shard over N ranks (zero 3)")
    group.add_argument("--tp", type=int, default=1, metavar="T", help="tensor-parallel degree (DTensor, torchtitan's Llama plan)")
    group.add_argument("--pp", type=int, default=1, metavar="P", help="pipeline-parallel degree")
    group.add_argument("--cp", type=int, default=1, metavar="C",
                       help="context-parallel degree: PyTorch's context_parallel ring attention, with --zero 3")
    group.add_argument("--microbatches", type=int, default=1, metavar="M", help="pipeline micro-batches")
    group.add_argument("--schedule", default="1f1b", metavar="NAME", help=f"pipeline schedule: {', '.join(SCHEDULES)}")
    ds = parser.add_argument_group("DeepSpeed ZeRO (--engine deepspeed; elements, DeepSpeed's defaults)")
    ds.add_argument("--ds-reduce-bucket-size", type=int, default=None, metavar="N",
                    help="reduce_bucket_size (default 5e8: one bucket of N model-dtype elements)")
    ds.add_argument("--ds-prefetch-bucket-size", type=int, default=None, metavar="N",
                    help="stage3_prefetch_bucket_size (default 5e7)")
    ds.add_argument("--ds-param-persistence-threshold", type=int, default=None, metavar="N",
                    help="stage3_param_persistence_threshold: parameters this small stay whole (default 1e5)")
    ds.add_argument("--ds-max-live-parameters", type=int, default=None, metavar="N",
                    help="stage3_max_live_parameters (default 1e9)")
    ds.add_argument("--ds-overlap-comm", action="store_true", help="overlap_comm for stages 1-2: two reduce buckets")
    group.add_argument("--fsdp-param-dtype", choices=FSDP_PARAM_DTYPES, default=None,
                       help="FSDP2 mixed precision (zero 3): gather and compute in this dtype, reduce in fp32")
    group.add_argument("--ep", type=int, default=1, metavar="E",
                       help="expert-parallel degree (mixture-of-experts, with --zero 3): routed experts split over "
                            "E ranks taken from dp x tp, tokens exchanged by all-to-all (default 1)")


def layout_from_args(args: argparse.Namespace) -> Layout:
    return Layout(world_size=args.world_size, zero=args.zero, shard_size=args.shard_size, tp=args.tp, pp=args.pp,
                  cp=getattr(args, "cp", 1), microbatches=args.microbatches, schedule=args.schedule,
                  fsdp_param_dtype=getattr(args, "fsdp_param_dtype", None), engine=getattr(args, "engine", None),
                  ep=getattr(args, "ep", 1),
                  **{name: getattr(args, name, None) for name in DS_KNOBS if getattr(args, name, None) is not None})
