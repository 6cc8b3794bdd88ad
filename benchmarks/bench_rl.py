"""`memplan rl` against real TRL steps on CPU, phase by phase, and the time of the
done-when command.

1. TRL 1.16.0's GRPOTrainer (transformers rollout, `beta` 0.04) and DPOTrainer on the tiny
   Qwen2.5 configuration at two sizes, each phase's peak measured by torch.profiler in the
   second step (tests/support/trl_truth.py), against `memplan.estimate_rl(..., device="cpu")`:
   the transformers rollout (TRL's own generate() call, traced by `memplan generate`), the
   reference log-probabilities and the training step.
2. `memplan rl Qwen/Qwen2.5-7B --algo grpo --trainer trl --rollout vllm-colocate --gpu
   h100-80gb --world-size 8 --zero 3 --prompt-len 512 --completion-len 1024
   --num-generations 8`: its CPU seconds and wall seconds, and its phase table.

Writes the `bench:rl` table of BENCHMARKS.md.

    PYTHONPATH=src:tests/support .venv/bin/python benchmarks/bench_rl.py
"""

import json
import os
import tempfile

import trl_truth

from benchmarks_md import run_cli, write_section
from memplan.models.registry import tiny_config
from memplan.models.setup import TrainingSetup
from memplan.rl import estimate_rl

DONE_WHEN = ["rl", "Qwen/Qwen2.5-7B", "--algo", "grpo", "--trainer", "trl", "--rollout", "vllm-colocate", "--gpu",
             "h100-80gb", "--world-size", "8", "--zero", "3", "--prompt-len", "512", "--completion-len", "1024",
             "--num-generations", "8", "--json"]
SIZES = ((16, 8, 4), (64, 32, 8))  # (P, C, rows per micro-batch)


def _rows(path, prompt, completion, batch):
    config = tiny_config("qwen2.5-0.5b")
    out = []
    grpo = trl_truth.grpo_phases(config, prompt_len=prompt, completion_len=completion, batch=batch,
                                 generations=4, beta=0.04)
    ours = estimate_rl(path, "grpo", "trl", rollout="hf", prompt_len=prompt, completion_len=completion,
                       num_generations=4, setup=TrainingSetup(batch=batch), beta=0.04, device="cpu")
    names = {"rollout": "rollout (transformers generate)"}
    for phase, measured in grpo.items():
        predicted = next(p.device_used_bytes for p in ours.phases if p.name == names.get(phase, phase))
        out.append((f"GRPO P {prompt} + C {completion}, {batch} rows", phase, measured, predicted))
    dpo = trl_truth.dpo_phases(config, prompt_len=prompt, completion_len=completion, batch=batch // 2)
    ours = estimate_rl(path, "dpo", "trl", rollout="hf", prompt_len=prompt, completion_len=completion,
                       num_generations=1, setup=TrainingSetup(batch=batch // 2), device="cpu")
    predicted = next(p.device_used_bytes for p in ours.phases if p.name == "training step")
    out.append((f"DPO P {prompt} + C {completion}, {batch // 2} pairs", "training step", dpo["training step"],
                predicted))
    return out


def _done_when():
    proc, wall, cpu = run_cli(DONE_WHEN, check=True)
    return json.loads(proc.stdout), cpu, wall


def main():
    with tempfile.TemporaryDirectory() as d:
        tiny_config("qwen2.5-0.5b").save_pretrained(d)
        rows = [r for size in SIZES for r in _rows(os.path.join(d, "config.json"), *size)]
    doc, cpu, wall = _done_when()
    lines = ["## RL steps (`bench:rl`)", "",
             "`memplan rl --device cpu` against TRL 1.16.0 on CPU (tiny Qwen2.5, each phase's peak measured by "
             "torch.profiler in the second step; tests/support/trl_truth.py). Error = (memplan - measured) / measured. "
             "The rollout is TRL's transformers generate() (sampling, exactly C new tokens per row) traced by "
             "memplan generate. Reproduce: `PYTHONPATH=src:tests/support .venv/bin/python benchmarks/bench_rl.py`.",
             "",
             "| run | phase | measured bytes | memplan bytes | error |", "|---|---|---:|---:|---:|"]
    for run, phase, measured, predicted in rows:
        lines.append(f"| {run} | {phase} | {measured:,} | {predicted:,} | {(predicted - measured) / measured:+.2%} |")
    lines += ["", f"`memplan {' '.join(DONE_WHEN[:-1])}`: {cpu:.1f} CPU-s, {wall:.1f} s wall on 2 cores shared with other jobs"
              f"; peak phase {doc['peak_phase']} at {doc['peak_bytes'] / (1 << 30):.1f} GiB, "
              f"fits: {doc['fits']}.", "",
              "| phase | device GiB | torch GiB | cumem GiB | outside GiB |", "|---|---:|---:|---:|---:|"]
    for p in doc["phases"]:
        b = p["by_allocator"]
        lines.append(f"| {p['name']} | {p['device_used_bytes'] / (1 << 30):.2f} | {b['torch'] / (1 << 30):.2f} | "
                     f"{b['cumem'] / (1 << 30):.2f} | {b['outside'] / (1 << 30):.2f} |")
    write_section("rl", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
