"""The report's panels for inference: the KV pool of `memplan serve` and the peak of
`memplan generate` (their `--json` objects), with the settings each one shows and its verdict.

A serving estimate's panel is one stacked bar of the GPU's memory on one rank, the terms as
`memplan.inference.serve` sizes them (docs/serving.md): what lies outside PyTorch (CUDA
context, NCCL buffers, the non-torch rise of the profile run), the weights, the activation
reserve of the profile run, the CUDA-graph pool, the KV pool, and what is left free; the
engine's budget and the capacity as lines, and how many requests of `max_model_len` the pool
holds at once. A generation estimate's panel is its peak allocated memory by class, the KV
cache apart (docs/generation.md), with the peak reserved, device used and capacity as lines
and the phase of the peak (the prefill or a decode step).

The functions take the report page duck-typed (`heading`, `paragraph`, `figure`, `table`).
"""

from __future__ import annotations

from typing import Any

from memplan.report.figures import generation_peak, kv_pool_budget
from memplan.units import format_bytes


def serving_settings(doc: dict[str, Any]) -> str:
    """Which deployment a serving estimate is: "llama-3.1-8b on vLLM 0.11.0, h100-80gb, TP 1,
    max_model_len 131072, max_num_seqs 1024, gpu_memory_utilization 0.9"."""
    s, rules = doc.get("settings") or {}, doc.get("engine_rules") or {}
    engine = {"vllm": "vLLM", "sglang": "SGLang"}.get(doc.get("engine"), doc.get("engine"))
    parts = [f"{doc.get('model')} on {engine} {rules.get('version', '')}".rstrip(), str(doc.get("gpu")),
             f"TP {s.get('tp', 1)}" + (f" x PP {s['pp']}" if s.get("pp", 1) > 1 else ""),
             f"max_model_len {s.get('max_model_len')}"]
    for key in ("max_num_seqs", "gpu_memory_utilization", "mem_fraction_static"):
        if s.get(key) is not None:
            parts.append(f"{key} {s[key]}")
    if s.get("kv_cache_dtype") not in (None, "auto"):
        parts.append(f"KV {s['kv_cache_dtype']}")
    return ", ".join(parts)


def serving_verdict(doc: dict[str, Any]) -> str:
    """Whether the server starts, and what its KV pool holds."""
    if not doc.get("starts"):
        return f"does NOT start: {doc.get('refusal')}"
    kv = doc.get("kv") or {}
    return (f"starts: KV pool {format_bytes(kv.get('bytes', 0))} = {kv.get('tokens', 0):,} tokens, "
            f"{kv.get('max_concurrency', 0):g} requests of max_model_len "
            f"{(doc.get('settings') or {}).get('max_model_len')} at once; "
            f"{format_bytes(doc.get('device_used_bytes', 0))} of {format_bytes(doc.get('capacity_bytes', 0))} used")


def generation_settings(doc: dict[str, Any]) -> str:
    """Which call a generation estimate is: "llama-3.2-1b generate(), batch 8, 512 + 256 tokens,
    dynamic cache, bf16, TP 2"."""
    g, s = doc.get("generation") or {}, doc.get("setup") or {}
    parts = [f"{doc.get('model')} generate()", f"batch {g.get('batch')}",
             f"{g.get('input_len')} + {g.get('new_tokens')} tokens", f"{g.get('cache')} cache", str(s.get("dtype"))]
    if g.get("beams", 1) > 1:
        parts.append(f"{g['beams']} beams")
    elif g.get("num_return_sequences", 1) > 1:
        parts.append(f"{g['num_return_sequences']} sampled sequences")
    if s.get("quant") not in (None, "none"):
        parts.append(f"quant {s['quant']}")
    if doc.get("tp", 1) > 1:
        parts.append(f"TP {doc['tp']} (rank 0)")
    return ", ".join(parts)


def generation_verdict(doc: dict[str, Any]) -> str:
    """Whether the call fits, its device used, the margin and the phase of the peak."""
    where = doc.get("gpu") or doc.get("device") or "the device"
    used = format_bytes(doc.get("device_used_bytes", 0))
    phase = f"peak in the {doc.get('peak_phase')}"
    if not doc.get("capacity_bytes"):
        return f"{used} device used on {where}, {phase} (no capacity given, so no verdict)"
    margin = doc.get("margin_bytes") or 0
    return (f"{'fits' if doc.get('fits') else 'does NOT fit'} on {where}: {used} device used of "
            f"{format_bytes(doc['capacity_bytes'])}, margin {'-' if margin < 0 else ''}{format_bytes(abs(margin))}, "
            f"{phase}")


def serve_section(page: Any, i: int, name: str, doc: dict[str, Any]) -> None:
    """A serving estimate: its budget as a stacked bar, and the terms as a table."""
    settings = serving_settings(doc)
    page.heading(f"Serving: {doc.get('model')} on {doc.get('engine')} ({name})")
    page.paragraph(f"Deployment: {settings}. {serving_verdict(doc)[0].upper()}{serving_verdict(doc)[1:]}.")
    page.figure(kv_pool_budget(doc, f"{settings}: one rank's memory"), f"serve{i}_kv_pool.png",
                "Left to right, what the engine holds on one rank; the KV pool is what its budget (dashed) "
                "leaves after the weights, the activation reserve and the rest; white is free.")
    outside = doc.get("outside_budget_bytes") or {}
    rows = [["CUDA context", outside.get("cuda_context_bytes", 0)], ["NCCL buffers", outside.get("nccl_bytes", 0)],
            ["non-torch rise", doc.get("non_torch_rise_bytes", 0)], ["weights", doc["weights"]["total_bytes"]],
            ["activation reserve", doc["activation"]["total_bytes"]],
            ["CUDA graphs", (doc.get("cuda_graphs") or {}).get("pool_bytes", 0)], ["KV pool", doc["kv"]["bytes"]],
            ["device used", doc.get("device_used_bytes", 0)], ["engine budget", doc.get("budget_bytes", 0)],
            ["capacity", doc.get("capacity_bytes", 0)]]
    page.table(["term", "bytes"], [[term, format_bytes(int(value or 0))] for term, value in rows])


def generate_section(page: Any, i: int, name: str, doc: dict[str, Any]) -> None:
    """A generation estimate: its peak by class, the KV cache apart, and as a table."""
    settings = generation_settings(doc)
    page.heading(f"Generation: {doc.get('model')} ({name})")
    page.paragraph(f"Call: {settings}. {generation_verdict(doc)[0].upper()}{generation_verdict(doc)[1:]}.")
    page.figure(generation_peak(doc, f"{settings}: peak allocated by class"), f"generate{i}_peak.png",
                f"The peak allocated memory of the call, in the {doc.get('peak_phase')}, by class; the KV cache "
                "(yellow) is apart from the activations; dashed: peak reserved, device used and the capacity.")
    rows = [[key.replace("_", " "), format_bytes(int(value))] for key, value in (doc.get("breakdown") or {}).items()]
    rows += [["peak allocated", format_bytes(doc.get("peak_allocated_bytes", 0))],
             ["peak reserved", format_bytes(doc.get("peak_reserved_bytes", 0))],
             ["device used", format_bytes(doc.get("device_used_bytes", 0))]]
    page.table(["class", "bytes"], rows)
