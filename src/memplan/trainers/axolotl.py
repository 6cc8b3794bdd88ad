"""axolotl's YAML, read as memplan's setup and layout (keys after axolotl's `examples/`,
`docs/config.qmd` and `src/axolotl/loaders/model.py`; docs/inputs.md lists each)."""

from __future__ import annotations

from typing import Any

from memplan.errors import UserError
from memplan.trainers import mapping as tm
from memplan.trainers.mapping import NOT_MEMORY, Mapper

# Keys that change nothing in one step's memory (axolotl's docs/config.qmd lists them all).
AXOLOTL_NOT_MEMORY = {
    "datasets", "test_datasets", "dataset_prepared_path", "val_set_size", "output_dir", "num_epochs",
    "max_steps", "learning_rate", "lr_scheduler", "weight_decay", "evals_per_epoch", "saves_per_epoch",
    "logging_steps", "resume_from_checkpoint", "seed", "strict", "train_on_inputs", "group_by_length",
    "tokenizer_type", "model_type", "special_tokens", "tf32", "eval_sample_packing", "pad_to_sequence_len",
    "warmup_ratio", "warmup_steps", "save_steps", "eval_steps", "save_safetensors", "lora_model_dir",
    "chat_template", "tokens", "hub_model_id", "save_total_limit", "max_grad_norm", "adam_beta1", "adam_beta2",
    "adam_epsilon", "early_stopping_patience", "local_rank", "xformers_attention", "plugins", "eval_table_size",
    "lora_modules_to_save", "gradient_checkpointing_kwargs", "dataset_processes", "shuffle_merged_datasets",
}
AXOLOTL_PREFIXES = ("wandb_", "mlflow_", "comet_", "hub_", "loss_watchdog", "eval_", "save_", "lr_", "dataloader_")
AXOLOTL_UNMODELLED = ("flex_attention", "s2_attention", "liger_rope", "liger_rms_norm", "liger_glu_activation",
                      "liger_layer_norm", "unsloth_lora_mlp", "unsloth_lora_qkv", "unsloth_lora_o", "relora")


def read(m: Mapper, data: dict[str, Any]) -> None:
    """axolotl's YAML (keys after its `examples/` and `src/axolotl/loaders/model.py`)."""
    for key, value in data.items():
        if value is None or value == []:
            m.ignore(key, "empty")
        elif key in AXOLOTL_UNMODELLED and value:
            raise UserError(f"{m.path}: {key}: true is not modelled by memplan (its kernels or attention "
                            "allocate what memplan does not trace): set it false or leave it out")
        elif key in AXOLOTL_KEYS:
            AXOLOTL_KEYS[key](m, key, value)
        elif key in AXOLOTL_NOT_MEMORY or key.startswith(AXOLOTL_PREFIXES):
            m.ignore(key, NOT_MEMORY)
        else:
            m.unknown(key, [*AXOLOTL_KEYS, *AXOLOTL_NOT_MEMORY, *AXOLOTL_UNMODELLED])
    _axolotl_combined(m, data)


def _axolotl_precision(m: Mapper, key: str, value: Any) -> None:
    """bf16 / fp16: axolotl loads the model in that dtype (`cfg.torch_dtype`) and the Trainer
    autocasts to it; `auto` is bf16 where the GPU has it (axolotl's normalize_config)."""
    dtype = "bf16" if key == "bf16" else "fp16"
    if value == "auto" and key == "bf16":
        note = "auto: bf16, which axolotl picks where the GPU has it"
    elif m.flag(key, value):
        note = "the model is loaded in it"
    else:
        m.ignore(key, "false")
        return
    m.set(key, "dtype", dtype, note)
    m.set(key, "autocast", dtype)


def _axolotl_adapter(m: Mapper, key: str, value: Any) -> None:
    if value not in ("lora", "qlora"):
        raise m.refuse(key, value, "lora or qlora")
    m.note(key, f"LoRA, its rank from lora_r{', its base from load_in_4bit' if value == 'qlora' else ''}")


def _axolotl_checkpointing(m: Mapper, key: str, value: Any) -> None:
    if m.flag(key, value):
        m.set(key, "checkpointing", "full", "HF gradient_checkpointing_enable: every block")
    else:
        m.ignore(key, "false")


def _axolotl_loss(m: Mapper, key: str, value: Any) -> None:
    if not m.flag(key, value):
        m.ignore(key, "false")
    elif key == "chunked_cross_entropy":
        m.set(key, "loss", "chunked")
    else:
        m.set(key, "loss", "fused-linear")


def _axolotl_compile(m: Mapper, key: str, value: Any) -> None:
    if m.flag(key, value):
        m.set(key, "compile", "model", "the Trainer compiles the whole model")
    else:
        m.ignore(key, "false")


def _axolotl_attention(m: Mapper, key: str, value: Any) -> None:
    if m.flag(key, value):
        m.set(key, "attn", {"flash_attention": "flash", "sdp_attention": "sdpa", "eager_attention": "eager"}[key])
    else:
        m.ignore(key, "false")


AXOLOTL_KEYS = {
    "base_model": lambda m, k, v: m.set(k, "model", str(v)),
    "base_model_config": lambda m, k, v: m.set(k, "model", str(v), "the config axolotl reads"),
    "micro_batch_size": lambda m, k, v: m.set(k, "batch", m.whole(k, v)),
    "gradient_accumulation_steps": lambda m, k, v: m.set(k, "grad_accum", m.whole(k, v)),
    "sequence_len": lambda m, k, v: (m.set(k, "seq", m.whole(k, v)),
                                     m.set(k, "allow_long_seq", True, "axolotl raises max_position_embeddings")),
    "sample_packing": lambda m, k, v: m.ignore(k, "packing fills each sequence to sequence_len, as memplan's "
                                                  "batches always are"),
    "bf16": _axolotl_precision, "fp16": _axolotl_precision,
    "adapter": _axolotl_adapter,
    "lora_r": lambda m, k, v: m.set(k, "lora_rank", m.whole(k, v)),
    "lora_alpha": lambda m, k, v: m.set(k, "lora_alpha", m.number(k, v)),
    "lora_dropout": lambda m, k, v: m.ignore(k, tm.LORA_DROPOUT if v else "0: no dropout"),
    "lora_target_modules": tm.lora_targets,
    "lora_target_linear": tm.set_if_true("lora_targets", ("all-linear",)),
    "peft_use_dora": tm.set_if_true("dora", True),
    "load_in_8bit": tm.set_if_true("quant", "int8", "bitsandbytes Linear8bitLt"),
    "load_in_4bit": lambda m, k, v: None if m.flag(k, v) else m.ignore(k, "false"),  # read below, with adapter
    "bnb_config_kwargs": lambda m, k, v: None,  # read below, with load_in_4bit
    "gradient_checkpointing": _axolotl_checkpointing,
    "activation_offloading": tm.set_if_true("activation_offload", "torchtune", "axolotl's port of torchtune's"),
    "optimizer": tm.hf_optimizer,
    "flash_attention": _axolotl_attention, "sdp_attention": _axolotl_attention,
    "eager_attention": _axolotl_attention,
    "attn_implementation": tm.attention,
    "torch_compile": _axolotl_compile,
    "chunked_cross_entropy": _axolotl_loss,
    "liger_fused_linear_cross_entropy": _axolotl_loss, "cut_cross_entropy": _axolotl_loss,
    "fsdp": tm.hf_fsdp,
    "fsdp_config": lambda m, k, v: tm.fsdp_options(m, k, v),
    "deepspeed": tm.deepspeed,
    "trust_remote_code": lambda m, k, v: m.ignore(k, "memplan runs a repository's code only with "
                                                     "--trust-remote-code"),
}


def _axolotl_combined(m: Mapper, data: dict[str, Any]) -> None:
    """The keys axolotl reads together. adapter needs lora_r. load_in_4bit with adapter qlora: axolotl's BitsAndBytesConfig (nf4, double quant,
    bf16 storage; `bnb_config_kwargs` override it), src/axolotl/loaders/model.py
    `_set_quantization_config`; alone, transformers' defaults (fp4). Under FSDP or ZeRO-3
    axolotl skips peft's prepare_model_for_kbit_training (`_prepare_model_for_quantization`)."""
    adapter = data.get("adapter")
    if adapter in ("lora", "qlora") and not data.get("lora_r"):
        raise UserError(f"{m.path}: adapter {adapter} needs lora_r (the LoRA rank), as axolotl requires")
    if adapter == "qlora" and not data.get("load_in_4bit"):
        raise UserError(f"{m.path}: adapter qlora needs load_in_4bit: true (as axolotl requires)")
    if data.get("load_in_4bit"):
        if adapter == "qlora":
            m.set("load_in_4bit", "quant", "nf4", "axolotl's QLoRA BitsAndBytesConfig")
            m.set("load_in_4bit", "double_quant", True)
            m.set("load_in_4bit", "quant_storage", "bf16")
        else:
            m.set("load_in_4bit", "quant", "fp4", "transformers' BitsAndBytesConfig defaults")
        for name, value in (data.get("bnb_config_kwargs") or {}).items():
            tm.bnb_option(m, f"bnb_config_kwargs.{name}", name, value)
    elif data.get("bnb_config_kwargs"):
        m.ignore("bnb_config_kwargs", "load_in_4bit is not set")
    quantised = data.get("load_in_4bit") or data.get("load_in_8bit")
    if quantised and (data.get("fsdp") or m.config.layout.get("zero") == 3):
        m.set("fsdp" if data.get("fsdp") else "deepspeed", "kbit_prep", False,
              "axolotl skips prepare_model_for_kbit_training when sharding")


