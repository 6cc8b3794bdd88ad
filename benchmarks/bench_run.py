"""How long `memplan run` takes to answer on a big FSDP2 program, and what it answers.

Writes the `run` table of BENCHMARKS.md.

    .venv/bin/python benchmarks/bench_run.py [--model llama-3.1-8b] [--world 8] [--no-write]

The program is `benchmarks/programs/fsdp2_llama.py` (a torchrun script: a Hugging Face Llama
built from its config, FSDP2 per decoder layer and at the root with bf16 parameters and fp32
reduction, fused AdamW, random tokens, batch 1 x 4096), run as
`memplan run -- torchrun --nproc-per-node 8 fsdp2_llama.py --config DIR`, for the H100
profile, with the default steps (the first and 2 more) and ranks (distinct). The time is
`memplan.program.run_program`'s, wall clock and CPU (user + system) of this process, from
the command to the answer, in a process that has imported memplan; the script itself
imports transformers and builds the model inside it.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
import warnings
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
warnings.filterwarnings("ignore", category=FutureWarning)

from benchmarks_md import write_section  # noqa: E402
from memplan import models  # noqa: E402
from memplan.program import run_program  # noqa: E402
from memplan.units import format_bytes  # noqa: E402

PROGRAM = Path(__file__).resolve().parent / "programs" / "fsdp2_llama.py"


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="memplan-bench-run-") as tmp:
        models.load_config(args.model).save_pretrained(tmp)
        command = ["torchrun", "--nproc-per-node", str(args.world), str(PROGRAM), "--config", tmp]
        start, cpu = time.perf_counter(), _cpu_s()
        result = run_program(command, device="cuda", gpu="h100-80gb", out_dir=Path(tmp) / "run", progress=True)
        wall_s, cpu_s = time.perf_counter() - start, _cpu_s() - cpu
    rows = []
    for r in result.estimate.per_rank:
        rows.append(f"| {args.model} | {args.world} | {','.join(map(str, r.ranks))} | "
                    f"{format_bytes(r.peak_allocated_bytes)} | {format_bytes(r.peak_reserved_bytes)} | "
                    f"{format_bytes(r.device_used_bytes)} | {r.peak_phase} | {wall_s:.1f} s | {cpu_s:.1f} s |")
    traced = result.runs[0]
    table = "\n".join([
        "<!-- bench:run -->",
        "### `memplan run` on an FSDP2 torchrun script",
        "",
        "Command: `.venv/bin/python benchmarks/bench_run.py`",
        "",
        f"`memplan run -- torchrun --nproc-per-node {args.world} benchmarks/programs/fsdp2_llama.py --config DIR` "
        f"(FSDP2 per layer + root, bf16 parameters, fp32 reduction, fused AdamW, batch 1 x 4096, no "
        f"checkpointing) for h100-80gb: {traced.steps} optimizer steps traced ({traced.trace.num_ops:,} ops), "
        f"ranks distinct. Time of `run_program` from the command to the answer (the script's own imports and "
        f"model build included), on this {os.cpu_count()}-core machine shared with other work: wall clock and "
        "CPU seconds of the process.",
        "",
        "| model | world | ranks | peak allocated | peak reserved | device used | phase | wall | CPU |",
        "|---|---:|---|---:|---:|---:|---|---:|---:|",
        *rows,
        "<!-- /bench:run -->",
    ])
    if not args.no_write:
        write_section("run", table)
    print(table, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
