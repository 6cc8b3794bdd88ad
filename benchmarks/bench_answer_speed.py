"""How fast memplan answers a user who asks: `--help`, a mistyped flag, a bad value, and an 8B
QLoRA estimate, each a fresh `python -m memplan` process as a user runs it (imports
included), timed by the wall clock with the CPU seconds it used (user + system, its
children included). The machine may be shared: the 1-minute load average before and after
each case is printed with it, and on a loaded machine the CPU seconds are the figure to
compare across runs. Targets on 2 cores: the first three <= 1 s, the estimate <= 5 s.
Writes the `bench:answer_speed` table of BENCHMARKS.md.

    .venv/bin/python benchmarks/bench_answer_speed.py [--no-write]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmarks_md import run_cli, write_section  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MARK = "answer_speed"
QLORA = ["estimate", "llama-3.1-8b", "--gpu", "rtx4090", "--quant", "nf4", "--lora-rank", "16"]
CASES = [
    ("help", ["--help"], 1.0),
    ("subcommand help", ["estimate", "--help"], 1.0),
    ("bad flag", ["estimate", "gpt2", "--bacth", "2"], 1.0),
    ("bad value", ["estimate", "gpt2", "--precision", "fp8"], 1.0),
    ("8B QLoRA estimate", QLORA, 5.0),
]


def run_case(argv: list[str]) -> dict:
    """One fresh CLI process: wall and CPU seconds, exit code, load before and after."""
    load_before = os.getloadavg()[0]
    proc, wall, cpu = run_cli(argv)
    return {"wall_s": wall, "cpu_s": cpu, "code": proc.returncode, "load": (load_before, os.getloadavg()[0])}


def table(rows: list[tuple[str, list[str], float, dict]]) -> str:
    lines = ["| case | command | exit | wall (s) | CPU (s) | target (s) | load avg before / after |",
             "|---|---|---:|---:|---:|---:|---|"]
    for name, argv, target, r in rows:
        lines.append(f"| {name} | `memplan {' '.join(argv)}` | {r['code']} | {r['wall_s']:.2f} | {r['cpu_s']:.2f} | "
                     f"{target:g} | {r['load'][0]:.1f} / {r['load'][1]:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-write", action="store_true", help="print the table, leave BENCHMARKS.md alone")
    args = parser.parse_args()
    rows = [(name, argv, target, run_case(argv)) for name, argv, target in CASES]
    text = (f"## memplan answers: help, bad input, an 8B QLoRA estimate\n\nCommand: `.venv/bin/python benchmarks/bench_answer_speed.py`\n\nA fresh CLI process per case "
            f"(imports included) on {os.cpu_count()} cores ({os.uname().machine}); CPU = user + system seconds of "
            "the process and its children. When the load average is above the core count other jobs shared the "
            "cores and the wall clock grew with them: compare CPU seconds.\n\n" + table(rows))
    print(text)
    if not args.no_write:
        write_section(MARK, text)


if __name__ == "__main__":
    main()
