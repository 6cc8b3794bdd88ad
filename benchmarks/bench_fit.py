"""Speed of `memplan fit`: the layout search, the fewest GPUs, the largest sequence and the
changes that make a job fit on its own GPU.

Each case is the CLI run as a user runs it (a fresh `python -m memplan fit ... --json`
process, imports included), timed by the wall clock, with the CPU seconds it used: the CLI
process (its rusage) plus the seconds its pool's workers spent on tasks (the `search` object
of the JSON; the forkserver's one import of torch is not counted). The machine may be
shared: the 1-minute load average is read before and after each case and printed with it;
on a loaded machine the wall clock is the CPU seconds over the share of the cores the job
got, so the CPU seconds are the figure to compare across runs.
`--baseline SRC` also times the same first command with another checkout's `src` (e.g. the
search before its rows were traced). Writes the `bench:fit` table of BENCHMARKS.md.

    .venv/bin/python benchmarks/bench_fit.py [--cases layouts,auto,max-seq,what-fits] [--baseline /path/to/src]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmarks_md import write_section  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MARK = "fit"
CASES = {
    "layouts": ["llama-3.1-70b", "--gpu", "h100-80gb", "--gpus", "64", "--seq", "8192", "--precision", "32-true"],
    "auto": ["llama-3.1-70b", "--gpu", "h100-80gb", "--gpus", "auto", "--seq", "8192", "--precision", "32-true"],
    "max-seq": ["llama-3.1-8b", "--gpu", "rtx4090", "--gpus", "1", "--lora-rank", "16", "--precision", "32-true",
                "--max", "seq"],
    # the same LoRA with the base in bf16, as LoRA fine-tunes load it (32-true: 32 GB of weights)
    "max-seq-bf16": ["llama-3.1-8b", "--gpu", "rtx4090", "--gpus", "1", "--lora-rank", "16", "--precision", "bf16-true",
                     "--max", "seq"],
    # a full fine-tune (bf16) that does not fit one 24 GB card: what fits on that one card
    "what-fits": ["llama-3.1-8b", "--gpu", "rtx4090", "--gpus", "1", "--precision", "bf16-true", "--what-fits"],
}
TARGETS_S = {"layouts": 20.0, "what-fits": 60.0}  # on 2 cores


def run_case(argv: list[str], src: Path, json_out: bool = True) -> dict:
    """One fresh CLI process: wall and CPU seconds, the load around it, what it printed."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "memplan", "fit", *argv, *(["--json"] if json_out else [])],
                          env=env, capture_output=True, text=True, cwd=ROOT)
    wall_s = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"memplan fit {' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
    cli_cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    doc = json.loads(proc.stdout) if json_out else {}
    search = doc.get("search", {})
    return {"argv": argv, "wall_s": wall_s, "cpu_s": cli_cpu_s + search.get("worker_cpu_s", 0.0),
            "load": (load_before, os.getloadavg()[0]), "doc": doc, "search": search}


def answer(case: str, doc: dict) -> str:
    """The case's answer in a few words."""
    if not doc:
        return "(old output: a table)"
    if case.startswith("max-seq"):
        if doc["max"] is None:
            smallest = min(doc["probes"], key=lambda p: p["value"])
            return (f"none fits: seq {smallest['value']} needs {smallest['device_used_bytes'] / 2**30:.1f} GiB of "
                    f"{smallest['usable_bytes'] / 2**30:.1f} GiB usable")
        return f"max seq {doc['max']} ({doc['limit']})"
    rows = doc.get("configurations") or []
    if not rows:
        return "nothing fits"
    top = rows[0]
    if case == "what-fits":
        return (f"{len(rows)} rows; top: {', '.join(top['changes'])} on {top['world_size']} GPU, "
                f"{top['device_used_bytes'] / 2**30:.1f} GiB")
    where = f"{doc['gpus']} GPUs: " if case == "auto" else ""
    return (f"{where}{len(rows)} rows; top: zero {top['zero']}, tp {top['tp']}, pp {top['pp']}, micro-batch "
            f"{top['micro_batch']}, {top['checkpointing']}, {top['device_used_bytes'] / 2**30:.1f} GiB")


def table(results: list[tuple[str, dict]]) -> str:
    lines = ["| case | command | wall (s) | CPU (s) | estimates | workers | load avg before / after | answer |",
             "|---|---|---:|---:|---:|---:|---|---|"]
    for case, r in results:
        s = r["search"]
        lines.append(f"| {case} | `memplan fit {' '.join(r['argv'])}` | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | "
                     f"{s.get('estimates', '-')} | {s.get('workers', '-')} | {r['load'][0]:.1f} / {r['load'][1]:.1f} "
                     f"| {answer(case, r['doc'])} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated: {', '.join(CASES)}")
    parser.add_argument("--baseline", type=Path, default=None, metavar="SRC",
                        help="another checkout's src/ to time on the first case")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    results = []
    for case in args.cases.split(","):
        results.append((case, run_case(CASES[case], ROOT / "src")))
        print(table(results[-1:]), flush=True)
    if args.baseline is not None:
        first = args.cases.split(",")[0]
        results.append((f"{first}, baseline", run_case(CASES[first], args.baseline, json_out=False)))
        print(table(results[-1:]), flush=True)
    cores = len(os.sched_getaffinity(0))
    text = (
        "## memplan fit: search time\n\n"
        "Command: `.venv/bin/python benchmarks/bench_fit.py`\n\n"
        f"A fresh CLI process per case (imports included), on {cores} cores (x86_64), one worker per core (the CLI "
        "process and a single-process pool per other core). CPU seconds: the CLI process plus its workers' seconds "
        "on tasks (the forkserver's one import of torch and transformers, about as long as the CLI's own and run "
        "while the CLI process traces its first setup, is not counted). The load average is the "
        "machine's 1-minute figure before and after the case: above the core count, other jobs shared the "
        "cores and the wall clock grew with them; compare CPU seconds across runs. Targets on 2 cores: "
        + ", ".join(f"`{case}` <= {t:.0f} s" for case, t in TARGETS_S.items())
        + ". Every row is a traced estimate (`memplan estimate`'s figures); "
        "estimates = candidates estimated (screened or traced).\n\n" + table(results) + "\n"
    )
    print(text)
    if not args.no_write:
        write_section(MARK, text)


if __name__ == "__main__":
    main()
