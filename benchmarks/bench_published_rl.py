"""`memplan rl` against published GPU-memory readings of RL post-training runs.

The cases, their sources (URL and the quoted figure), the metric each source read and the
settings each source leaves unstated (`guessed`) are data, in `benchmarks/published_rl.json`;
nothing in memplan is tuned to them. For each case this script runs
`memplan.estimate_rl(config, algo, trainer, ...)` with the case's settings on the case's GPU
profile and compares the reading with memplan's peak phase (the phase that needs the most
memory): an `nvidia_smi` reading with the phase's device memory (`device_used_bytes`,
PyTorch's cache and the CUDA context included), a `max_memory_allocated` reading with what
PyTorch's allocator holds allocated in it (its torch items less the free cache). A case memplan
refuses (a `UserError`) stays in the table with the reason. Error is
(memplan - published) / published; the summary is the median |error|. Writes the
`bench:published_rl` table of BENCHMARKS.md.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_published_rl.py
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks_md import write_section  # noqa: E402
from memplan.errors import UserError  # noqa: E402
from memplan.models.setup import TrainingSetup  # noqa: E402
from memplan.parallel.layout import Layout  # noqa: E402
from memplan.rl import estimate_rl  # noqa: E402
from memplan.rl.phases import Phase  # noqa: E402

CASES_JSON = Path(__file__).resolve().parent / "published_rl.json"
COMMAND = "PYTHONPATH=src .venv/bin/python benchmarks/bench_published_rl.py"
UNIT_BYTES = {"B": 1, "GB": 10**9, "GiB": 2**30, "MB": 10**6, "MiB": 2**20}
RUN_KEYS = ("rollout", "prompt_len", "completion_len", "num_generations", "beta", "reference")


def model_path(name: str, configs: dict[str, Any], directory: Path) -> str:
    """A registry name as it is, or the JSON's config written as a config.json (no download)."""
    if name not in configs:
        return name
    from transformers import AutoConfig

    config = AutoConfig.for_model(**{k: v for k, v in configs[name].items() if not k.startswith("_")})
    target = directory / name.replace("/", "--")
    config.save_pretrained(target)
    return str(target / "config.json")


def phase_reading(phase: Phase, metric: str) -> int:
    """The peak phase's figure for the metric the source read."""
    if metric == "nvidia_smi":
        return phase.device_used_bytes
    return sum(i.bytes for i in phase.items if i.allocator == "torch" and i.kind != "cached")


def run_case(case: dict[str, Any], configs: dict[str, Any], directory: Path) -> dict[str, Any]:
    """One row: the published figure, memplan's peak phase and its figure, the error."""
    published = case["value"] * UNIT_BYTES[case["unit"]]
    row = {"id": case["id"], "published_gib": published / 2**30, "gpu": case["gpu"], "metric": case["metric"],
           "note": "; ".join(case.get("guessed", []))}
    start = time.perf_counter()
    try:
        result = estimate_rl(model_path(case["model"], configs, directory), case["algo"], case["trainer"],
                             setup=TrainingSetup(**case["setup"]), layout=Layout(**case["layout"]), gpu=case["gpu"],
                             **{k: case[k] for k in RUN_KEYS if k in case})
    except UserError as exc:
        return {**row, "memplan_gib": None, "error": None, "phase": None, "note": f"refused: {exc}"}
    peak = result.peak_phase
    ours = phase_reading(peak, case["metric"])
    row.update(memplan_gib=ours / 2**30, error=(ours - published) / published, phase=peak.name,
               fits=result.fits, seconds=time.perf_counter() - start,
               phases={p.name: round(phase_reading(p, case["metric"]) / 2**30, 2) for p in result.phases})
    return row


def table(rows: list[dict[str, Any]], cases: list[dict[str, Any]]) -> str:
    by_id = {c["id"]: c for c in cases}
    errors = [abs(r["error"]) for r in rows if r["error"] is not None]
    median = statistics.median(errors) if errors else None
    lines = ["## Published RL runs (`bench:published_rl`)", "",
             "`memplan rl` against published GPU-memory readings of RL runs (cases, sources, quotes and the settings "
             "each source leaves unstated: `benchmarks/published_rl.json`). memplan's figure is its peak phase's: "
             "device memory for an nvidia-smi reading, PyTorch's allocated bytes for a max_memory_allocated one. "
             f"Error = (memplan - published) / published. Reproduce: `{COMMAND}`.", "",
             "| case | source | run | GPU | metric | published GiB | memplan GiB (peak phase) | error | phases (GiB) "
             "| guessed |", "|---|---|---|---|---|---:|---:|---:|---|---|"]
    for r in rows:
        c = by_id[r["id"]]
        run = (f"{c['algo']} {c['trainer']}, {c['model']}, rollout {c['rollout']}, P {c['prompt_len']} + C "
               f"{c['completion_len']}, setup {json.dumps(c['setup'], separators=(',', ':'))}")
        ours = "refused" if r["memplan_gib"] is None else f"{r['memplan_gib']:.2f} ({r['phase']})"
        error = "" if r["error"] is None else f"{r['error']:+.1%}"
        phases = ", ".join(f"{k} {v}" for k, v in r.get("phases", {}).items())
        lines.append(f"| {r['id']} | [{c['source'].split(' ')[0]}]({c['source'].split(' ')[0]}) | {run} | {r['gpu']} "
                     f"| {r['metric']} | {r['published_gib']:.2f} | {ours} | {error} | {phases} | {r['note']} |")
    lines += ["", f"Median |error| over {len(errors)} estimated cases: "
              + ("n/a" if median is None else f"{median:.1%}") + " (goal: 5%)."]
    return "\n".join(lines)


def main() -> None:
    data = json.loads(CASES_JSON.read_text())
    with tempfile.TemporaryDirectory() as d:
        rows = [run_case(case, data["configs"], Path(d)) for case in data["cases"]]
    text = table(rows, data["cases"])
    write_section("published_rl", text)
    print(text)
    print(json.dumps(rows, indent=1, default=str))


if __name__ == "__main__":
    main()
