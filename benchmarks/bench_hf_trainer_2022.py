"""What separates the Transformers docs' bert-large Trainer series, measured in 2022, from the
same script under today's Trainer (`memplan run`, benchmarks/published_runs/hf_trainer.py).

The page ("Efficient Training on a Single GPU", transformers v4.16-v4.25,
docs/source/en/perf_train_gpu_one.mdx at huggingface/transformers@0016acf7ef42) ran on a V100
with PyTorch 1.10; `memplan run` traces its script under transformers 5.23 and PyTorch 2.13,
whose defaults differ in three ways that decide memory (each case's `guessed` in
benchmarks/published_gpu.json says which 2022 setting is taken):

- attention: BERT's SDPA path today, eager in 2022 (softmax probabilities and their dropout
  mask saved for the backward, per layer);
- `model.zero_grad()` after each step: frees the gradients today (set_to_none, PyTorch >= 2.0),
  kept them allocated as zeros in PyTorch 1.10;
- the Trainer's default AdamW: fused `torch.optim.AdamW` (adamw_torch_fused) today,
  transformers.AdamW's per-parameter loop (adamw_hf) in 2022.

For each case this script runs `memplan estimate` of today's setup (the setup the run saw) and
of today's setup with one 2022 setting at a time, and gives device used with the page's own
measured CUDA context (1343 MiB) in place of the profile's: the difference each 2022 setting
makes, beside the run through the trainer (its stored row in
benchmarks/results/published_gpu/, from bench_published_gpu.py) and the published figure.
Writes the `bench:hf_trainer_2022` table of BENCHMARKS.md.

    .venv/bin/python benchmarks/bench_hf_trainer_2022.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_published_gpu import CASES_JSON, figure_bytes, published_bytes, stored_row  # noqa: E402
from benchmarks_md import write_section  # noqa: E402
from memplan import models  # noqa: E402
from memplan.estimation import estimate  # noqa: E402
from memplan.parallel import Layout  # noqa: E402

MARK = "hf_trainer_2022"
PREFIX = "hf-trainer-bert-large-"
MIB = 2**20


def today_setup(case: dict[str, Any]) -> dict[str, str]:
    """The settings today's Trainer runs the case's script with, where they differ from 2022's."""
    today = {"attn": "sdpa", "zero_grad": "none"}
    if case["setup"]["optimizer"] == "adamw":
        today["optimizer_impl"] = "fused"
    return today


def device_used_bytes(case: dict[str, Any], overrides: dict[str, str], cache: dict) -> int:
    """Device used of the case's setup with `overrides`, with the source's measured context."""
    setup = models.TrainingSetup.from_dict({**case["setup"], **overrides})
    return estimate(case["model"], setup, Layout(**case["layout"]), device="cuda", gpu=case["gpu"], cache=cache,
                    cuda_context=figure_bytes(case["context_measured"])).device_used_bytes


def case_row(case: dict[str, Any]) -> dict[str, Any]:
    """Today's figure and the MiB each 2022 setting adds to it, alone."""
    cache: dict[Any, Any] = {}
    today = today_setup(case)
    base = device_used_bytes(case, today, cache)
    added = {key: device_used_bytes(case, {k: v for k, v in today.items() if k != key}, cache) - base
             for key in today}
    stored = stored_row(case["id"]) or {}
    trainer = stored.get("trainer") or {}
    return {"id": case["id"], "published": published_bytes(case), "today": base, "added": added,
            "all_2022": device_used_bytes(case, {}, cache), "run": trainer.get("with_source_context_bytes")}


def _mib_error(nbytes: int | None, published: int) -> str:
    if nbytes is None:
        return "-"
    return f"{nbytes / MIB:.0f} ({100.0 * (nbytes - published) / published:+.1f}%)"


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        f"<!-- bench:{MARK} -->",
        "The Transformers docs' bert-large Trainer series (V100, 2022) against today's Trainer: device used "
        "in MiB with the page's measured CUDA context (1343 MiB), `memplan run` of the page's script (stored "
        "row of bench:published_gpu), `memplan estimate` of today's setup (SDPA, gradients freed by zero_grad, "
        "fused AdamW), the MiB each 2022 setting adds to it alone (eager attention, gradients kept as zeros, "
        "AdamW loop), and the estimate with all of them (the flag-built column of bench:published_gpu). "
        "Reproduce with: `.venv/bin/python benchmarks/bench_hf_trainer_2022.py`.",
        "",
        "| case | published | memplan run | estimate, today | + eager attn | + zeros grads | + AdamW loop "
        "| estimate, 2022 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        added = [f"{r['added'][k] / MIB:+.0f}" if k in r["added"] else "-"
                 for k in ("attn", "zero_grad", "optimizer_impl")]
        lines.append(f"| {r['id'].removeprefix(PREFIX)} | {r['published'] / MIB:.0f} | "
                     f"{_mib_error(r['run'], r['published'])} | {_mib_error(r['today'], r['published'])} | "
                     + " | ".join(added) + f" | {_mib_error(r['all_2022'], r['published'])} |")
    lines.append(f"<!-- /bench:{MARK} -->")
    return "\n".join(lines)


def main() -> int:
    cases = [c for c in json.loads(CASES_JSON.read_text())["cases"] if c["id"].startswith(PREFIX)]
    rows = []
    for case in cases:
        rows.append(case_row(case))
        print(rows[-1], flush=True)
    write_section(MARK, table(rows))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
