"""CPU ground truth for parallel layouts: `memplan estimate --device cpu --allocator none`
per rank against real multi-process gloo runs measured with torch.profiler on every rank.

Each case starts `world_size` processes (torch.multiprocessing spawn, gloo backend),
applies the layout with `memplan.parallel.apply` (DDP, FSDP2 `fully_shard`, HSDP, DTensor
TP, FSDP2 + TP, DDP + TP), runs one warm-up step and profiles the next on every rank
(`memplan.parallel.groundtruth.measure_rank_peaks`). The estimate traces the parallel
step on a fake process group where it can (column "estimate path": traced) and applies
the modelled rules otherwise (modelled), or traces the TP part and models DDP's buckets on
it (traced + modelled); TP it cannot trace is refused (exit 2), and the row
says so next to the real run's outcome. Tiny configs (`memplan.models.tiny_config`),
batch 2, sequence 32, AdamW foreach. Writes the `bench:parallel_groundtruth` table.

    .venv/bin/python benchmarks/bench_parallel_groundtruth.py --repeats 3
"""

from __future__ import annotations

import argparse
import re
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
    "FSDP2 x EP 2": {"world_size": 2, "zero": 3, "ep": 2},
    "FSDP2 2 x TP 2, EP 2": {"world_size": 4, "zero": 3, "tp": 2, "ep": 2},
}
EXPERT_LAYOUTS = ("FSDP2 x EP 2", "FSDP2 2 x TP 2, EP 2")
OPTIONS = {
    "": {},
    "ckpt": {"checkpointing": "full"},
    "LoRA r4": {"lora_rank": 4},
    "LoRA r4 (q, o, down)": {"lora_rank": 4, "lora_targets": ("q_proj", "o_proj", "down_proj")},
    "bf16 autocast": {"autocast": "bf16"},
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
    + [("mixtral-8x7b", "", lay) for lay in EXPERT_LAYOUTS]
    + [("mixtral-8x7b", "routing worst", "FSDP2 x EP 2"), ("qwen3-30b-a3b", "", "FSDP2 x EP 2")]
)
SKEWED_ROUTING = ("Under `routing worst` every token goes to experts 0 and 1, which EP rank 0 holds: the estimate is that "
                  "rank's, the most loaded one, a bound for the others (rank 1 receives no token and is below it by "
                  "design; the largest-error line counts EP rank 0 only for such rows).")
ROW_KEY = re.compile(r"^\| ([^|]+) \| ([^|]+) \| ([^|]+) \|")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--quick", action="store_true", help="the first 3 cases only")
    parser.add_argument("--layouts", nargs="+", default=None, metavar="NAME",
                        help="run only the cases of these layouts and merge their rows into the existing table")
    parser.add_argument("--repeats", type=int, default=1,
                        help="fresh-process measurements per case; the table shows per-rank medians")
    args = parser.parse_args()
    rows = []
    worst: dict[str, float] = {}
    start = time.perf_counter()
    cases = CASES[:3] if args.quick else CASES
    if args.layouts:
        cases = [case for case in cases if case[2] in args.layouts]
    for family, option, layout_name in cases:
        config = models.tiny_config(family)
        setup = models.TrainingSetup(batch=2, seq=32, optimizer_impl="foreach", **OPTIONS[option])
        layout = Layout(**LAYOUTS[layout_name])
        try:
            result = estimate(config, setup, layout, device="cpu", allocator="none")
        except UserError as exc:  # the estimate refuses what it cannot trace: a row, with the real run's fate
            result, refused = None, f"refused (exit 2): {exc}"
        try:
            runs = [measure_rank_peaks([(config, setup, layout)])[0] for _ in range(args.repeats)]
        except Exception as exc:  # noqa: BLE001 - a failed real run is a row of the table, not the end of it
            reason = str(exc).strip().splitlines()[-1][:120]
            figure = f"{result.per_rank[0].peak_allocated_bytes:,}" if result is not None else refused
            row = (f"| {family} | {option or '-'} | {layout_name} | {result.parallel if result else '-'} | "
                   f"real run failed: {reason} | {figure} | - |")
            print(row, flush=True)
            rows.append(row)
            continue
        if result is None:
            real = [int(statistics.median(run[r] for run in runs)) for r in range(layout.world_size)]
            row = (f"| {family} | {option or '-'} | {layout_name} | - | {', '.join(f'{x:,}' for x in real)} | "
                   f"{refused} | - |")
            print(row, flush=True)
            rows.append(row)
            continue
        real = [int(statistics.median(run[r] for run in runs)) for r in range(layout.world_size)]
        per_rank = {r: est for est in result.per_rank for r in (est.ranks or [est.rank])}
        errors = [100 * (per_rank[r].peak_allocated_bytes - real[r]) / real[r] for r in range(layout.world_size)]
        # under a skewed routing the estimate is the most loaded rank's (EP rank 0, holding the hot experts)
        bound_for = [r for r in range(layout.world_size) if r % layout.ep == 0] if setup.routing != "balanced" \
            else list(range(layout.world_size))
        worst[result.parallel] = max(worst.get(result.parallel, 0.0), max(abs(errors[r]) for r in bound_for))
        row = (f"| {family} | {option or '-'} | {layout_name} | {result.parallel} | "
               f"{', '.join(f'{x:,}' for x in real)} | {per_rank[0].peak_allocated_bytes:,} | "
               f"{', '.join(f'{e:+.3f}' for e in errors)} |")
        print(row, flush=True)
        rows.append(row)
    text = (
        "### Parallel layouts: estimate vs real gloo runs, every rank (CPU ground truth)\n\n"
        "Command: `.venv/bin/python benchmarks/bench_parallel_groundtruth.py"
        + (f" --repeats {args.repeats}" if args.repeats != 1 else "") + "`\n\n"
        "Real: peak of torch.profiler's memory timeline over one step (after a warm-up step) on each rank of a "
        "multi-process gloo run (torch.multiprocessing spawn; DDP, FSDP2 `fully_shard` (bf16 params: its "
        "`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`), DTensor TP with the "
        "Llama plan, FSDP2 + TP and DDP + TP on a 2-D mesh). Estimate: `estimate(..., device=\"cpu\", "
        "allocator=\"none\")`; *traced* = the parallel step itself traced on a fake process group, *modelled* = "
        "rules over the single-device trace, *traced + modelled* = the TP step traced with DDP's parameter "
        "transform, DDP's gradient buckets modelled on it (DDP's reducer cannot run on a fake group). Tiny configs, batch 2, sequence 32, AdamW foreach, "
        f"{args.repeats} fresh-process run(s) per case, per-rank median "
        f"({time.perf_counter() - start:.0f} s in all on 2 cores). Error = (estimate - real) / real, per rank.\n\n"
        "| model | options | layout | estimate path | real peak per rank (B) | estimate (B) | error per rank (%) |\n"
        "|---|---|---|---|---:|---:|---:|\n" + "\n".join(rows) + "\n\n"
        + "Largest error on any rank: " + ", ".join(f"{k} {v:.3f}%" for k, v in sorted(worst.items())) + ".\n"
        + SKEWED_ROUTING + "\n"
    )
    print(text)
    if not args.no_write and args.layouts:
        write_section(MARK, merged_rows(rows, args, time.perf_counter() - start))
    elif not args.no_write:
        write_section(MARK, text)


def merged_rows(rows: list[str], args: argparse.Namespace, elapsed_s: float) -> str:
    """The existing `bench:parallel_groundtruth` section with `rows` in place of the rows
    of the same model, options and layout (appended where new), and a line saying which
    rows this run measured."""
    text = BENCHMARKS_MD.read_text()
    start, end = f"<!-- bench:{MARK} -->", f"<!-- /bench:{MARK} -->"
    section = text[text.index(start) + len(start):text.index(end)].strip("\n").splitlines()
    new = {ROW_KEY.match(row).groups(): row for row in rows}
    table_end = max(i for i, line in enumerate(section) if line.startswith("|")) + 1
    body = [new.pop(ROW_KEY.match(line).groups(), line) if ROW_KEY.match(line) else line
            for line in section[:table_end]] + list(new.values())
    note = (f"Rows of the layouts {', '.join(args.layouts)}: measured by `bench_parallel_groundtruth.py --layouts "
            f"{' '.join(repr(name) for name in args.layouts)} --repeats {args.repeats}` ({elapsed_s:.0f} s).")
    tail = [largest_errors(body) if line.startswith("Largest error on any rank") else line
            for line in section[table_end:] if not line.startswith((note.split(":")[0], SKEWED_ROUTING[:30]))]
    while tail and not tail[-1].strip():
        tail.pop()
    return "\n".join(body + tail + ["", note, "", SKEWED_ROUTING])


def largest_errors(table: list[str]) -> str:
    """The "Largest error on any rank" line of the table's rows (a skewed routing's rows:
    EP rank 0 only, the rank the estimate is)."""
    worst: dict[str, float] = {}
    for line in table:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if len(cells) != 7 or not re.fullmatch(r"[-+0-9., ]+", cells[6]) or not re.search(r"\d", cells[6]):
            continue
        errors = [abs(float(e)) for e in cells[6].split(",")]
        layout = Layout(**LAYOUTS[cells[2]]) if cells[2] in LAYOUTS else Layout()
        counted = errors[::layout.ep] if OPTIONS.get(cells[1], {}).get("routing", "balanced") != "balanced" else errors
        worst[cells[3]] = max(worst.get(cells[3], 0.0), max(counted))
    return "Largest error on any rank: " + ", ".join(f"{k} {v:.3f}%" for k, v in sorted(worst.items())) + "."


if __name__ == "__main__":
    main()
