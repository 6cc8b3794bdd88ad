"""A `TrainingArguments` JSON (`HfArgumentParser.parse_json_file`), read as memplan's setup
and layout, with the model options the example scripts and TRL keep beside it
(docs/inputs.md lists each key)."""

from __future__ import annotations

from typing import Any

from memplan.errors import UserError
from memplan.trainers import mapping as tm
from memplan.trainers.mapping import NOT_MEMORY, Mapper

# Prefixes of TrainingArguments fields (and of the script options usually kept beside
# them) that do not change one step's memory.
HF_NOT_MEMORY = ("output_dir", "overwrite_output_dir", "logging", "save_", "eval", "learning_rate", "lr_",
                 "warmup", "weight_decay", "adam_", "max_grad_norm", "num_train_epochs", "max_steps", "seed",
                 "data_seed", "report_to", "run_name", "push_to_hub", "hub_", "dataloader", "remove_unused_columns",
                 "label_names", "do_", "disable_tqdm", "resume_from_checkpoint", "metric_for_best_model",
                 "load_best_model_at_end", "greater_is_better", "ddp_", "local_rank", "tf32", "dataset",
                 "packing", "optim_args", "gradient_checkpointing_kwargs", "include_", "group_by_length",
                 "per_device_eval_batch_size", "prediction_loss_only", "tokenizer_name", "cache_dir",
                 "train_file", "validation_file", "preprocessing_num_workers", "lora_dropout", "trust_remote_code")
HF_LONG = ("max_seq_length", "max_length", "block_size")
HF_LORA = ("lora_r", "lora_alpha", "lora_target_modules", "use_dora")  # TRL's ModelConfig
HF_QUANT = ("load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type", "use_bnb_nested_quant", "bnb_4bit_quant_storage",
            "bnb_4bit_compute_dtype")


def training_arguments_fields() -> list[str]:
    """The fields of transformers' `TrainingArguments` (the keys a file of this format may hold)."""
    import dataclasses

    from transformers import TrainingArguments

    return [f.name for f in dataclasses.fields(TrainingArguments)]


def read(m: Mapper, data: dict[str, Any]) -> None:
    """A TrainingArguments JSON (`HfArgumentParser.parse_json_file`), with the model
    options the example scripts and TRL keep beside it (`model_name_or_path`, `torch_dtype`,
    TRL's ModelConfig LoRA and bitsandbytes options)."""
    peft = m.flag("use_peft", data.get("use_peft", False))
    for key, value in data.items():
        if value is None:
            m.ignore(key, "empty")
        elif key in HF_KEYS:
            HF_KEYS[key](m, key, value)
        elif key in HF_LONG:
            m.set(key, "seq", m.whole(key, value))
        elif key in HF_LORA:
            _hf_lora(m, key, value, peft)
        elif key in HF_QUANT:
            _hf_quantisation(m, key, value, data)
        elif key == "packing":
            m.ignore(key, "packing fills each sequence to the length, as memplan's batches always are")
        elif key.startswith(HF_NOT_MEMORY):
            m.ignore(key, tm.LORA_DROPOUT if key == "lora_dropout" and value else NOT_MEMORY)
        else:
            m.unknown(key, [*HF_KEYS, *HF_LONG, *HF_LORA, *HF_QUANT, *training_arguments_fields()])


def _hf_lora(m: Mapper, key: str, value: Any, peft: bool) -> None:
    if not peft:
        m.ignore(key, "use_peft is not set")
    elif key == "lora_r":
        m.set(key, "lora_rank", m.whole(key, value))
    elif key == "lora_alpha":
        m.set(key, "lora_alpha", m.number(key, value))
    elif key == "use_dora":
        if m.flag(key, value):
            m.set(key, "dora", True)
    else:
        tm.lora_targets(m, key, value)


def _hf_quantisation(m: Mapper, key: str, value: Any, data: dict[str, Any]) -> None:
    """TRL's ModelConfig bitsandbytes options (trl/trainer/model_config.py): 4-bit takes
    `bnb_4bit_quant_type` (nf4 by default there) and `use_bnb_nested_quant`."""
    if key == "load_in_8bit":
        if m.flag(key, value):
            m.set(key, "quant", "int8")
    elif key == "load_in_4bit":
        if m.flag(key, value):
            m.set(key, "quant", data.get("bnb_4bit_quant_type", "nf4"))
    elif data.get("load_in_4bit"):
        tm.bnb_option(m, key, key, value)
    else:
        m.ignore(key, "load_in_4bit is not set")


def _hf_fsdp_config(m: Mapper, key: str, value: Any) -> None:
    if isinstance(value, dict):
        tm.fsdp_options(m, key, value)
    else:
        m.ignore(key, "a path to an FSDP config: give its options as flags")


def _hf_liger(m: Mapper, key: str, value: Any) -> None:
    if m.flag(key, value):
        raise UserError(f"{m.path}: {key}: true patches every Liger kernel (RoPE, RMSNorm, SwiGLU, fused linear "
                        "cross-entropy); memplan models only the last: leave it out and give `loss=fused-linear`")
    m.ignore(key, "false")


HF_KEYS = {
    "model_name_or_path": lambda m, k, v: m.set(k, "model", str(v)),
    "torch_dtype": lambda m, k, v: m.set(k, "dtype", m.dtype(k, v), "the model is loaded in it")
    if v != "auto" else m.ignore(k, "auto: the checkpoint's dtype, which memplan does not read"),
    "dtype": lambda m, k, v: HF_KEYS["torch_dtype"](m, k, v),
    "per_device_train_batch_size": lambda m, k, v: m.set(k, "batch", m.whole(k, v)),
    "gradient_accumulation_steps": lambda m, k, v: m.set(k, "grad_accum", m.whole(k, v)),
    "bf16": tm.set_if_true("autocast", "bf16", "the Trainer's mixed precision"),
    "fp16": tm.set_if_true("autocast", "fp16", "the Trainer's mixed precision"),
    "gradient_checkpointing": tm.set_if_true("checkpointing", "full", "HF gradient_checkpointing_enable"),
    "optim": tm.hf_optimizer,
    "torch_compile": tm.set_if_true("compile", "model", "the Trainer compiles the whole model"),
    "fsdp": tm.hf_fsdp,
    "fsdp_config": _hf_fsdp_config,
    "deepspeed": tm.deepspeed,
    "attn_implementation": tm.attention,
    "use_liger_kernel": _hf_liger,
    "use_peft": lambda m, k, v: m.note(k, "LoRA from lora_r") if m.flag(k, v) else m.ignore(k, "false"),
    "auto_find_batch_size": lambda m, k, v: m.ignore(k, "the batch it finds at run time: memplan takes "
                                                        "per_device_train_batch_size"),
}
