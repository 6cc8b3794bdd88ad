"""torchtitan's published Llama 3.1 8B runs, through `torchrun -m torchtitan.train`.

Source: torchtitan docs/performance.md (benchmarks/llama3_h100_202412_torchtitan.md since),
Table 1: "1D Parallelism (FSDP). Llama 3.1 8B model. 8 GPUs. Local batch size 2, global batch
size 16. Selective activation checkpointing." Its figures were taken with torchtitan 9dec370
(2024-12-26); the run here is torchtitan 0.2.2 (the newest that runs with memplan's torch,
docs/run.md "torchtitan"), with `torchtitan/models/llama3/train_configs/llama3_8b.toml` as
0.2.2 ships it (the wheel has no TOML files, so its text is below, verbatim) and the table's
settings as command-line overrides, as a user types them: rows "FSDP", "FSDP +
torch.compile" and "FSDP + torch.compile + Float8".

Made up here: the tokenizer (`assets.write_word_tokenizer` of Llama 3's 128,256 tokens: the
8B flavour fixes the vocabulary itself, `TransformerModelArgs.vocab_size`), and the data, a
local folder of JSON text rows read by torchtitan's `c4_test` loader
(`load_dataset(path, split="train")`, torchtitan/hf_datasets/text_datasets.py) instead of
streaming allenai/c4. torchtitan initialises its own weights (no checkpoint: `[checkpoint]
enable = false`), so every weight is fake under `memplan run`.

torchtitan imports triton, which memplan's CPU build of torch lacks, so it is installed in its
own folder (`sys.prefix/torchtitan`, requirements-torchtitan.lock), put first on PYTHONPATH.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from . import TrainerRun, assets

TORCHTITAN = Path(sys.prefix) / "torchtitan"
LLAMA3_VOCAB = 128_256

# torchtitan v0.2.2, torchtitan/models/llama3/train_configs/llama3_8b.toml, verbatim.
LLAMA3_8B_TOML = """\
# NOTE: this toml config is a preset for 64 A100 GPUs.

[job]
dump_folder = "./outputs"
description = "Llama 3 8B training"

[profiling]
enable_profiling = true
save_traces_folder = "profile_trace"
profile_freq = 100

[metrics]
log_freq = 10
enable_tensorboard = true
save_tb_folder = "tb"

[model]
name = "llama3"
flavor = "8B"
hf_assets_path = "./assets/hf/Llama-3.1-8B"
# converters = ["float8"]

[optimizer]
name = "AdamW"
lr = 3e-4
eps = 1e-8

[lr_scheduler]
warmup_steps = 200  # lr scheduler warm up

[training]
local_batch_size = 1
seq_len = 8192
max_norm = 1.0  # grad norm clipping
steps = 1000
dataset = "c4"

[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
tensor_parallel_degree = 1
pipeline_parallel_degree = 1
context_parallel_degree = 1

[checkpoint]
enable = false
folder = "checkpoint"
interval = 500
last_save_model_only = true
export_dtype = "float32"
async_mode = "disabled" # ["disabled", "async", "async_with_pinned_mem"]

[compile]
enable=false
components = ["model", "loss"]

[activation_checkpoint]
mode = "selective"  # ["none", "selective", "full"]
selective_ac_option = "op"  # "int" = ac every positive int layer or 'op', ac based on ops policy

[quantize.linear.float8]
enable_fsdp_float8_all_gather = false
precompute_float8_dynamic_scale_for_fsdp = false
filter_fqns = ["output"]

[validation]
enable = false
dataset = "c4_validation"
freq = 500
steps = 1200 # Recommend value for c4_validation with world-size=8 and seq_len=8192
"""

# torchtitan's launcher, run_llama_train.sh, runs torchrun with expandable segments
# (https://github.com/pytorch/torchtitan/blob/9628a182f55601e100e9c3734f597029bb1b6308/run_llama_train.sh,
# lines 21-22), the way its README starts a training run; memplan run replays the allocator the
# environment names.
LAUNCHER_ENV = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}

# The table's torchtitan (9dec370, December 2024) compiled the transformer blocks only; the
# loss has been compiled with them since https://github.com/pytorch/torchtitan/pull/1033
# (merged 2025-04-01, "compiling the loss fn if job_config.training.compile is set"), and
# 0.2.2 names what to compile in `compile.components` (its TOML: model and loss).
COMPILED_AS_THEN = ["--compile.components", "model"]
COMPILED_AS_THEN_NOTE = ("--compile.components model: the table's torchtitan compiled the blocks, not the loss "
                         "(compiled since pytorch/torchtitan#1033, April 2025)")

ROWS = 16  # rows of text in the dataset: each longer than a sample, so every batch is full


def write_c4_test_folder(folder: Path, tokens_per_row: int, vocab_size: int) -> Path:
    """`folder` holding `train.json`: JSON lines `{"text": ...}` of the word tokenizer's words,
    as torchtitan's `c4_test` loader reads a local dataset folder."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = (json.dumps({"text": assets.words(tokens_per_row, vocab_size, seed=i)}) for i in range(ROWS))
    (folder / "train.json").write_text("\n".join(rows) + "\n")
    return folder


def _llama3_8b_fsdp(case: dict[str, Any], workdir: Path, extra_flags: list[str],
                    extra_notes: list[str]) -> TrainerRun:
    setup, layout = case["setup"], case["layout"]
    tokenizer = assets.write_word_tokenizer(workdir / "tokenizer", LLAMA3_VOCAB)
    data = write_c4_test_folder(workdir / "c4_test", setup["seq"] + 1, LLAMA3_VOCAB)
    config = workdir / "llama3_8b.toml"
    config.write_text(LLAMA3_8B_TOML)
    command = ["torchrun", "--nproc-per-node", str(layout["world_size"]), "-m", "torchtitan.train",
               "--job.config_file", str(config),
               "--model.hf_assets_path", str(tokenizer),
               "--training.local_batch_size", str(setup["batch"]),
               "--training.seq_len", str(setup["seq"]),
               "--training.dataset", "c4_test", "--training.dataset_path", str(data),
               *extra_flags]
    notes = ["torchtitan 0.2.2's llama3_8b.toml (the table's run used torchtitan 9dec370)",
             f"tokenizer: word-level, Llama 3's {LLAMA3_VOCAB:,} tokens; data: local JSON rows of its words "
             "(c4_test loader) instead of allenai/c4",
             "weights: torchtitan's own initialisation (no checkpoint), fake under memplan run",
             "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, as torchtitan's launcher of the time sets it "
             "(run_llama_train.sh at commit 9628a18)",
             *extra_notes]
    return TrainerRun(command=command, env={"PYTHONPATH": str(TORCHTITAN), **LAUNCHER_ENV}, cwd=workdir, notes=notes)


def llama3_8b_fsdp8(case: dict[str, Any], workdir: Path) -> TrainerRun:
    """Table 1, row "FSDP": bf16 FSDP2 over fp32 shards (torchtitan's default mixed precision),
    selective op-level activation checkpointing, no compile."""
    return _llama3_8b_fsdp(case, workdir, [], [])


def llama3_8b_fsdp8_compile(case: dict[str, Any], workdir: Path) -> TrainerRun:
    """Table 1, row "FSDP + torch.compile": the same, each transformer block and the loss
    compiled (`--compile.enable`; the TOML's components are model and loss)."""
    return _llama3_8b_fsdp(case, workdir, ["--compile.enable", *COMPILED_AS_THEN], [COMPILED_AS_THEN_NOTE])


def llama3_8b_fsdp8_compile_float8(case: dict[str, Any], workdir: Path) -> TrainerRun:
    """Table 1, row "FSDP + torch.compile + Float8": the same with torchtitan's float8
    converter (torchao `Float8Linear`, tensorwise scaling; the TOML filters out the output
    head and leaves float8 all-gathers off)."""
    return _llama3_8b_fsdp(case, workdir, ["--compile.enable", *COMPILED_AS_THEN, "--model.converters",
                                           "quantize.linear.float8"],
                           [COMPILED_AS_THEN_NOTE,
                            "float8: the TOML's own settings (bf16 all-gathers), as the source does not say"])


RUNS = {
    "torchtitan-llama3.1-8b-fsdp8": llama3_8b_fsdp8,
    "torchtitan-llama3.1-8b-fsdp8-compile": llama3_8b_fsdp8_compile,
    "torchtitan-llama3.1-8b-fsdp8-compile-float8": llama3_8b_fsdp8_compile_float8,
}
