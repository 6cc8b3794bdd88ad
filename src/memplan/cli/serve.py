"""`memplan serve MODEL --engine vllm|sglang [engine flags]`: a serving engine's memory, term by term.

The engine flags are spelt as `vllm serve` and `sglang.launch_server` spell them (with
dashes or underscores), so a user can paste their command line's flags. When the engine
would refuse to start, its own message is printed and the exit code is 2.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from memplan.cli import SUBCOMMANDS, print_json
from memplan.cli.table import echo, pairs, paragraph
from memplan.errors import UserError
from memplan.inference.activation import SAMPLERS
from memplan.inference.engines import DEFAULT_VERSIONS, ENGINES
from memplan.inference.kv import KV_CACHE_DTYPE_BYTES
from memplan.units import format_bytes, parse_size

if TYPE_CHECKING:  # imported where they are used: parsing the command line needs none of them
    from memplan.inference.serve import ServingEstimate


def _flag(p: argparse.ArgumentParser, *names: str, **kwargs: object) -> None:
    """One option under its dashed names and their underscore spellings (`--max_model_len`)."""
    spelled = list(names) + [n.replace("-", "_").replace("__", "--", 1) for n in names
                             if n.startswith("--") and "-" in n[2:]]
    p.add_argument(*spelled, **kwargs)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve",
        help=SUBCOMMANDS["serve"],
        description="The memory a vLLM or SGLang server sizes at start-up on one GPU, term by term: weights, the "
        "profile run's activation peak, non-torch memory, CUDA graphs, the KV pool (bytes, tokens, blocks, "
        "concurrency), the longest context that starts and the engine's refusal when it would not start.",
    )
    p.add_argument("model", metavar="MODEL", help="registry name, config.json path or Hub id org/name")
    p.add_argument("--engine", choices=ENGINES, default="vllm", help="the serving engine (default vllm)")
    p.add_argument("--gpu", default="h100-80gb", metavar="NAME", help="device profile (default h100-80gb)")
    _flag(p, "--tp", "--tensor-parallel-size", "-tp", type=int, default=1, dest="tp", help="tensor-parallel ranks")
    _flag(p, "--pp", "--pipeline-parallel-size", "-pp", type=int, default=1, dest="pp", help="pipeline stages")
    _flag(p, "--dtype", default="auto", help="auto (the config's), bfloat16 or float16")
    _flag(p, "--quantization", "-q", default=None, help="fp8, awq, gptq, bitsandbytes or mxfp4 (default: the config's)")
    _flag(p, "--kv-cache-dtype", default="auto", choices=["auto", *KV_CACHE_DTYPE_BYTES, "fp8_ds_mla"],
          help="KV cache element type (default auto: the model's)")
    _flag(p, "--max-model-len", "--context-length", type=int, default=None, dest="max_model_len",
          help="longest request in tokens (default: the model's max_position_embeddings)")
    _flag(p, "--max-num-seqs", "--max-running-requests", type=int, default=None, dest="max_num_seqs",
          help="requests in one batch (default: the engine's)")
    _flag(p, "--max-num-batched-tokens", "--chunked-prefill-size", type=int, default=None,
          dest="max_num_batched_tokens", help="tokens in one batch (default: the engine's)")
    budget = p.add_mutually_exclusive_group()
    _flag(budget, "--gpu-memory-utilization", type=float, default=None, dest="gpu_memory_utilization",
          help="vLLM: fraction of total memory the instance may use (default: the version's)")
    _flag(budget, "--mem-fraction-static", type=float, default=None, dest="mem_fraction_static",
          help="SGLang: fraction for weights and KV (default: SGLang's heuristic)")
    _flag(budget, "--kv-cache-memory-bytes", "--kv-cache-memory", default=None, dest="kv_cache_memory",
          metavar="SIZE", help="vLLM: KV cache bytes, in place of the utilisation (e.g. 40GiB)")
    _flag(p, "--enforce-eager", "--disable-cuda-graph", action="store_true", dest="enforce_eager",
          help="no CUDA graphs")
    _flag(p, "--block-size", type=int, default=None, help="tokens per KV block (default 16, 64 for MLA)")
    _flag(p, "--engine-version", default=None, metavar="V",
          help=f"engine version whose rules apply (default vllm {DEFAULT_VERSIONS['vllm']}, "
               f"sglang {DEFAULT_VERSIONS['sglang']})")
    _flag(p, "--entry", choices=("server", "llm"), default="server",
          help="vLLM started as `vllm serve` (server, default) or the LLM class (llm): their batch defaults differ")
    _flag(p, "--sampler", choices=tuple(SAMPLERS), default="native",
          help="vLLM's top-k/top-p sampler in the profile run: native (PyTorch, default) or flashinfer")
    _flag(p, "--target-concurrency", type=float, default=None, metavar="N",
          help="also give the utilisation that holds N requests of --max-model-len tokens")
    p.add_argument("--capacity", default=None, metavar="SIZE", help="total GPU memory, in place of the profile's")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def run(args: argparse.Namespace) -> int:
    from memplan.inference.serve import estimate_serving

    result = estimate_serving(
        args.model, args.engine, args.gpu, tp=args.tp, pp=args.pp, dtype=args.dtype, quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, gpu_memory_utilization=args.gpu_memory_utilization,
        mem_fraction_static=args.mem_fraction_static,
        kv_cache_memory_bytes=parse_size(args.kv_cache_memory) if args.kv_cache_memory is not None else None,
        enforce_eager=args.enforce_eager, block_size=args.block_size, engine_version=args.engine_version,
        entry=args.entry, sampler=args.sampler, target_concurrency=args.target_concurrency,
        capacity=parse_size(args.capacity) if args.capacity is not None else None)
    if args.json:
        print_json(result.to_json())
    else:
        render(result)
    if not result.starts:
        if not args.json:
            raise UserError(f"{args.engine} would not start: {result.refusal} (the longest --max-model-len that "
                            f"starts: {result.max_model_len_that_starts})")
        return 2
    return 0


def _rows(r: ServingEstimate) -> list[tuple[str, str]]:
    s, kv, act, graphs = r.settings, r.kv, r.activation, r.graphs
    rows = [("weights", format_bytes(r.weights.total_bytes)),
            ("activation peak", f"{format_bytes(act.total_bytes)} (profile run of {act.tokens} tokens, "
                                f"{act.requests} requests)"),
            ("non-torch", f"{format_bytes(r.non_torch_rise_bytes)} in the budget; outside it "
                          f"{format_bytes(r.outside_budget_bytes['cuda_context_bytes'])} CUDA context + "
                          f"{format_bytes(r.outside_budget_bytes['nccl_bytes'])} NCCL"),
            ("CUDA graphs", f"{format_bytes(graphs['pool_bytes'])} pool, {graphs['captured']} graphs"
                            + (f" (engine estimate {format_bytes(graphs['engine_estimate_bytes'])} in the budget)"
                               if graphs["engine_estimate_bytes"] else "")),
            ("budget" if r.engine == "vllm" else "free at start-up", format_bytes(r.budget_bytes)),
            ("KV cache", f"{format_bytes(kv['bytes'])}, {kv['tokens']:,} tokens"
                         + (f", {kv['blocks']:,} blocks of {kv['block_size']}" if r.engine == "vllm" else "")),
            ("max concurrency", f"{kv['max_concurrency']:.2f}x at {s['max_model_len']:,} tokens per request"),
            ("longest context", f"{r.max_model_len_that_starts:,} tokens start"),
            ("device used", f"{format_bytes(r.device_used_bytes)} of {format_bytes(r.capacity_bytes)} "
                            "(as nvidia-smi shows it)")]
    if r.target is not None:
        knob = ("gpu_memory_utilization", "kv_cache_memory_bytes") if r.engine == "vllm" else (
            "mem_fraction_static", "kv_bytes")
        rows.append((f"for {r.target['concurrency']:g}x", f"--{knob[0].replace('_', '-')} {r.target[knob[0]]} "
                     f"({format_bytes(r.target[knob[1]])} KV)"))
    return rows


def render(r: ServingEstimate) -> None:
    """The estimate as key/value rows, the verdict and the assumptions."""
    s = r.settings
    knob = (f"gpu_memory_utilization {s['gpu_memory_utilization']}" if r.engine == "vllm"
            else f"mem_fraction_static {s['mem_fraction_static']}")
    title = (f"{r.model} on {r.engine} {r.engine_rules['version']}, {r.gpu}, tp {s['tp']} pp {s['pp']}, "
             f"{knob}, max_model_len {s['max_model_len']:,}")
    echo(pairs(_rows(r), title=title))
    if r.starts:
        margin = r.margin_bytes
        verdict = "starts" if margin >= 0 else "starts, then may run out of memory"
        echo(paragraph(f"{verdict}: {format_bytes(r.device_used_bytes)} used of {format_bytes(r.capacity_bytes)} "
                       f"(margin {format_bytes(margin)}; {r.elapsed_s:.1f} s)"))
    for line in r.assumptions:
        echo(paragraph(f"- {line}"))
