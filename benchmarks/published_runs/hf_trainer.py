"""The Transformers docs' bert-large `Trainer` series ("Efficient Training on a Single GPU",
v4.16-v4.25: docs/source/en/perf_train_gpu_one.mdx at huggingface/transformers@0016acf7ef42),
each experiment run as the page's own script (`programs/hf_trainer_bert.py`) with that
experiment's `TrainingArguments`, under today's transformers.

The checkpoint is bert-large's config (memplan's registry entry, 2 labels) with a
shapes-only `model.safetensors` (`assets.write_checkpoint`); the dataset is the page's own
random one, made by the script.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from published_runs import TrainerRun, assets

PROGRAM = Path(__file__).resolve().parent / "programs" / "hf_trainer_bert.py"

# case id -> the script's flags for the page's experiment of that name
EXPERIMENTS = {
    "vanilla": ["--batch", "4"],
    "grad-accum": ["--batch", "1", "--grad_accum", "4"],
    "grad-ckpt": ["--batch", "1", "--grad_accum", "4", "--gradient_checkpointing"],
    "fp16": ["--batch", "4", "--fp16"],
    "ga-gc-fp16": ["--batch", "1", "--grad_accum", "4", "--gradient_checkpointing", "--fp16"],
    "adafactor": ["--batch", "4", "--optim", "adafactor"],
    "ga-gc-fp16-adafactor": ["--batch", "1", "--grad_accum", "4", "--gradient_checkpointing", "--fp16",
                             "--optim", "adafactor"],
    "8bit-adam": ["--batch", "4", "--adam8bit"],
    "ga-gc-fp16-8bit-adam": ["--batch", "1", "--grad_accum", "4", "--gradient_checkpointing", "--fp16",
                             "--adam8bit"],
}

NOTES = [
    "shapes-only bert-large-uncased checkpoint from memplan's bert-large config (2 labels)",
    "the page's dummy data (512 x 512 random ids in 100..30000, labels 0), made by its script",
    "evaluation_strategy='steps' left out: today's Trainer refuses it without an eval_dataset",
    "transformers 5.23's Trainer, not 2022's: BERT's SDPA attention (2022: eager, its attention "
    "probabilities and dropout mask saved), model.zero_grad() frees the gradients (PyTorch 1.10 kept them as zeros)",
]
ADAMW_NOTE = "optim adamw_torch_fused, today's default (2022: adamw_hf, transformers.AdamW's per-parameter loop)"
CHECKPOINTING_NOTE = "gradient checkpointing non-reentrant, today's default (2022: reentrant)"


def write_bert_large(case: dict[str, Any], folder: Path) -> Path:
    """`folder` holding the case's bert-large as `AutoModelForSequenceClassification`, fp32."""
    from memplan.models import load_config

    config = load_config(case["model"])
    config.num_labels = case["setup"].get("num_labels", 2)
    return assets.write_checkpoint(config, folder, "AutoModelForSequenceClassification", "float32")


def _prepare(flags: list[str]):
    def prepare(case: dict[str, Any], workdir: Path) -> TrainerRun:
        model = write_bert_large(case, workdir / "bert-large-uncased")
        command = ["python", str(PROGRAM), "--model", str(model), "--output_dir", str(workdir / "tmp"), *flags]
        notes = list(NOTES)
        if "--optim" not in flags and "--adam8bit" not in flags:
            notes.append(ADAMW_NOTE)
        if "--gradient_checkpointing" in flags:
            notes.append(CHECKPOINTING_NOTE)
        return TrainerRun(command=command, cwd=workdir, notes=notes)
    return prepare


RUNS = {f"hf-trainer-bert-large-{name}": _prepare(flags) for name, flags in EXPERIMENTS.items()}

