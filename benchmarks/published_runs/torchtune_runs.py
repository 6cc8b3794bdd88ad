"""torchtune's published single-device full fine-tunes, run as `tune run` with the source's flags.

- The torchtune README's optimization-flags table (meta-pytorch/torchtune@7d470bfae5be,
  README.md:143-156): `full_finetune_single_device` with `llama3_2/3B_full_single_device`,
  batch 2, max sequence length 4096, bf16, each technique added on top of the previous one:
  packed dataset, compile, chunked cross-entropy, activation checkpointing, optimizer step in
  backward, activation offloading. The README's command for its last row names the flags
  (README.md:163-176: `dataset.packed=True compile=True
  loss=torchtune.modules.loss.CEWithChunkedOutputLoss enable_activation_checkpointing=True
  optimizer_in_bwd=False enable_activation_offloading=True optimizer=torch.optim.AdamW
  tokenizer.max_seq_len=4096 gradient_accumulation_steps=1 epochs=1 batch_size=2`); a row
  before a technique has that technique's flag off, and the rows before chunked
  cross-entropy use `torch.nn.CrossEntropyLoss`.
- torchao's low-bit optimizer table (pytorch/ao@072500abcfbd, torchao/optim/README.md:49-57):
  Llama2-7B full BF16 with torchtune 52d1b838's `full_finetune_single_device`, one row per
  AdamW. The config is `llama2/7B_full_low_memory` (the single-device full config of that
  commit: batch 2, activation checkpointing, CEWithChunkedOutputLoss) with the optimizer of
  the row and its step out of backward (the case's guesses); torchtune 0.6.1's activation
  offloading, not in 52d1b838's config, is turned off (its LR scheduler, not there either,
  stays: torchtune's CLI removes no component, and it holds no device memory).

torchtune 0.6.1 runs from its own folder (`sys.prefix/torchtune`, requirements-torchtune.lock),
which the command's PYTHONPATH names. What is made here: a shapes-only checkpoint of the HF
config (`assets.write_checkpoint`), a tokenizer (a tiktoken ranks file of the 256 single bytes
for Llama 3, a SentencePiece character model trained on the data for Llama 2) and Alpaca-format
JSON rows of synthetic words, read by the config's own dataset builder
(`dataset.source=json dataset.data_files=...`).
"""

from __future__ import annotations

import base64
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

from published_runs import TrainerRun, assets

TORCHTUNE = Path(os.environ.get("MEMPLAN_TORCHTUNE_PATH", Path(sys.prefix) / "torchtune"))

# the README ladder's baseline (README.md:143, 163-176), every later technique off; each row
# turns on the techniques of the rows above it and its own
LADDER_BASE = {"batch_size": "2", "tokenizer.max_seq_len": "4096", "gradient_accumulation_steps": "1", "epochs": "1",
               "optimizer": "torch.optim.AdamW", "dataset.packed": "True", "compile": "False",
               "loss": "torch.nn.CrossEntropyLoss", "enable_activation_checkpointing": "False",
               "optimizer_in_bwd": "False", "enable_activation_offloading": "False"}
TECHNIQUES = [("torchtune-llama3.2-3b-full-packed", {}),
              ("torchtune-llama3.2-3b-full-packed-compile", {"compile": "True"}),
              ("torchtune-llama3.2-3b-chunked-ce", {"loss": "torchtune.modules.loss.CEWithChunkedOutputLoss"}),
              (None, {"enable_activation_checkpointing": "True"}),  # README rows not in published_gpu.json
              (None, {"optimizer_in_bwd": "True"}),
              ("torchtune-llama3.2-3b-activation-offloading", {"enable_activation_offloading": "True"})]


def ladder_overrides() -> dict[str, list[str]]:
    """Case id -> the `key=value` overrides of its README row, each key once."""
    rows, settings = {}, dict(LADDER_BASE)
    for case_id, technique in TECHNIQUES:
        settings.update(technique)
        if case_id is not None:
            rows[case_id] = [f"{k}={v}" for k, v in settings.items()]
    return rows


# torchao's rows: the optimizer each ran (torchao/optim/README.md:51-57)
TORCHAO_OPTIMIZERS = {
    "torchao-llama2-7b-full-pytorch-fused": ["optimizer=torch.optim.AdamW", "optimizer.fused=True"],
    "torchao-llama2-7b-full-bnb-8bit": ["optimizer=bitsandbytes.optim.AdamW8bit"],
    "torchao-llama2-7b-full-ao-8bit": ["optimizer=torchao.optim.AdamW8bit"],
    "torchao-llama2-7b-full-ao-4bit": ["optimizer=torchao.optim.AdamW4bit"],
}
TORCHAO_BASE = ["optimizer_in_bwd=False", "enable_activation_offloading=False",
                "gradient_accumulation_steps=1", "epochs=1"]
LLAMA2_SEQ = 512  # the case's guessed Alpaca sequence length


def write_byte_tiktoken(path: Path) -> Path:
    """A tiktoken BPE ranks file (one `base64(token) rank` line each) of the 256 single bytes:
    what `torchtune.models.llama3.llama3_tokenizer` loads (tiktoken's `load_tiktoken_bpe`), with
    no merges, so that every byte of text is one token; Llama 3's special tokens keep their
    ids (128000 and up) from torchtune's own table."""
    path.write_text("".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(256)))
    return path


def write_sentencepiece(corpus: list[str], prefix: Path) -> Path:
    """A SentencePiece character model trained on `corpus` (`prefix.model`), what
    `torchtune.models.llama2.llama2_tokenizer` loads; trained in torchtune's environment,
    where sentencepiece is installed."""
    text = prefix.with_suffix(".txt")
    text.write_text("\n".join(corpus))
    script = ("import sentencepiece as spm, sys; spm.SentencePieceTrainer.train(input=sys.argv[1], "
              "model_prefix=sys.argv[2], vocab_size=40, model_type='char', pad_id=0, unk_id=1, bos_id=2, "
              "eos_id=3, minloglevel=2)")
    done = subprocess.run([sys.executable, "-c", script, str(text), str(prefix)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(TORCHTUNE)})
    if done.returncode != 0:
        raise RuntimeError(f"training the SentencePiece model failed: {done.stderr[-2000:]}")
    return prefix.with_suffix(".model")


def write_alpaca_rows(path: Path, rows: int, words_per_row: tuple[int, int], seed: int = 0) -> list[str]:
    """`rows` Alpaca-format JSON rows (instruction, input, output) of synthetic words, each row
    of a random length in `words_per_row`; the texts written."""
    rng = random.Random(seed)
    data, texts = [], []
    for i in range(rows):
        count = rng.randint(*words_per_row)
        text = assets.words(count, 10_000, seed=seed * 100_003 + i)
        cut = count // 4
        row = {"instruction": " ".join(text.split()[:cut]), "input": "", "output": " ".join(text.split()[cut:])}
        data.append(row)
        texts.append(text)
    path.write_text(json.dumps(data))
    return texts


def _checkpoint(case: dict[str, Any], folder: Path) -> Path:
    from memplan.models import load_config

    return assets.write_checkpoint(load_config(case["model"]), folder, "AutoModelForCausalLM", "bfloat16")


def _common_overrides(checkpoint: Path, data: Path, out: Path) -> list[str]:
    return [f"output_dir={out}", f"checkpointer.checkpoint_dir={checkpoint}",
            "checkpointer.checkpoint_files=[model.safetensors]", "dataset.source=json",
            f"dataset.data_files={data}", "dataset.split=train"]


def _ladder_prepare(overrides: list[str]):
    def prepare(case: dict[str, Any], workdir: Path) -> TrainerRun:
        checkpoint = _checkpoint(case, workdir / "Llama-3.2-3B-Instruct")
        tokenizer = write_byte_tiktoken(workdir / "tokenizer.model")
        # Alpaca-like lengths (one token per byte here: ~5 per word), enough for > 10 packs of 4096
        write_alpaca_rows(workdir / "data.json", rows=160, words_per_row=(40, 160))
        command = ["tune", "run", "full_finetune_single_device", "--config", "llama3_2/3B_full_single_device",
                   *overrides, f"tokenizer.path={tokenizer}",
                   *_common_overrides(checkpoint, workdir / "data.json", workdir / "out")]
        return TrainerRun(command=command, env={"PYTHONPATH": str(TORCHTUNE)}, cwd=workdir, notes=[
            "shapes-only Llama-3.2-3B checkpoint from memplan's llama-3.2-3b HF config",
            "tokenizer: tiktoken ranks of the 256 single bytes (one token per byte) with Llama 3's special tokens",
            "data: 160 synthetic Alpaca-format rows of 40-160 words, packed by torchtune to 4096 tokens",
            "torchtune 0.6.1's recipe and config, not the README's (unstated) version",
            "loss torch.nn.CrossEntropyLoss before the chunked cross-entropy row (unstated)"])
    return prepare


def _torchao_prepare(optimizer: list[str]):
    def prepare(case: dict[str, Any], workdir: Path) -> TrainerRun:
        checkpoint = _checkpoint(case, workdir / "Llama-2-7b-hf")
        # rows longer than the guessed sequence, truncated by the tokenizer to exactly LLAMA2_SEQ tokens
        texts = write_alpaca_rows(workdir / "data.json", rows=32, words_per_row=(200, 240))
        tokenizer = write_sentencepiece(texts, workdir / "tokenizer")
        command = ["tune", "run", "full_finetune_single_device", "--config", "llama2/7B_full_low_memory",
                   *TORCHAO_BASE, *optimizer, f"batch_size={case['setup']['batch']}", f"tokenizer.path={tokenizer}",
                   f"tokenizer.max_seq_len={LLAMA2_SEQ}",
                   *_common_overrides(checkpoint, workdir / "data.json", workdir / "out")]
        return TrainerRun(command=command, env={"PYTHONPATH": str(TORCHTUNE)}, cwd=workdir, notes=[
            "shapes-only Llama-2-7B checkpoint (safetensors) from memplan's llama-2-7b HF config",
            "tokenizer: a SentencePiece character model trained on the synthetic data",
            f"data: synthetic Alpaca-format rows truncated by tokenizer.max_seq_len to {LLAMA2_SEQ} tokens (guessed)",
            "torchtune 0.6.1's recipe and llama2/7B_full_low_memory config, not 52d1b838's; "
            "its activation offloading (not in 52d1b838) off; its LR scheduler (not in 52d1b838 either) kept: "
            "torchtune's CLI cannot remove a component, and a LambdaLR holds no device memory",
            "torchao 0.11's AdamW8bit/AdamW4bit (torchao.optim), not the 2024 prototype's"])
    return prepare


RUNS = {case_id: _ladder_prepare(overrides) for case_id, overrides in ladder_overrides().items()}
RUNS.update({case_id: _torchao_prepare(opt) for case_id, opt in TORCHAO_OPTIMIZERS.items()})
