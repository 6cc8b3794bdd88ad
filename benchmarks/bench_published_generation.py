"""`memplan generate` against published peak-memory measurements of transformers generate() calls.

The cases, their sources (URL and the quoted figure), the metric each source printed and the
setup details each source leaves unstated (`guessed`) are data, in
`benchmarks/published_generation.json`; nothing in memplan is tuned to them. For each case
this script runs `memplan.estimate_generation(config, generation, setup, device="cuda",
gpu=...)` and compares `max_memory_allocated` with `peak_allocated_bytes`. A case memplan
refuses (a `UserError`, e.g. bitsandbytes' CUDA int8 matmul) stays in the table with the
reason. Error is (memplan - published) / published. Writes the `bench:published_generation`
table of BENCHMARKS.md.

    .venv/bin/python benchmarks/bench_published_generation.py
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks_md import write_section  # noqa: E402
from memplan.errors import UserError  # noqa: E402
from memplan.inference.gen_capture import GenerationSetup  # noqa: E402
from memplan.inference.generate import estimate_generation  # noqa: E402

CASES_JSON = Path(__file__).resolve().parent / "published_generation.json"
COMMAND = ".venv/bin/python benchmarks/bench_published_generation.py"
UNIT_BYTES = {"B": 1, "GB": 10**9, "GiB": 2**30, "MB": 10**6, "MiB": 2**20}


def config_of(name: str, configs: dict[str, Any]) -> Any:
    """The transformers config a case names, from the JSON's `configs` (no download)."""
    from transformers import AutoConfig

    data = {k: v for k, v in configs[name].items() if not k.startswith("_")}
    config = AutoConfig.for_model(**data)
    config.name_or_path = name
    return config


def run_case(case: dict[str, Any], configs: dict[str, Any]) -> dict[str, Any]:
    """One row: the published figure, memplan's, the error (or why memplan refused)."""
    published = case["value"] * UNIT_BYTES[case["unit"]]
    row = {"id": case["id"], "published_gib": published / 2**30, "gpu": case["gpu"]}
    start = time.perf_counter()
    try:
        result = estimate_generation(config_of(case["model"], configs), GenerationSetup(**case["generation"]),
                                     case["setup"], device="cuda", gpu=case["gpu"])
    except UserError as exc:
        return {**row, "memplan_gib": None, "error": None, "note": f"refused: {exc}"}
    row.update(memplan_gib=result.peak_allocated_bytes / 2**30,
               error=(result.peak_allocated_bytes - published) / published, phase=result.peak_phase,
               seconds=time.perf_counter() - start, note="; ".join(case.get("guessed", [])))
    return row


def table(rows: list[dict[str, Any]]) -> str:
    errors = [abs(r["error"]) for r in rows if r["error"] is not None]
    lines = ["## Published generation peaks (`memplan generate`)", "",
             f"Reproduce: `{COMMAND}` (cases and sources: benchmarks/published_generation.json). Metric: "
             "torch.cuda.max_memory_allocated against memplan's peak allocated.", "",
             "| case | gpu | published GiB | memplan GiB | error | phase | notes |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        mine = "-" if r["memplan_gib"] is None else f"{r['memplan_gib']:.3f}"
        err = "-" if r["error"] is None else f"{100 * r['error']:+.2f}%"
        lines.append(f"| {r['id']} | {r['gpu']} | {r['published_gib']:.3f} | {mine} | {err} | {r.get('phase', '-')} "
                     f"| {r['note']} |")
    if errors:
        lines += ["", f"{len(errors)} of {len(rows)} cases estimated: median |error| "
                      f"{100 * statistics.median(errors):.2f}%, mean {100 * statistics.mean(errors):.2f}%."]
    return "\n".join(lines)


def main() -> None:
    data = json.loads(CASES_JSON.read_text())
    rows = []
    for case in data["cases"]:
        rows.append(run_case(case, data["configs"]))
        sys.stderr.write(f"{case['id']}: {rows[-1]}\n")
    section = table(rows)
    print(section)
    write_section("published_generation", section)


if __name__ == "__main__":
    main()
