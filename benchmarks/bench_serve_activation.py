"""`memplan serve`'s modelled profile-run activation peak against a trace of the Hugging Face forward.

vLLM sizes its KV pool after one dummy forward of `max_num_batched_tokens` tokens; memplan
models that forward's live tensors from vLLM's own model code
(`memplan.inference.activation.profile_activation`: fused QKV and gate-up projections, the
residual added in place by the fused RMSNorm, no attention matrix), not from a trace. This
benchmark traces what transformers runs for the same tokens, to show how far the two forwards'
peaks are apart and where: for each model, the decoder (`model.model`, no LM head: vLLM
computes logits for the sampled rows only, a term of its own) runs under `torch.no_grad()` on
one sequence of T = 8192 tokens (vLLM's default `max_num_batched_tokens` for `vllm serve` on
an 80 GB GPU), bf16, SDPA as on CUDA (`memplan.capture.cuda_kernels`), captured on fake tensors
by memplan's recorder. Its activation peak is what is live above the weights, the buffers and
the input ids at the trace's peak (the final hidden states included, as vLLM's residual is);
the modelled one is `ActivationPeak.forward_bytes` (the heaviest block's live tensors, residual
included). Traced at 2 blocks: under `no_grad` each block's intermediates are freed before the
next block runs, so the peak above the weights does not grow with depth (the script checks 2
against 4 blocks for the first model).

    .venv/bin/python benchmarks/bench_serve_activation.py

Writes the `bench:serve_activation` table of BENCHMARKS.md. docs/serving.md explains the
differences.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks_md import write_section  # noqa: E402

COMMAND = ".venv/bin/python benchmarks/bench_serve_activation.py"
MODELS = ("llama-3.1-8b", "qwen2.5-7b", "qwen3-30b-a3b")
TOKENS = 8192  # vLLM 0.11's max_num_batched_tokens for `vllm serve` on an 80 GB GPU (inference/engines.py)
BLOCKS = 2


def hf_forward_activation(config: Any, tokens: int, blocks: int) -> tuple[int, str, str]:
    """(bytes live above the pre-existing buffers at the peak, the op and module of the peak)
    of the decoder's no-grad forward over [1, tokens], bf16, traced on fake tensors for CUDA."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memplan.capture.api import capture
    from memplan.capture.cuda_kernels import kernels_as_on_cuda
    from memplan.models.build import build_model
    from memplan.models.depth import with_layers
    from memplan.models.setup import TrainingSetup

    with FakeTensorMode(allow_non_fake_inputs=True):
        model = build_model(with_layers(config, blocks), TrainingSetup(precision="bf16-true", attn="sdpa", seq=tokens,
                                                                       allow_long_seq=True))
        model.eval()
        decoder = model.get_decoder()
        ids = torch.randint(0, int(config.vocab_size), (1, tokens))

        def forward() -> None:
            with torch.no_grad(), kernels_as_on_cuda():
                decoder(input_ids=ids, use_cache=False)

        trace = capture(forward, model=model, inputs={"input_ids": ids})
    peak, event = trace.peak()
    made = trace.live_at(event) & (trace.buffers["alloc_op"] >= 0)
    op = int(trace.events["op"][event])
    return int(trace.buffers["nbytes"][made].sum()), trace.op_name(op), \
        trace.module_of_buffer(int(trace.events["buffer"][event]))


def row(name: str) -> dict[str, Any]:
    from memplan.inference.activation import profile_activation
    from memplan.models.registry import load_config

    config = load_config(name)
    start = time.perf_counter()
    modelled = profile_activation(config, 1, TOKENS, min(TOKENS, 1024), 2)
    traced, op, module = hf_forward_activation(config, TOKENS, BLOCKS)
    return {"model": name, "modelled": modelled.forward_bytes, "traced": traced, "op": op, "module": module,
            "per_token_modelled": modelled.forward_bytes / TOKENS / 2, "per_token_traced": traced / TOKENS / 2,
            "seconds": time.perf_counter() - start}


def table(rows: list[dict[str, Any]], depth_check: tuple[int, int]) -> str:
    lines = ["## Serving: modelled vLLM forward peak vs the traced Hugging Face forward", "",
             f"Reproduce: `{COMMAND}`. One sequence of {TOKENS} tokens, bf16, TP 1; vLLM's modelled forward peak "
             "(`profile_activation(...).forward_bytes`, fused QKV / gate-up, in-place residual, no attention "
             "matrix) against the activation peak of transformers' decoder forward under `no_grad`, traced on "
             f"fake tensors at {BLOCKS} blocks (SDPA as on CUDA), without the LM head. Elements per token are "
             "bytes / tokens / 2. docs/serving.md explains the differences.", "",
             "| model | vLLM modelled | HF traced | HF / vLLM | elements per token, vLLM / HF | HF peak at |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['modelled'] / 2**20:.0f} MiB | {r['traced'] / 2**20:.0f} MiB | "
                     f"{r['traced'] / r['modelled']:.2f}x | {r['per_token_modelled']:.0f} / "
                     f"{r['per_token_traced']:.0f} | `{r['op']}` in `{r['module']}` |")
    two, four = depth_check
    lines += ["", f"Depth: {rows[0]['model']}'s traced peak at 2 blocks {two / 2**20:.1f} MiB, at 4 blocks "
                  f"{four / 2**20:.1f} MiB."]
    return "\n".join(lines)


def main() -> None:
    from memplan.models.registry import load_config

    rows = []
    for name in MODELS:
        rows.append(row(name))
        r = rows[-1]
        print(f"{name}: modelled {r['modelled'] / 2**20:.0f} MiB, traced {r['traced'] / 2**20:.0f} MiB at {r['op']} "
              f"in {r['module']} ({r['seconds']:.0f} s)", flush=True)
    depth = (rows[0]["traced"], hf_forward_activation(load_config(MODELS[0]), TOKENS, 2 * BLOCKS)[0])
    assert np.isclose(*depth, rtol=0.01), f"the traced peak grows with depth: {depth}"
    write_section("serve_activation", table(rows, depth))
    print(table(rows, depth))


if __name__ == "__main__":
    main()
