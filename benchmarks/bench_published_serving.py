"""`memplan serve` against published vLLM and SGLang start-up logs.

The cases, their sources (URL and the quoted log lines) and what each source leaves
unstated (`guessed`) are data in `benchmarks/published_serving.json`; nothing in memplan
is tuned to them. For each case this script runs `memplan.estimate_serving` with the
stated settings (the total memory the log prints, where it prints one, as `capacity`) and
compares:

- weights: memplan's loader layout against "Model loading took" / "model weights take";
- KV tokens from the published available memory: memplan's page and block arithmetic
  applied to the logged "Available KV cache memory" (isolates the KV math);
- available KV memory and KV tokens predicted end to end (weights, activation model,
  non-torch terms, budget rule of the version).

Error is (memplan - published) / published. Writes the `bench:published_serving` table of
BENCHMARKS.md.

    .venv/bin/python benchmarks/bench_published_serving.py
"""

import json
from pathlib import Path

from benchmarks_md import write_section
from memplan.inference import estimate_serving

GIB = 1 << 30
CASES = Path(__file__).with_name("published_serving.json")


def _error(ours, published):
    return "-" if published is None else f"{(ours - published) / published:+.1%}"


def _kv_tokens_from_published(case, result):
    """Tokens memplan's KV arithmetic gives for the logged available memory."""
    available = case["published"].get("available_kv_gib")
    if available is None or "kv_tokens" not in case["published"]:
        return None
    if case["engine"] == "sglang":
        return int(available * GIB // result.kv["cell_bytes"])
    settings = {**case["settings"], "kv_cache_memory_bytes": int(available * GIB)}
    return estimate_serving(case["model"], case["engine"], case["gpu"], engine_version=case["engine_version"],
                            **_kwargs(case, settings)).kv["tokens"]


def _kwargs(case, settings):
    out = dict(settings)
    if "capacity_gib" in case:
        out["capacity"] = int(case["capacity_gib"] * GIB)
    return out


def row(case):
    result = estimate_serving(case["model"], case["engine"], case["gpu"], engine_version=case["engine_version"],
                              **_kwargs(case, case["settings"]))
    pub = case["published"]
    weights = result.weights.total_bytes / GIB
    available = result.kv_available_bytes / GIB
    from_pub = _kv_tokens_from_published(case, result)
    tokens = result.kv["tokens"]
    return [f"[{case['id']}]({case['url']})", f"{case['engine']} {case['engine_version']}",
            f"{weights:.2f} / {pub.get('weights_gib', '-')} ({_error(weights, pub.get('weights_gib'))})",
            "-" if from_pub is None else f"{from_pub:,} / {pub['kv_tokens']:,} ({_error(from_pub, pub['kv_tokens'])})",
            f"{available:.2f} / {pub.get('available_kv_gib', '-')} ({_error(available, pub.get('available_kv_gib'))})",
            f"{tokens:,} / " + (f"{pub['kv_tokens']:,} ({_error(tokens, pub['kv_tokens'])})" if "kv_tokens" in pub
                                else "-"),
            f"{result.activation.total_bytes / GIB:.2f}", "; ".join(case["guessed"])]


def main():
    cases = json.loads(CASES.read_text())["cases"]
    header = ["case", "engine", "weights GiB (memplan / log)", "KV tokens from the logged KV GiB",
              "available KV GiB", "KV tokens end to end", "activation GiB (model)", "guessed"]
    rows = [row(c) for c in cases]
    lines = ["## Published serving logs (`bench:published_serving`)", "",
             "`memplan serve` against vLLM / SGLang start-up logs (benchmarks/published_serving.json). Error = "
             "(memplan - log) / log. Reproduce: `.venv/bin/python benchmarks/bench_published_serving.py`.", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    write_section("published_serving", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
