"""LitGPT's config-hub fine-tunes (config_hub/finetune/README.md) run as the README runs them.

The command is `litgpt finetune_lora CHECKPOINT_DIR --config CONFIG.yaml` (`finetune_full` for
a full fine-tune), litgpt 0.5.13's console script, with the data replaced by LitGPT's `JSON`
data module on a local file (`--data JSON --data.json_path F`); every other setting is the
published YAML's (`config_url` of each case in published_gpu.json, quoted in `CONFIGS` below).
Those YAMLs predate litgpt 0.4's `optimizer` argument: their `train.learning_rate`,
`weight_decay`, `beta1` and `beta2` were the AdamW of the fine-tuning script then
(`torch.optim.AdamW`, or bitsandbytes' `PagedAdamW` under `--quantize bnb.*`), which
0.5.13 builds from `optimizer: {class_path: torch.optim.AdamW, init_args: ...}`
(`instantiate_torch_optimizer`, and `instantiate_bnb_optimizer` for the paged one), so the
YAML written here says it that way.

What is made locally (`write_lit_checkpoint`, `write_instructions`):

- the checkpoint folder LitGPT's `convert_hf_checkpoint` writes: `model_config.yaml` of
  LitGPT's own named config (`Config.from_name`), `lit_model.pth` the `torch.save`d state
  dict of `GPT(config)` built on the `meta` device (shapes and dtypes, no data: `memplan
  run` gives a fake tensor for each floating-point meta tensor it unpickles, docs/run.md
  "Checkpoints"), and a word-level tokenizer of the config's `vocab_size`;
- instruction/output pairs of that tokenizer's words, each longer than the config's
  `max_seq_length` once in LitGPT's prompt, so that every batch is `micro_batch_size` x
  `max_seq_length` (the cases' guess: the longest Alpaca2k batch reaches 512 tokens).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from published_runs import TrainerRun
from published_runs.assets import words, write_word_tokenizer

# The published YAMLs' settings (the config_url of each case; comments and empty keys left out).
_LORA_QV = {"lora_r": 32, "lora_alpha": 16, "lora_dropout": 0.05, "lora_query": True, "lora_key": False,
            "lora_value": True, "lora_projection": False, "lora_mlp": False, "lora_head": False}
_LORA_ALL = {**_LORA_QV, "lora_key": True, "lora_projection": True, "lora_mlp": True, "lora_head": True}
_ADAMW = {"learning_rate": 0.0002, "weight_decay": 0.0, "beta1": 0.9, "beta2": 0.95}
_ALPACA2K = {"mask_prompt": False, "prompt_style": "alpaca", "ignore_index": -100, "seed": 42, "num_workers": 4}


def _config(checkpoint_dir: str, method: str, lora: dict[str, Any], quantize: str | None, data: dict[str, Any],
            train: dict[str, Any], eval_: dict[str, Any]) -> dict[str, Any]:
    return {"checkpoint_dir": checkpoint_dir, "method": method, "precision": "bf16-true", "quantize": quantize,
            "devices": 1, **lora, "data": {**_ALPACA2K, **data},
            "train": {"log_interval": 1, "max_seq_length": 512, "min_lr": 6.0e-05, **train},
            "eval": {"max_new_tokens": 100, "max_iters": 100, **eval_}, "logger_name": "csv", "seed": 1337}


CONFIGS: dict[str, dict[str, Any]] = {
    "litgpt-llama2-7b-lora": _config(
        "checkpoints/meta-llama/Llama-2-7b-hf", "lora", _LORA_QV, None, {},
        {"save_interval": 200, "global_batch_size": 8, "micro_batch_size": 2, "lr_warmup_steps": 10, "epochs": 4,
         **_ADAMW}, {"interval": 100}),
    "litgpt-llama3-8b-lora": _config(
        "checkpoints/meta-llama/Meta-Llama-3-8B", "lora", _LORA_QV, None, {},
        {"save_interval": 200, "global_batch_size": 8, "micro_batch_size": 1, "lr_warmup_steps": 10, "epochs": 2,
         **_ADAMW}, {"interval": 100, "initial_validation": False, "final_validation": True}),
    "litgpt-tinyllama-full": _config(
        "checkpoints/TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T", "full", {}, None,
        {"val_split_fraction": 0.03847},
        {"save_interval": 800, "global_batch_size": 32, "micro_batch_size": 4, "lr_warmup_steps": 1000, "epochs": 1,
         **_ADAMW}, {"interval": 25}),
    "litgpt-tinyllama-lora": _config(
        "checkpoints/TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T", "lora", _LORA_ALL, None,
        {"val_split_fraction": 0.03847},
        {"save_interval": 800, "global_batch_size": 8, "micro_batch_size": 8, "lr_warmup_steps": 10, "epochs": 3,
         **_ADAMW}, {"interval": 100}),
    "litgpt-llama2-7b-qlora": _config(
        "checkpoints/meta-llama/Llama-2-7b-hf", "lora", _LORA_QV, "bnb.nf4", {"val_split_fraction": 0.05},
        {"save_interval": 200, "global_batch_size": 8, "micro_batch_size": 2, "lr_warmup_steps": 10, "epochs": 4,
         **_ADAMW}, {"interval": 100}),
    "litgpt-llama3-8b-qlora": _config(
        "checkpoints/meta-llama/Meta-Llama-3-8B", "lora", _LORA_QV, "bnb.nf4", {"val_split_fraction": 0.05},
        {"save_interval": 200, "global_batch_size": 8, "micro_batch_size": 2, "lr_warmup_steps": 10, "epochs": 2,
         **_ADAMW}, {"interval": 100, "initial_validation": False, "final_validation": True}),
    "litgpt-mistral-7b-qlora": _config(
        "checkpoints/mistralai/Mistral-7B-v0.1", "lora", _LORA_QV, "bnb.nf4", {"val_split_fraction": 0.05},
        {"save_interval": 200, "global_batch_size": 8, "micro_batch_size": 2, "lr_warmup_steps": 10, "epochs": 4,
         **_ADAMW}, {"interval": 100}),
}
# Alpaca2k's own split where a YAML names none (litgpt/data/alpaca_2k.py, `val_split_fraction`).
ALPACA2K_VAL_SPLIT = 0.05


def write_lit_checkpoint(folder: Path, name: str, dtype: str = "bfloat16") -> Any:
    """`folder` as LitGPT's checkpoint of the model LitGPT names `name`: its `model_config.yaml`,
    a `lit_model.pth` of meta tensors (the state dict of `GPT(config)` built on `meta`, in
    `dtype`: names, shapes and dtypes, no data) and a word-level tokenizer of `vocab_size`
    tokens; the `litgpt.Config`."""
    import torch
    from litgpt import GPT, Config
    from litgpt.utils import save_config

    folder.mkdir(parents=True, exist_ok=True)
    config = Config.from_name(name)
    save_config(config, folder)
    with torch.device("meta"):
        model = GPT(config).to(getattr(torch, dtype))
    torch.save(model.state_dict(), folder / "lit_model.pth")
    write_word_tokenizer(folder, config.vocab_size)
    return config


def write_instructions(path: Path, count: int, vocab_size: int, words_per_field: int) -> Path:
    """LitGPT's instruction format (a JSON list of `instruction`, `input`, `output`), `count`
    samples of `words_per_field` words in the instruction and in the output."""
    path.write_text(json.dumps([{"instruction": words(words_per_field, vocab_size, seed=2 * i), "input": "",
                                 "output": words(words_per_field, vocab_size, seed=2 * i + 1)}
                                for i in range(count)]))
    return path


def _optimizer(train: dict[str, Any]) -> dict[str, Any]:
    """The YAML's AdamW settings as litgpt 0.5.13's `optimizer` argument (module docstring)."""
    return {"class_path": "torch.optim.AdamW",
            "init_args": {"lr": train.pop("learning_rate"), "weight_decay": train.pop("weight_decay"),
                          "betas": [train.pop("beta1"), train.pop("beta2")]}}


def _yaml_settings(published: dict[str, Any]) -> dict[str, Any]:
    """The settings of `litgpt finetune_* --config` for litgpt 0.5.13: the published ones, the
    optimizer said as 0.5.13 says it, the data module LitGPT's `JSON` (its file on the
    command line)."""
    settings = {k: v for k, v in published.items() if k not in ("checkpoint_dir", "method")}
    settings["train"] = dict(settings["train"])
    settings["optimizer"] = _optimizer(settings["train"])
    data = {"val_split_fraction": ALPACA2K_VAL_SPLIT, **settings["data"]}
    settings["data"] = {"class_path": "litgpt.data.JSON", "init_args": data}
    if settings.get("quantize") is None:
        settings.pop("quantize", None)
    return settings


def _prepare(case_id: str) -> Any:
    def prepare(case: dict[str, Any], workdir: Path) -> TrainerRun:
        import yaml

        published = CONFIGS[case_id]
        checkpoint_dir = Path(published["checkpoint_dir"])
        config = write_lit_checkpoint(workdir / checkpoint_dir, checkpoint_dir.name)
        settings = _yaml_settings(published)
        global_batch = settings["train"]["global_batch_size"]
        # enough samples for memplan's steps (3 optimizer steps by default) within one epoch
        data = write_instructions(workdir / "instructions.json", 8 * global_batch, config.vocab_size,
                                  settings["train"]["max_seq_length"] // 2 + 8)
        (workdir / "config.yaml").write_text(yaml.safe_dump(settings, sort_keys=False))
        return TrainerRun(
            command=["litgpt", f"finetune_{published['method']}", str(checkpoint_dir), "--config", "config.yaml",
                     "--data", "JSON", "--data.json_path", str(data.relative_to(workdir))],
            cwd=workdir,
            notes=[f"the config YAML's settings ({published['method']}, {settings['precision']}"
                   f"{', ' + published['quantize'] if published['quantize'] else ''}), AdamW said as litgpt 0.5.13's "
                   "optimizer argument",
                   f"LitGPT's {checkpoint_dir.name} config, weights of shapes only (a lit_model.pth of meta tensors)",
                   f"a word-level tokenizer of {config.vocab_size} tokens",
                   f"LitGPT's JSON data module on {8 * global_batch} synthetic samples, each over "
                   f"{settings['train']['max_seq_length']} tokens (batches {settings['train']['micro_batch_size']} x "
                   f"{settings['train']['max_seq_length']})"])
    return prepare


RUNS = {case_id: _prepare(case_id) for case_id in CONFIGS}
