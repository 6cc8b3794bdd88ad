"""CPU ground truth for parallel layouts: `memplan estimate --device cpu --allocator none`
per rank against real multi-process gloo runs measured with torch.profiler on every rank.

Each case starts `world_size` processes (torch.multiprocessing spawn, gloo backend),
applies the layout with `memplan.parallel.apply` (DDP, FSDP2 `fully_shard`, HSDP, DTensor
TP, FSDP2 + TP, DDP + TP, FSDP1 `FullyShardedDataParallel`, CP with FSDP2: `memplan.parallel.context`) or runs PyTorch's
pipeline schedule (`memplan.parallel.schedules`), runs one warm-up step and profiles the next on every rank
(`memplan.parallel.groundtruth.measure_rank_peaks`). The estimate traces the parallel
step on a fake process group where it can (column "estimate path": traced) and applies
the modelled rules otherwise (modelled), or traces the TP part and models DDP's buckets on
it (traced + modelled); TP it cannot trace is refused (exit 2), and the row
says so next to the real run's outcome. Tiny configs (`memplan.models.tiny_config`),
batch 2, sequence 32, AdamW foreach. Writes the `bench:parallel_groundtruth` table.

    .venv/bin/python benchmarks/bench_parallel_groundtruth.py --repeats 3
    .venv/bin/python benchmarks/bench_parallel_groundtruth.py --repeats 3 --only "CP 2" "FSDP2 2 x CP 2"
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks_md import BENCHMARKS_MD, write_section  # noqa: E402
from memplan import models  # noqa: E402
from memplan.errors import UserError  # noqa: E402
from memplan.estimation import estimate  # noqa: E402
from memplan.parallel import Layout  # noqa: E402
from memplan.parallel.groundtruth import measure_rank_peaks  # noqa: E402

MARK = "parallel_groundtruth"
LAYOUTS = {
    "DDP x2": {"world_size": 2},
    "FSDP2 x2": {"world_size": 2, "zero": 3},
    "TP 2": {"tp": 2},
    "FSDP2 x4": {"world_size": 4, "zero": 3},
    "FSDP2 2 x TP 2": {"world_size": 4, "zero": 3, "tp": 2},
    "DDP 2 x TP 2": {"world_size": 4, "tp": 2},
    "FSDP2 x2, bf16 params": {"world_size": 2, "zero": 3, "fsdp_param_dtype": "bf16"},
    "HSDP 2 x 2": {"world_size": 4, "zero": 3, "shard_size": 2},
    "FSDP1 x2": {"world_size": 2, "zero": 3, "engine": "fsdp1"},
    "FSDP1 x2, bf16 params": {"world_size": 2, "zero": 3, "engine": "fsdp1", "fsdp_param_dtype": "bf16"},
    "CP 2": {"cp": 2, "zero": 3},
    "FSDP2 2 x CP 2": {"world_size": 4, "cp": 2, "zero": 3},
    "PP 2 interleaved 1F1B": {"pp": 2, "microbatches": 4, "schedule": "interleaved"},
    "PP 2 interleaved ZB": {"pp": 2, "microbatches": 4, "schedule": "interleaved-zb"},
    "PP 2 ZB-V": {"pp": 2, "microbatches": 4, "schedule": "zbv"},
    "PP 2 x TP 2 interleaved 1F1B": {"pp": 2, "tp": 2, "microbatches": 4, "schedule": "interleaved"},
    "FSDP2 x EP 2": {"world_size": 2, "zero": 3, "ep": 2},
    "FSDP2 2 x TP 2, EP 2": {"world_size": 4, "zero": 3, "tp": 2, "ep": 2},
}
PIPELINE_BLOCKS = 4  # two chunks of one block per pipeline rank under the multi-stage schedules
EXPERT_LAYOUTS = ("FSDP2 x EP 2", "FSDP2 2 x TP 2, EP 2")
OPTIONS = {
    "": {},
    "ckpt": {"checkpointing": "full"},
    "LoRA r4": {"lora_rank": 4},
    "LoRA r4 (q, o, down)": {"lora_rank": 4, "lora_targets": ("q_proj", "o_proj", "down_proj")},
    "bf16 autocast": {"precision": "bf16-mixed"},
    "routing worst": {"routing": "worst"},
}
CASES = (
    [("llama-2-7b", opt, lay) for opt in OPTIONS for lay in ("DDP x2", "FSDP2 x2", "TP 2")]
    + [("llama-2-7b", opt, lay) for opt in ("", "ckpt") for lay in ("FSDP2 x4", "FSDP2 2 x TP 2", "DDP 2 x TP 2")]
    + [("llama-2-7b", "", "HSDP 2 x 2")]
    + [("llama-2-7b", opt, "FSDP2 x2, bf16 params") for opt in ("", "ckpt")]
    + [("llama-2-7b", "LoRA r4 (q, o, down)", lay) for lay in ("TP 2", "FSDP2 2 x TP 2", "DDP 2 x TP 2")]
    + [("mistral-7b", "", lay) for lay in ("DDP x2", "FSDP2 x2", "TP 2", "FSDP2 2 x TP 2", "DDP 2 x TP 2")]
    + [("qwen2.5-0.5b", "ckpt", lay) for lay in ("FSDP2 x2", "TP 2")]
    + [("qwen2.5-0.5b", "", lay) for lay in ("TP 2", "FSDP2 2 x TP 2", "DDP 2 x TP 2")]
    + [("gpt2", "", lay) for lay in ("DDP x2", "FSDP2 x2", "TP 2")]
    + [("opt-125m", "bf16 autocast", lay) for lay in ("DDP x2", "FSDP2 x2")]
    + [("llama-2-7b", opt, "FSDP1 x2") for opt in ("", "ckpt", "LoRA r4")]
    + [("llama-2-7b", "", "FSDP1 x2, bf16 params")]
    + [("llama-2-7b", opt, "CP 2") for opt in ("", "ckpt", "bf16 autocast")]
    + [("llama-2-7b", opt, "FSDP2 2 x CP 2") for opt in ("", "ckpt")]
    + [("llama-2-7b", opt, lay) for opt in ("", "ckpt")
       for lay in ("PP 2 interleaved 1F1B", "PP 2 interleaved ZB", "PP 2 ZB-V")]
    + [("llama-2-7b", "", "PP 2 x TP 2 interleaved 1F1B")]
    + [("mixtral-8x7b", "", lay) for lay in EXPERT_LAYOUTS]
    + [("mixtral-8x7b", "routing worst", "FSDP2 x EP 2"), ("qwen3-30b-a3b", "", "FSDP2 x EP 2")]
)
SKEWED_ROUTING = ("Under `routing worst` every token goes to experts 0 and 1, which EP rank 0 holds: the estimate is that "
                  "rank's, the most loaded one, a bound for the others (rank 1 receives no token and is below it by "
                  "design; the largest-error line counts EP rank 0 only for such rows).")


def _row(family: str, option: str, layout_name: str, repeats: int) -> str:
    """One case's table row: the estimate against the real run's per-rank medians."""
    layout = Layout(**LAYOUTS[layout_name])
    config = models.tiny_config(family, **({"num_hidden_layers": PIPELINE_BLOCKS} if layout.pp > 1 else {}))
    setup = models.TrainingSetup(batch=2, seq=32, optimizer_impl="foreach", **{"precision": "32-true", **OPTIONS[option]})
    head = f"| {family} | {option or '-'} | {layout_name} |"
    try:
        result = estimate(config, setup, layout, device="cpu", allocator="none")
    except UserError as exc:  # the estimate refuses what it cannot trace: a row, with the real run's fate
        result, refused = None, f"refused (exit 2): {exc}"
    try:
        runs = [measure_rank_peaks([(config, setup, layout)])[0] for _ in range(repeats)]
    except Exception as exc:  # noqa: BLE001 - a failed real run is a row of the table, not the end of it
        reason = str(exc).strip().splitlines()[-1][:120]
        figure = f"{result.per_rank[0].peak_allocated_bytes:,}" if result is not None else refused
        return f"{head} {result.parallel if result else '-'} | real run failed: {reason} | {figure} | - |"
    real = [int(statistics.median(run[r] for run in runs)) for r in range(layout.world_size)]
    if result is None:
        return f"{head} - | {', '.join(f'{x:,}' for x in real)} | {refused} | - |"
    per_rank = {r: est.peak_allocated_bytes for est in result.per_rank for r in (est.ranks or [est.rank])}
    predicted = [per_rank[r] for r in range(layout.world_size)]
    errors = [100 * (predicted[r] - real[r]) / real[r] for r in range(layout.world_size)]
    shown = predicted if len(set(predicted)) > 1 else predicted[:1]  # one figure where every rank has it
    return (f"{head} {result.parallel} | {', '.join(f'{x:,}' for x in real)} | "
            f"{', '.join(f'{x:,}' for x in shown)} | {', '.join(f'{e:+.3f}' for e in errors)} |")


def _key(row: str) -> tuple[str, ...]:
    return tuple(cell.strip() for cell in row.strip("|").split("|")[:3])


def _merged(rows: list[str]) -> list[str]:
    """The table's rows in BENCHMARKS.md with `rows` in place of the same cases (appended
    where new): what an `--only` run writes."""
    text = BENCHMARKS_MD.read_text() if BENCHMARKS_MD.exists() else ""
    start, end = f"<!-- bench:{MARK} -->", f"<!-- /bench:{MARK} -->"
    section = text[text.index(start):text.index(end)] if start in text and end in text else ""
    old = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| model |")]
    new = {_key(r): r for r in rows}
    merged = [new.pop(_key(r), r) for r in old]
    return merged + [r for r in rows if _key(r) in new]


def _full_run_repeats() -> str:
    """The repeats of the full run whose table is in BENCHMARKS.md (its command line)."""
    import re

    text = BENCHMARKS_MD.read_text() if BENCHMARKS_MD.exists() else ""
    match = re.search(r"bench_parallel_groundtruth\.py(?: --repeats (\d+))?`", text)
    return (match.group(1) or "1") if match else "?"


def _worst(rows: list[str]) -> dict[str, float]:
    """Largest |error| per estimate path over the rows."""
    worst: dict[str, float] = {}
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        if cells[3] == "-" or cells[6] == "-":
            continue
        errors = [abs(float(e)) for e in cells[6].split(",")]
        if OPTIONS.get(cells[1], {}).get("routing", "balanced") != "balanced":  # SKEWED_ROUTING: EP rank 0's
            errors = errors[::LAYOUTS.get(cells[2], {}).get("ep", 1)]
        error = max(errors)
        worst[cells[3]] = max(worst.get(cells[3], 0.0), error)
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--quick", action="store_true", help="the first 3 cases only")
    parser.add_argument("--only", nargs="+", metavar="LAYOUT",
                        help="only the cases of these layouts (names as in the table); their rows replace or join "
                             "the table's others in BENCHMARKS.md")
    parser.add_argument("--repeats", type=int, default=1,
                        help="fresh-process measurements per case; the table shows per-rank medians")
    args = parser.parse_args()
    cases = CASES[:3] if args.quick else [c for c in CASES if not args.only or c[2] in args.only]
    start = time.perf_counter()
    rows = []
    for family, option, layout_name in cases:
        rows.append(_row(family, option, layout_name, args.repeats))
        print(rows[-1], flush=True)
    elapsed = f"{time.perf_counter() - start:.0f} s"
    runs = f"{args.repeats} fresh-process run(s) per case"
    if args.only:
        rows = _merged(rows)
        elapsed += f" for the {len(cases)} cases of `--only`, merged into the full run's table"
        runs += f" for the `--only` cases, {_full_run_repeats()} for the others"
    worst = _worst(rows)
    text = (
        "### Parallel layouts: estimate vs real gloo runs, every rank (CPU ground truth)\n\n"
        "Command: `.venv/bin/python benchmarks/bench_parallel_groundtruth.py"
        + (f" --repeats {args.repeats}" if args.repeats != 1 else "") + "`"
        + (f" (and `--only {' '.join(args.only)}`)" if args.only else "") + "\n\n"
        "Real: peak of torch.profiler's memory timeline over one step (after a warm-up step) on each rank of a "
        "multi-process gloo run (torch.multiprocessing spawn; DDP, FSDP2 `fully_shard` (bf16 params: its "
        "`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`), DTensor TP with the "
        "Llama plan, FSDP2 + TP and DDP + TP on a 2-D mesh; CP: PyTorch's `context_parallel` ring attention with "
        "FSDP2 over the data-parallel x CP ranks; EP: transformers' expert-parallel plan and all-to-all with "
        "FSDP2; PP: PyTorch's `torch.distributed.pipelining` schedules, two "
        "chunks of one block per rank (4 blocks), 4 micro-batches). Estimate: `estimate(..., device=\"cpu\", "
        "allocator=\"none\")` (one figure where every rank has it, else one per rank); *traced* = the parallel "
        "step itself traced on a fake process group, *modelled* = "
        "rules over the single-device trace, *traced + modelled* = the TP step traced with DDP's parameter "
        "transform, DDP's gradient buckets modelled on it (DDP's reducer cannot run on a fake group). Tiny configs, "
        "batch 2, sequence 32, AdamW foreach, "
        f"{runs}, per-rank median "
        f"({elapsed} on 2 cores). Error = (estimate - real) / real, per rank.\n\n"
        "| model | options | layout | estimate path | real peak per rank (B) | estimate (B) | error per rank (%) |\n"
        "|---|---|---|---|---:|---:|---:|\n" + "\n".join(rows) + "\n\n"
        + "Largest error on any rank: " + ", ".join(f"{k} {v:.3f}%" for k, v in sorted(worst.items())) + ".\n\n"
        + SKEWED_ROUTING + "\n"
    )
    print(text)
    if not args.no_write:
        write_section(MARK, text)


if __name__ == "__main__":
    main()
