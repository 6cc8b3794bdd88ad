"""`memplan generate MODEL --batch B --input-len L --new-tokens N [--cache ...]`: the peak memory
of one transformers generate() call (`memplan.inference.generate.estimate_generation`)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from memplan.cli import SUBCOMMANDS, print_json
from memplan.cli.flags import add_job_flags
from memplan.cli.from_file import add_model_input_flags
from memplan.cli.inputs import model_arg
from memplan.cli.table import echo, pairs, paragraph
from memplan.errors import UserError
from memplan.inference.gen_setup import CACHES, GenerationSetup
from memplan.models.setup import DTYPES, TrainingSetup
from memplan.units import format_bytes, parse_size

# the fields of the training setup that build the model for inference (`gen_capture.model_setup`)
MODEL_FIELDS = ("attn", "quant", "double_quant", "quant_storage", "compute_dtype", "routing")

if TYPE_CHECKING:  # imported where they are used: parsing the command line needs none of them
    from memplan.inference.generate import GenerationEstimate


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "generate",
        help=SUBCOMMANDS["generate"],
        description="Trace one transformers generate() call on fake tensors (prefill, then exactly N decode "
        "steps, with the cache transformers builds) and predict peak allocated and reserved memory, device "
        "memory used, the breakdown and phase at the peak, and whether it fits.",
    )
    p.add_argument("model", metavar="MODEL", help="registry name, config.json path or Hub id org/name")
    call = p.add_argument_group("the generate() call")
    call.add_argument("--batch", type=int, default=1, metavar="B", help="prompts per call (default 1)")
    call.add_argument("--input-len", type=int, required=True, metavar="L", help="tokens per prompt")
    call.add_argument("--new-tokens", type=int, required=True, metavar="N", help="tokens generated per sequence")
    call.add_argument("--cache", choices=CACHES, default="dynamic",
                      help="transformers' cache: dynamic (default), static, sliding (static with sliding "
                           "layers), offloaded, quantized:int4 (quanto), quantized:int8 (HQQ, modelled), "
                           "quantized:fp8")
    ways = call.add_mutually_exclusive_group()
    ways.add_argument("--beams", type=int, default=1, metavar="K", help="beam search over K beams")
    ways.add_argument("--num-return-sequences", type=int, default=1, metavar="K",
                      help="sample K sequences per prompt")
    model = p.add_argument_group("model")
    model.add_argument("--dtype", choices=DTYPES, default="fp32", help="weights' dtype (default fp32)")
    add_job_flags(p, TrainingSetup, only=MODEL_FIELDS)
    add_model_input_flags(p)
    target = p.add_argument_group("target")
    target.add_argument("--gpu", default=None, metavar="NAME", help="device profile, e.g. h100-80gb")
    target.add_argument("--capacity", default=None, metavar="SIZE", help="device memory, e.g. 24GiB")
    target.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="target device (default cuda)")
    target.add_argument("--tp", type=int, default=1, metavar="T",
                        help="tensor parallelism over T GPUs (transformers' TP plan; rank 0's figures)")
    target.add_argument("--allocator", default="caching", metavar="NAME",
                        help="caching (default), expandable or none (tensor bytes only)")
    target.add_argument("--alloc-conf", default=None, metavar="STR", help="a PYTORCH_CUDA_ALLOC_CONF string")
    target.add_argument("--cuda-context", default=None, metavar="SIZE", help="CUDA context size (default: profile's)")
    target.add_argument("--full-depth", action="store_true", help="trace every block instead of extrapolating")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def run(args: argparse.Namespace) -> int:
    if getattr(args, "from_file", None) is not None:
        raise UserError("--from reads a trainer's configuration; memplan generate takes the call's flags")
    generation = GenerationSetup(batch=args.batch, input_len=args.input_len, new_tokens=args.new_tokens,
                                 cache=args.cache, beams=args.beams, num_return_sequences=args.num_return_sequences)
    fields = {"dtype": args.dtype, "attn": args.attn, "quant": args.quant, "double_quant": args.double_quant,
              "quant_storage": args.quant_storage, "compute_dtype": args.compute_dtype, "routing": args.routing,
              "seq": generation.total_len}
    from memplan.inference.generate import estimate_generation

    result = estimate_generation(
        model_arg(args), generation, fields, device=args.device, allocator=args.allocator, alloc_conf=args.alloc_conf,
        capacity=parse_size(args.capacity) if args.capacity is not None else None, gpu=args.gpu,
        cuda_context=parse_size(args.cuda_context) if args.cuda_context is not None else None,
        extrapolate=not args.full_depth, tp=args.tp)
    if args.json:
        print_json(result.to_json())
        return 0
    render(result)
    return 0


def render(result: GenerationEstimate) -> None:
    """The estimate as key/value rows, the verdict, then the assumptions."""
    g = result.generation
    title = (f"{result.model} ({result.parameters / 1e9:.2f}B parameters) generate(): batch {g['batch']}, "
             f"{g['input_len']} + {g['new_tokens']} tokens, {g['cache']} cache on {result.gpu or result.device}"
             + (f", TP {result.tp} (rank 0)" if result.tp > 1 else ""))
    b = result.breakdown
    rows = [("peak allocated", format_bytes(result.peak_allocated_bytes)),
            ("peak reserved", format_bytes(result.peak_reserved_bytes)),
            ("device used", format_bytes(result.device_used_bytes)), ("phase at peak", result.peak_phase),
            ("weights", format_bytes(b["weights"])), ("kv cache", format_bytes(b["kv_cache"])),
            ("activations/logits", format_bytes(b["activations"])), ("other", format_bytes(b["other"]))]
    if result.host.peak_bytes:
        rows.append(("host (pinned)", format_bytes(result.host.pinned_bytes)))
    echo(pairs(rows, title=title))
    if result.capacity_bytes is not None:
        verdict = "fits" if result.fits else "does NOT fit"
        margin = result.margin_bytes or 0
        echo(paragraph(f"{verdict}: {format_bytes(result.device_used_bytes)} used of "
                       f"{format_bytes(result.capacity_bytes)}, margin {'-' if margin < 0 else ''}"
                       f"{format_bytes(abs(margin))} ({result.method}, {result.elapsed_s:.1f} s)"))
    else:
        echo(paragraph(f"({result.method}, {result.elapsed_s:.1f} s; give --gpu or --capacity to check the fit)"))
    echo(paragraph("assumes: " + "; ".join(result.assumptions)))
