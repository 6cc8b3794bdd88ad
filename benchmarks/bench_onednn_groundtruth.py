"""CPU ground truth of the low-precision steps with and without oneDNN's matmul path.

The bf16 and quantised cases of `tests/estimation/test_cpu_accuracy.py`, and the GPT-2
case's nf4 and bf16-dtype variants (tiny configs,
batch 2, sequence 32, AdamW foreach), each run twice in fresh processes: once as the
host runs them, once with `ONEDNN_MAX_CPU_ISA=AVX2`, which keeps every matmul on ATen's
own gemm (docs/estimation.md, "CPU matmuls on oneDNN's path"). Each row: whether the
process takes oneDNN's bf16 path (`memplan.hardware.onednn.host_onednn_path`), how many
of the step's matmuls get a measured buffer there and the largest, the estimate
(`estimate(..., device="cpu", allocator="none")`) and torch.profiler's peak of the real
step after one warm-up step. On a host without AVX-512 both settings take the
same path and the two rows of a case are the same run twice. Writes the
`bench:onednn_groundtruth` table.

    .venv/bin/python benchmarks/bench_onednn_groundtruth.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import warnings
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks_md import write_section  # noqa: E402

MARK = "onednn_groundtruth"
CASES = [
    ("mistral-7b", {"autocast": "bf16"}),
    ("bert-base", {"autocast": "bf16"}),
    ("llama-2-7b", {"quant": "nf4", "lora_rank": 4, "dtype": "bf16"}),
    ("llama-2-7b", {"quant": "nf4", "double_quant": True, "lora_rank": 4, "dtype": "bf16"}),
    ("mistral-7b", {"quant": "int8", "lora_rank": 4, "dtype": "bf16"}),
    ("llama-2-7b", {"quant": "nf4", "kbit_prep": False, "lora_rank": 4, "dtype": "bf16"}),
    ("gpt2", {"quant": "fp4", "quant_storage": "bf16", "lora_rank": 4, "autocast": "bf16", "checkpointing": "full"}),
    ("gpt2", {"quant": "nf4", "quant_storage": "bf16", "lora_rank": 4, "autocast": "bf16", "checkpointing": "full"}),
    ("gpt2", {"quant": "fp4", "quant_storage": "bf16", "lora_rank": 4, "dtype": "bf16", "checkpointing": "full"}),
    ("llama-2-7b", {"quant": "nf4", "frozen_base": True, "dtype": "bf16"}),
    ("llama-2-7b", {"quant": "nf4", "lora_rank": 4, "dora": True, "dtype": "bf16"}),
]
SETTINGS = {"as the host runs it": {}, "ONEDNN_MAX_CPU_ISA=AVX2": {"ONEDNN_MAX_CPU_ISA": "AVX2"}}


def measure_case(index: int) -> dict:
    """One case in this process: the path, the oneDNN buffers the estimate adds to the
    step's trace (`memplan.capture.onednn.onednn_workspaces`), estimate and profiler peak."""
    from memplan import models
    from memplan.capture.groundtruth import profiler_peak_bytes
    from memplan.capture.onednn import onednn_workspaces
    from memplan.capture.step import build_training_step, capture_step
    from memplan.estimation import estimate
    from memplan.hardware.onednn import host_onednn_path

    family, options = CASES[index]
    config = models.tiny_config(family)
    setup = models.TrainingSetup(batch=2, seq=32, optimizer_impl="foreach", **options)
    step = build_training_step(config, setup, device="cpu")
    step.run()
    truth = profiler_peak_bytes(step.run)
    extras = onednn_workspaces(capture_step(config, setup, "cpu").trace)
    predicted = estimate(config, setup, device="cpu", allocator="none").peak_allocated_bytes
    return {"path": host_onednn_path().bf16, "buffers": len(extras), "largest": max((x.nbytes for x in extras),
            default=0), "estimate": predicted, "profiler": truth}


def run_setting(env: dict[str, str]) -> list[dict]:
    """Every case, each in a fresh process under `env`."""
    rows = []
    for index in range(len(CASES)):
        out = subprocess.run([sys.executable, __file__, "--case", str(index)], env={**os.environ, **env},
                             capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(CASES[index], env, rows[-1], file=sys.stderr)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", type=int, help="measure one case in this process and print it as JSON")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    if args.case is not None:
        print(json.dumps(measure_case(args.case)))
        return 0
    import torch

    lines = []
    for label, env in SETTINGS.items():
        for (family, options), row in zip(CASES, run_setting(env)):
            error = (row["estimate"] - row["profiler"]) / row["profiler"]
            lines.append(f"| {family} | {', '.join(f'{k}={v}' for k, v in options.items())} | {label} | "
                         f"{'yes' if row['path'] else 'no'} | {row['buffers']} | {row['largest']:,} | "
                         f"{row['estimate']:,} | {row['profiler']:,} | {error:+.3%} |")
    table = "\n".join([
        f"<!-- bench:{MARK} -->",
        "### CPU ground truth with and without oneDNN's matmul path",
        "",
        "Command: `.venv/bin/python benchmarks/bench_onednn_groundtruth.py`",
        "",
        f"Each row one fresh process; tiny configs, batch 2, sequence 32. Torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
        f"{platform.processor() or platform.machine()}. \"oneDNN bf16\": `host_onednn_path().bf16`; "
        "\"buffers\": the matmuls of the step's trace that get a measured oneDNN buffer, and the largest (B). "
        "Where the host has no AVX-512 (capability AVX2), both settings keep ATen's gemm: their rows are "
        "the same run twice.",
        "",
        "| model | setup | setting | oneDNN bf16 | buffers | largest | estimate | profiler | error |",
        "|---|---|---|---|---:|---:|---:|---:|---:|",
        *lines,
        f"<!-- /bench:{MARK} -->",
    ])
    if not args.no_write:
        write_section(MARK, table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
