"""A trainer's own configuration file, read as memplan's training setup and parallel layout.

`read_trainer_config(path)` reads one of five formats into a `TrainerConfig`
(`memplan.models.trainer_mapping`): the model it names, the `TrainingSetup` fields and
the parallel-layout fields it sets (the caller builds the `Layout`: parallel sits above
models), and, key by key, what each key did (`used`) or why it was left out (`ignored`).
A value memplan does not know is refused in one line (`UserError`); what the file cannot
settle alone (the world size a launcher gives) is `unresolved` until the caller gives it.

| format | recognised by | keys written from |
|---|---|---|
| axolotl YAML | `base_model`, `micro_batch_size` or `sequence_len` | axolotl's `examples/`, `src/axolotl/loaders/model.py` |
| torchtune recipe YAML | `_component_` entries (`model`, `optimizer`, `loss`) | torchtune's `recipes/configs/` |
| torchtitan TOML | a `.toml` file | torchtitan's `train_configs/*.toml`, `torchtitan/config/job_config.py` |
| accelerate config YAML | `distributed_type` or `compute_environment` | the file `accelerate config` writes |
| `TrainingArguments` JSON | a `.json` file | `transformers.TrainingArguments` (+ TRL's model options) |

docs/inputs.md lists every key of every format with what it sets.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from memplan.errors import UserError
from memplan.models import trainer_mapping as tm
from memplan.models.setup import DEFAULT_LOSS_CHUNKS
from memplan.models.trainer_mapping import NOT_MAPPED, NOT_MEMORY, Mapper, TrainerConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, published as `tomli`
    import tomli as tomllib

FORMATS = ("axolotl", "torchtune", "torchtitan", "accelerate", "hf-trainer")


def read_trainer_config(path: str | Path) -> TrainerConfig:
    """The model, setup and layout fields a trainer's configuration file sets (module docstring)."""
    path = Path(path).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read --from {path}: {getattr(exc, 'strerror', None) or exc}") from None
    data = _parse(path, text)
    fmt = detect_format(path, data)
    m = Mapper(path, fmt)
    {"axolotl": read_axolotl, "torchtune": read_torchtune, "torchtitan": read_torchtitan,
     "accelerate": read_accelerate, "hf-trainer": read_hf_trainer}[fmt](m, data)
    return m.config


def _parse(path: Path, text: str) -> dict[str, Any]:
    """The file as a dict: TOML or JSON by its suffix, YAML otherwise."""
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(text)
        elif path.suffix == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as exc:  # tomllib, json and yaml each raise their own error types
        raise UserError(f"--from {path} does not parse: {' '.join(str(exc).split())[:200]}") from None
    if not isinstance(data, dict):
        raise UserError(f"--from {path} must hold a mapping of keys, not {type(data).__name__}")
    return data


def detect_format(path: Path, data: dict[str, Any]) -> str:
    """Which trainer wrote `data` (the table in the module docstring)."""
    if "distributed_type" in data or "compute_environment" in data:
        return "accelerate"
    if path.suffix == ".toml":
        return "torchtitan"
    if path.suffix == ".json":
        return "hf-trainer"
    if any(isinstance(v, dict) and "_component_" in v for v in data.values()):
        return "torchtune"
    if {"base_model", "micro_batch_size", "sequence_len"} & set(data):
        return "axolotl"
    raise UserError(f"--from {path}: not a configuration memplan reads (an axolotl or torchtune YAML, a "
                    "torchtitan TOML, an accelerate config YAML or a TrainingArguments JSON)")


# ----------------------------------------------------------------------------- axolotl
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


def read_axolotl(m: Mapper, data: dict[str, Any]) -> None:
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
            m.ignore(key, NOT_MAPPED)
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


def _set_if_true(name: str, value: Any, note: str = "") -> Any:
    def handler(m: Mapper, key: str, flag: Any) -> None:
        if m.flag(key, flag):
            m.set(key, name, value, note)
        else:
            m.ignore(key, "false")
    return handler


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
    "lora_target_linear": _set_if_true("lora_targets", ("all-linear",)),
    "peft_use_dora": _set_if_true("dora", True),
    "load_in_8bit": _set_if_true("quant", "int8", "bitsandbytes Linear8bitLt"),
    "load_in_4bit": lambda m, k, v: None if m.flag(k, v) else m.ignore(k, "false"),  # read below, with adapter
    "bnb_config_kwargs": lambda m, k, v: None,  # read below, with load_in_4bit
    "gradient_checkpointing": _axolotl_checkpointing,
    "activation_offloading": _set_if_true("activation_offload", "torchtune", "axolotl's port of torchtune's"),
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
            _bnb_option(m, f"bnb_config_kwargs.{name}", name, value)
    elif data.get("bnb_config_kwargs"):
        m.ignore("bnb_config_kwargs", "load_in_4bit is not set")
    quantised = data.get("load_in_4bit") or data.get("load_in_8bit")
    if quantised and (data.get("fsdp") or m.config.layout.get("zero") == 3):
        m.set("fsdp" if data.get("fsdp") else "deepspeed", "kbit_prep", False,
              "axolotl skips prepare_model_for_kbit_training when sharding")


def _bnb_option(m: Mapper, key: str, name: str, value: Any) -> None:
    """A `BitsAndBytesConfig` argument (axolotl's bnb_config_kwargs, TRL's model options)."""
    if name == "bnb_4bit_quant_type":
        if value not in ("nf4", "fp4"):
            raise m.refuse(key, value, "nf4 or fp4")
        m.set(key, "quant", value)
    elif name in ("bnb_4bit_use_double_quant", "use_bnb_nested_quant"):
        m.set(key, "double_quant", m.flag(key, value))
    elif name == "bnb_4bit_quant_storage":
        m.set(key, "quant_storage", m.dtype(key, value, tm.QUANT_STORAGE_NAMES))
    elif name == "bnb_4bit_compute_dtype":
        m.set(key, "compute_dtype", m.dtype(key, value))
    else:
        m.ignore(key, NOT_MAPPED)


# ----------------------------------------------------------------------------- torchtune
TORCHTUNE_NOT_MEMORY = {
    "output_dir", "seed", "shuffle", "epochs", "max_steps_per_epoch", "metric_logger", "log_every_n_steps",
    "log_peak_memory_stats", "profiler", "resume_from_checkpoint", "save_adapter_weights_only", "lr_scheduler",
    "clip_grad_norm", "dataset_val", "run_val_every_n_steps", "log_level", "tokenizer", "dataset",
    "checkpointer", "device", "compile_loss", "collate_fn",
}
TORCHTUNE_SHARDING = ("fsdp_cpu_offload", "fsdp_reshard_after_forward", "data_parallel_shard_dim",
                      "data_parallel_replicate_dim", "tensor_parallel_dim", "custom_sharded_layers")


def read_torchtune(m: Mapper, data: dict[str, Any]) -> None:
    """A torchtune recipe YAML (keys after torchtune's `recipes/configs/` and its recipes)."""
    for key, value in data.items():
        if key == "model" and isinstance(value, dict):
            _torchtune_model(m, value)
        elif key == "optimizer" and isinstance(value, dict):
            _torchtune_optimizer(m, value)
        elif key == "loss" and isinstance(value, dict):
            _torchtune_loss(m, value)
        elif key in TORCHTUNE_KEYS:
            TORCHTUNE_KEYS[key](m, key, value)
        elif key in TORCHTUNE_SHARDING:
            continue  # read below, together
        elif key in TORCHTUNE_NOT_MEMORY:
            _torchtune_not_memory(m, key, value)
        else:
            m.ignore(key, NOT_MAPPED)
    _torchtune_sharding(m, data)
    _torchtune_checkpoint_config(m, data.get("checkpointer"))


def _torchtune_not_memory(m: Mapper, key: str, value: Any) -> None:
    """Keys of components that do not change memory, but for the two settings that do."""
    if key == "tokenizer" and isinstance(value, dict) and value.get("max_seq_len") is not None:
        m.set("tokenizer.max_seq_len", "seq", m.whole("tokenizer.max_seq_len", value["max_seq_len"]))
    elif key == "dataset" and isinstance(value, dict) and value.get("packed"):
        m.ignore("dataset.packed", "packing fills each sequence to max_seq_len, as memplan's batches always are")
    if key not in m.config.used:
        m.ignore(key, NOT_MEMORY)


def _torchtune_model(m: Mapper, model: dict[str, Any]) -> None:
    """`model._component_` (torchtune.models.<family>.[lora_|qlora_]<builder>) and the LoRA
    builder arguments (torchtune/models/*/_model_builders.py)."""
    component = str(model.get("_component_", ""))
    builder = component.rsplit(".", 1)[-1]
    lora = builder.startswith(("lora_", "qlora_"))
    name = builder.removeprefix("qlora_").removeprefix("lora_").removesuffix("_instruct").removesuffix("_base")
    if name in tm.TORCHTUNE_MODELS:
        m.set("model._component_", "model", tm.TORCHTUNE_MODELS[name])
    else:
        m.ignore("model._component_", f"{component} has no memplan registry model")
        m.unresolved("model", f"{m.path}: model {component} has no memplan registry model: give MODEL "
                              "(a Hub id or a config.json path)")
    if builder.startswith("qlora_") or model.get("quantize_base"):
        m.set("model._component_", "quant", "nf4", "torchtune's QLoRA, built as bitsandbytes nf4 (torchtune "
                                                   "quantises with torchao's NF4Tensor)")
    targets = [tm.TORCHTUNE_LORA_MODULES.get(t, t) for t in model.get("lora_attn_modules") or []]
    if model.get("apply_lora_to_mlp"):
        targets += list(tm.TORCHTUNE_MLP_MODULES)
    if model.get("apply_lora_to_output"):
        targets.append("lm_head")
    if lora:
        m.set("model.lora_attn_modules", "lora_targets", tuple(targets))
    for key, value in model.items():
        _torchtune_model_argument(m, f"model.{key}", key, value)


def _torchtune_model_argument(m: Mapper, full: str, key: str, value: Any) -> None:
    if key == "lora_rank":
        m.set(full, "lora_rank", m.whole(full, value))
    elif key == "lora_alpha":
        m.set(full, "lora_alpha", m.number(full, value))
    elif key == "use_dora":
        if m.flag(full, value):
            m.set(full, "dora", True)
    elif key == "lora_dropout":
        m.ignore(full, tm.LORA_DROPOUT if value else "0: no dropout")
    elif key in ("apply_lora_to_mlp", "apply_lora_to_output", "quantize_base"):
        m.note(full, f"{value}: read with model._component_ and model.lora_attn_modules")
    elif key not in ("_component_", "lora_attn_modules"):
        m.ignore(full, NOT_MAPPED)


def _torchtune_optimizer(m: Mapper, opt: dict[str, Any]) -> None:
    component = str(opt.get("_component_", ""))
    if component in tm.CPU_OFFLOAD_OPTIMIZERS:
        m.set("optimizer._component_", "cpu_offload", "optimizer", "torchao CPUOffloadOptimizer")
        component = str(opt.get("optimizer_class", "torch.optim.AdamW"))
    if component not in tm.COMPONENT_OPTIMIZERS:
        raise m.refuse("optimizer._component_", component, ", ".join(tm.COMPONENT_OPTIMIZERS))
    m.set("optimizer._component_", "optimizer", tm.COMPONENT_OPTIMIZERS[component])
    for key in ("fused", "foreach"):
        if key in opt and m.flag(f"optimizer.{key}", opt[key]):
            m.set(f"optimizer.{key}", "optimizer_impl", key)
    for key in opt:
        if key not in ("_component_", "fused", "foreach", "optimizer_class"):
            m.ignore(f"optimizer.{key}", NOT_MEMORY)


def _torchtune_loss(m: Mapper, loss: dict[str, Any]) -> None:
    component = str(loss.get("_component_", ""))
    if component not in tm.COMPONENT_LOSSES:
        raise m.refuse("loss._component_", component, ", ".join(tm.COMPONENT_LOSSES))
    value = tm.COMPONENT_LOSSES[component]
    chunks = loss.get("num_output_chunks", DEFAULT_LOSS_CHUNKS)
    if value == "chunked" and chunks != DEFAULT_LOSS_CHUNKS:
        value = f"chunked:{m.whole('loss.num_output_chunks', chunks)}"
    m.set("loss._component_", "loss", value)


def _torchtune_flag(name: str, value: Any, note: str = "") -> Any:
    def handler(m: Mapper, key: str, flag: Any) -> None:
        if m.flag(key, flag):
            m.set(key, name, value, note)
        else:
            m.ignore(key, "false")
    return handler


TORCHTUNE_KEYS = {
    "batch_size": lambda m, k, v: m.set(k, "batch", m.whole(k, v)),
    "gradient_accumulation_steps": lambda m, k, v: m.set(k, "grad_accum", m.whole(k, v)),
    "dtype": lambda m, k, v: m.set(k, "dtype", m.dtype(k, v), "torchtune trains in it, without autocast"),
    "compile": _torchtune_flag("compile", "blocks", "torchtune compiles each layer and the loss"),
    "enable_activation_checkpointing": _torchtune_flag("checkpointing", "full"),
    "enable_activation_offloading": _torchtune_flag("activation_offload", "torchtune"),
    "optimizer_in_bwd": _torchtune_flag("optimizer_in_backward", True),
}


def _torchtune_sharding(m: Mapper, data: dict[str, Any]) -> None:
    """The distributed recipes' keys: FSDP2 over the data-parallel ranks, and TP."""
    present = [k for k in TORCHTUNE_SHARDING if k in data]
    if not present:
        return
    m.set(present[0], "zero", 3, "torchtune's distributed recipes shard with FSDP2")
    if data.get("fsdp_cpu_offload"):
        m.set("fsdp_cpu_offload", "cpu_offload", "params")
    if data.get("fsdp_reshard_after_forward", True) is not True:
        raise m.refuse("fsdp_reshard_after_forward", data["fsdp_reshard_after_forward"], "true")
    tp = data.get("tensor_parallel_dim", 1)
    if tp != 1:
        m.set("tensor_parallel_dim", "tp", m.whole("tensor_parallel_dim", tp))
    shard, replicate = data.get("data_parallel_shard_dim", -1), data.get("data_parallel_replicate_dim", 1)
    if shard == -1:
        m.unresolved("world_size", f"{m.path} shards over every GPU the launcher starts: give --world-size N")
    else:
        world = m.whole("data_parallel_shard_dim", shard) * m.whole("data_parallel_replicate_dim", replicate) * tp
        m.set("data_parallel_shard_dim", "world_size", world)
        if replicate > 1:
            m.set("data_parallel_replicate_dim", "shard_size", shard, "HSDP")
    for key in present:
        if key not in m.config.used:
            m.note(key, "read with the other sharding keys")


def _torchtune_checkpoint_config(m: Mapper, checkpointer: Any) -> None:
    """A local `checkpointer.checkpoint_dir` with a config.json is the model itself."""
    directory = checkpointer.get("checkpoint_dir") if isinstance(checkpointer, dict) else None
    if directory and (Path(str(directory)).expanduser() / "config.json").is_file():
        m.set("checkpointer.checkpoint_dir", "model", str(Path(str(directory)).expanduser()),
              "its config.json")
        m.config.unresolved.pop("model", None)


# ----------------------------------------------------------------------------- torchtitan
# Sections whose keys do not change one step's memory (torchtitan/config/job_config.py).
TORCHTITAN_NOT_MEMORY = ("job", "profiling", "metrics", "lr_scheduler", "checkpoint", "validation", "comm",
                         "fault_tolerance", "experimental", "memory_estimation", "debug", "float8", "mx",
                         "quantize", "dataloader")
TORCHTITAN_SCHEDULES = {"1F1B": "1f1b", "Interleaved1F1B": "interleaved", "InterleavedZeroBubble": "interleaved-zb",
                        "ZBVZeroBubble": "zbv"}


def read_torchtitan(m: Mapper, data: dict[str, Any]) -> None:
    """torchtitan's TOML (sections and keys of torchtitan/config/job_config.py)."""
    readers = {"model": _titan_model, "training": _titan_training, "compile": _titan_compile,
               "optimizer": _titan_optimizer, "parallelism": _titan_parallelism,
               "activation_checkpoint": _titan_checkpointing}
    for section, table in data.items():
        if not isinstance(table, dict):
            m.ignore(section, NOT_MAPPED)
        elif section in readers:
            readers[section](m, {f"{section}.{k}": v for k, v in table.items()})
        else:
            for key in table:
                m.ignore(f"{section}.{key}", NOT_MEMORY if section in TORCHTITAN_NOT_MEMORY else NOT_MAPPED)
    _titan_batches(m, data.get("training", {}), data.get("parallelism", {}))
    for section in ("training", "parallelism"):
        for key in data.get(section, {}):
            if f"{section}.{key}" not in m.config.used and f"{section}.{key}" not in m.config.ignored:
                m.note(f"{section}.{key}", f"{data[section][key]}: read with the batch and parallel degrees")


def _titan_model(m: Mapper, table: dict[str, Any]) -> None:
    name, flavor = str(table.get("model.name", "")), str(table.get("model.flavor", "")).lower()
    assets = table.get("model.hf_assets_path")
    if assets and (Path(str(assets)).expanduser() / "config.json").is_file():
        m.set("model.hf_assets_path", "model", str(Path(str(assets)).expanduser()), "its config.json")
    elif (name, flavor) in tm.TORCHTITAN_MODELS:
        m.set("model.flavor", "model", tm.TORCHTITAN_MODELS[(name, flavor)], f"torchtitan's {name} {flavor}")
    else:
        m.unresolved("model", f"{m.path}: torchtitan's {name} {flavor} has no memplan registry model: give MODEL "
                              "(a Hub id or a config.json path)")
    if table.get("model.converters"):
        raise UserError(f"{m.path}: model.converters {table['model.converters']!r}: float8 / MX training is not "
                        "modelled by memplan: leave the converters out")
    for key in table:
        if key == "model.name":
            m.note(key, "read with model.flavor")
        elif key not in m.config.used:
            m.ignore(key, NOT_MEMORY)


def _titan_training(m: Mapper, table: dict[str, Any]) -> None:
    for key, value in table.items():
        if key in ("training.local_batch_size", "training.batch_size", "training.global_batch_size"):
            continue  # read with the parallel degrees (`_titan_batches`)
        if key == "training.seq_len":
            m.set(key, "seq", m.whole(key, value))
        elif key == "training.compile":
            if m.flag(key, value):
                m.set(key, "compile", "blocks", "torchtitan compiles each TransformerBlock")
            else:
                m.ignore(key, "false")
        elif key == "training.mixed_precision_param":
            m.note(key, f"{value}: FSDP2's param_dtype, read with the parallel degrees")
        elif key == "training.enable_cpu_offload" and m.flag(key, value):
            m.set(key, "cpu_offload", "params", "FSDP2 CPUOffloadPolicy")
        elif key == "training.mixed_precision_reduce" and value != "float32":
            raise m.refuse(key, value, "float32: memplan's FSDP2 reduces in fp32")
        else:
            m.ignore(key, NOT_MEMORY)


def _titan_compile(m: Mapper, table: dict[str, Any]) -> None:
    for key, value in table.items():
        if key == "compile.enable" and m.flag(key, value):
            m.set(key, "compile", "blocks", "torchtitan compiles each TransformerBlock")
        else:
            m.ignore(key, "the components compiled: memplan compiles blocks and the loss")


def _titan_optimizer(m: Mapper, table: dict[str, Any]) -> None:
    impls = {"fused": "fused", "foreach": "foreach", "for-loop": "loop"}
    for key, value in table.items():
        if key == "optimizer.name":
            if value not in ("AdamW", "Adam"):
                raise m.refuse(key, value, "AdamW or Adam")
            m.set(key, "optimizer", value.lower())
        elif key == "optimizer.implementation":
            if value not in impls:
                raise m.refuse(key, value, ", ".join(impls))
            m.set(key, "optimizer_impl", impls[value])
        elif key == "optimizer.early_step_in_backward" and m.flag(key, value):
            m.set(key, "optimizer_in_backward", True)
        else:
            m.ignore(key, NOT_MEMORY)


def _titan_checkpointing(m: Mapper, table: dict[str, Any]) -> None:
    mode = table.get("activation_checkpoint.mode", "selective")
    option = str(table.get("activation_checkpoint.selective_ac_option", "2"))
    if mode == "none":
        m.ignore("activation_checkpoint.mode", "none: memplan's default")
    elif mode == "full" or (mode == "selective" and option == "1"):
        m.set("activation_checkpoint.mode", "checkpointing", "full")
    elif mode == "selective" and option == "op":
        m.set("activation_checkpoint.mode", "checkpointing", "selective-op", "torchtitan's op-level policy")
    else:
        raise m.refuse("activation_checkpoint.mode", f"{mode} / selective_ac_option {option}",
                       "none, full, selective with op or 1")
    for key in table:
        if key not in m.config.used and key not in m.config.ignored:
            m.note(key, "read with activation_checkpoint.mode")


def _titan_parallelism(m: Mapper, table: dict[str, Any]) -> None:
    """Read with the batch keys in `_titan_batches`; here the keys that need no other."""
    for key, value in table.items():
        if key == "parallelism.fsdp_reshard_after_forward" and value not in ("default", "always"):
            raise m.refuse(key, value, "default or always: memplan's FSDP2 reshards after forward")
        if key == "parallelism.pipeline_parallel_schedule" and value not in TORCHTITAN_SCHEDULES:
            raise m.refuse(key, value, ", ".join(TORCHTITAN_SCHEDULES))
        if not key.endswith(("_degree", "_schedule", "_microbatch_size")):
            m.ignore(key, NOT_MEMORY)


def _titan_batches(m: Mapper, training: dict[str, Any], par: dict[str, Any]) -> None:
    """Batch, micro-batches, gradient accumulation and the layout from the degrees
    (world = replicate x shard x cp x tp x pp; FSDP2 where shard > 1 or cp > 1, HSDP where replicate > 1;
    a pipeline splits the local batch into micro-batches of `pipeline_parallel_microbatch_size`)."""
    g = {k: par.get(f"{k}_degree", d) for k, d in (("data_parallel_replicate", 1), ("data_parallel_shard", -1),
                                                   ("tensor_parallel", 1), ("pipeline_parallel", 1),
                                                   ("context_parallel", 1))}
    replicate, shard, tp, pp = g["data_parallel_replicate"], g["data_parallel_shard"], \
        g["tensor_parallel"], g["pipeline_parallel"]
    cp = m.whole("parallelism.context_parallel_degree", g["context_parallel"])
    key = "parallelism.data_parallel_shard_degree"
    local_key = "training.local_batch_size" if "local_batch_size" in training else "training.batch_size"
    local = m.whole(local_key, training.get(local_key.split(".")[1], 8))
    if tp != 1:
        m.set("parallelism.tensor_parallel_degree", "tp", m.whole("parallelism.tensor_parallel_degree", tp))
    if pp != 1:
        _titan_pipeline(m, par, local, m.whole("parallelism.pipeline_parallel_degree", pp))
    else:
        m.set(local_key, "batch", local)
    if cp != 1:
        m.set("parallelism.context_parallel_degree", "cp", cp)
    if shard == -1 or shard > 1 or cp > 1:  # with CP, FSDP2 shards over dp_shard x cp (ParallelDims.fsdp_enabled)
        m.set(key, "zero", 3, "torchtitan shards with FSDP2")
        mixed = training.get("mixed_precision_param", "bfloat16")
        if mixed != "float32":
            m.set("training.mixed_precision_param", "fsdp_param_dtype", m.dtype("training.mixed_precision_param",
                                                                                 mixed))
    if shard == -1:
        m.unresolved("world_size", f"{m.path}: data_parallel_shard_degree = -1 takes every GPU the launcher "
                                   "starts: give --world-size N")
    else:
        m.set(key, "world_size", m.whole(key, shard) * m.whole(key, replicate) * tp * pp * cp)
    if replicate > 1 and shard > 1:
        m.set("parallelism.data_parallel_replicate_degree", "shard_size", shard, "HSDP")
    if "global_batch_size" in training and training["global_batch_size"] not in (-1, None) and shard != -1:
        per_step = local * shard * replicate
        m.set("training.global_batch_size", "grad_accum", max(1, m.whole("training.global_batch_size",
                                                                        training["global_batch_size"]) // per_step))


def _titan_pipeline(m: Mapper, par: dict[str, Any], local: int, pp: int) -> None:
    size_key = "parallelism.pipeline_parallel_microbatch_size"
    size = m.whole(size_key, par.get("pipeline_parallel_microbatch_size", 1))
    if local % size:
        raise m.refuse(size_key, size, f"a divisor of the local batch {local}")
    m.set("parallelism.pipeline_parallel_degree", "pp", pp)
    m.set(size_key, "batch", size, "a pipeline micro-batch")
    m.set(size_key, "microbatches", local // size)
    schedule = par.get("pipeline_parallel_schedule", "1F1B")
    m.set("parallelism.pipeline_parallel_schedule", "schedule", TORCHTITAN_SCHEDULES[schedule])


# ----------------------------------------------------------------------------- accelerate
ACCELERATE_NOT_MEMORY = {
    "compute_environment", "debug", "machine_rank", "main_training_function", "rdzv_backend", "same_network",
    "tpu_env", "tpu_use_cluster", "tpu_use_sudo", "downcast_bf16", "gpu_ids", "main_process_ip",
    "main_process_port", "enable_cpu_affinity", "use_cpu", "num_machines", "megatron_lm_config", "ipex_config",
}
ACCELERATE_SHARDING = {"FULL_SHARD": 3, "1": 3, "SHARD_GRAD_OP": 2, "2": 2, "NO_SHARD": 0, "3": 0,
                       "HYBRID_SHARD": 3, "4": 3}


def read_accelerate(m: Mapper, data: dict[str, Any]) -> None:
    """The YAML `accelerate config` writes (keys of accelerate's commands/config/cluster.py)."""
    kind = data.get("distributed_type", "NO")
    kind = "NO" if kind is False else kind  # YAML 1.1 reads an unquoted NO as false
    if kind not in ("NO", "MULTI_GPU", "FSDP", "DEEPSPEED"):
        raise m.refuse("distributed_type", kind, "NO, MULTI_GPU, FSDP or DEEPSPEED")
    processes = data.get("num_processes", 1)
    if kind != "NO":
        m.set("num_processes", "world_size", m.whole("num_processes", processes))
    for key, value in data.items():
        if key == "distributed_type":
            m.note(key, {"NO": "one process", "MULTI_GPU": "DDP: zero=0"}.get(kind, "read with its config"))
        elif key == "mixed_precision":
            _accelerate_precision(m, key, value, fsdp=kind == "FSDP")
        elif key == "fsdp_config" and kind == "FSDP":
            _accelerate_fsdp(m, key, dict(value or {}), processes, data.get("num_machines", 1))
        elif key == "deepspeed_config" and kind == "DEEPSPEED":
            _accelerate_deepspeed(m, key, dict(value or {}))
        elif key == "dynamo_config":
            backend = (value or {}).get("dynamo_backend", "NO")
            if backend != "NO":
                m.set(key, "compile", "model", f"torch.compile of the whole model ({backend})")
            else:
                m.ignore(key, "no torch.compile")
        elif key in ("num_processes",) and kind != "NO":
            continue
        elif key in ACCELERATE_NOT_MEMORY or key in ("fsdp_config", "deepspeed_config", "num_processes"):
            m.ignore(key, NOT_MEMORY)
        else:
            m.ignore(key, NOT_MAPPED)


def _accelerate_precision(m: Mapper, key: str, value: Any, *, fsdp: bool) -> None:
    """Accelerator(mixed_precision=...) autocasts the forward; the parameters stay fp32. Under
    FSDP accelerate also gives FSDP a mixed-precision policy of its own, which is not mapped."""
    if value in ("no", None, False):  # YAML 1.1 reads an unquoted no as false
        m.ignore(key, "no: fp32")
    elif value in ("bf16", "fp16"):
        m.set(key, "autocast", value, "FSDP's own mixed-precision policy is not mapped: give --fsdp-param-dtype "
                                      "to model it" if fsdp else "")
    else:
        raise m.refuse(key, value, "no, bf16 or fp16")


def _accelerate_fsdp(m: Mapper, key: str, options: dict[str, Any], processes: int, machines: int) -> None:
    strategy = str(options.pop("fsdp_sharding_strategy", "FULL_SHARD"))
    if strategy not in ACCELERATE_SHARDING:
        raise m.refuse(f"{key}.fsdp_sharding_strategy", strategy, "FULL_SHARD, SHARD_GRAD_OP, NO_SHARD or "
                                                                  "HYBRID_SHARD")
    m.set(f"{key}.fsdp_sharding_strategy", "zero", ACCELERATE_SHARDING[strategy])
    if strategy in ("HYBRID_SHARD", "4"):
        m.set(f"{key}.fsdp_sharding_strategy", "shard_size", max(1, processes // max(1, int(machines))),
              "HSDP: one node's GPUs")
    tm.fsdp_options(m, key, options)


def _accelerate_deepspeed(m: Mapper, key: str, options: dict[str, Any]) -> None:
    if "deepspeed_config_file" in options:
        tm.deepspeed(m, f"{key}.deepspeed_config_file", options.pop("deepspeed_config_file"))
    for name, value in options.items():
        sub = f"{key}.{name}"
        if name == "zero_stage":
            if value not in (0, 1, 2, 3):
                raise m.refuse(sub, value, "0, 1, 2 or 3")
            m.set(sub, "zero", value, "DeepSpeed ZeRO")
        elif name in ("offload_optimizer_device", "offload_param_device"):
            if value == "cpu":
                m.set(sub, "cpu_offload", "optimizer" if "optimizer" in name else "params")
            elif value not in ("none", None):
                raise m.refuse(sub, value, "cpu or none")
        elif name == "gradient_accumulation_steps":
            m.set(sub, "grad_accum", m.whole(sub, value))
        else:
            m.ignore(sub, NOT_MEMORY)


# ----------------------------------------------------------------------------- TrainingArguments
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


def read_hf_trainer(m: Mapper, data: dict[str, Any]) -> None:
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
        elif key in ("lora_r", "lora_alpha", "lora_target_modules", "use_dora"):
            _hf_lora(m, key, value, peft)
        elif key in ("load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type", "use_bnb_nested_quant",
                     "bnb_4bit_quant_storage", "bnb_4bit_compute_dtype"):
            _hf_quantisation(m, key, value, data)
        elif key == "packing":
            m.ignore(key, "packing fills each sequence to the length, as memplan's batches always are")
        elif key.startswith(HF_NOT_MEMORY):
            m.ignore(key, tm.LORA_DROPOUT if key == "lora_dropout" and value else NOT_MEMORY)
        else:
            m.ignore(key, NOT_MAPPED)


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
        _bnb_option(m, key, key, value)
    else:
        m.ignore(key, "load_in_4bit is not set")


def _hf_flag(name: str, value: Any, note: str = "") -> Any:
    def handler(m: Mapper, key: str, flag: Any) -> None:
        if m.flag(key, flag):
            m.set(key, name, value, note)
        else:
            m.ignore(key, "false")
    return handler


def _hf_fsdp_config(m: Mapper, key: str, value: Any) -> None:
    if isinstance(value, dict):
        tm.fsdp_options(m, key, value)
    else:
        m.ignore(key, "a path to an FSDP config: give its options as flags")


def _hf_liger(m: Mapper, key: str, value: Any) -> None:
    if m.flag(key, value):
        raise UserError(f"{m.path}: {key}: true patches every Liger kernel (RoPE, RMSNorm, SwiGLU, fused linear "
                        "cross-entropy); memplan models only the last: leave it out and give --loss fused-linear")
    m.ignore(key, "false")


HF_KEYS = {
    "model_name_or_path": lambda m, k, v: m.set(k, "model", str(v)),
    "torch_dtype": lambda m, k, v: m.set(k, "dtype", m.dtype(k, v), "the model is loaded in it")
    if v != "auto" else m.ignore(k, "auto: the checkpoint's dtype, which memplan does not read"),
    "dtype": lambda m, k, v: HF_KEYS["torch_dtype"](m, k, v),
    "per_device_train_batch_size": lambda m, k, v: m.set(k, "batch", m.whole(k, v)),
    "gradient_accumulation_steps": lambda m, k, v: m.set(k, "grad_accum", m.whole(k, v)),
    "bf16": _hf_flag("autocast", "bf16", "the Trainer's mixed precision"),
    "fp16": _hf_flag("autocast", "fp16", "the Trainer's mixed precision"),
    "gradient_checkpointing": _hf_flag("checkpointing", "full", "HF gradient_checkpointing_enable"),
    "optim": tm.hf_optimizer,
    "torch_compile": _hf_flag("compile", "model", "the Trainer compiles the whole model"),
    "fsdp": tm.hf_fsdp,
    "fsdp_config": _hf_fsdp_config,
    "deepspeed": tm.deepspeed,
    "attn_implementation": tm.attention,
    "use_liger_kernel": _hf_liger,
    "use_peft": lambda m, k, v: m.note(k, "LoRA from lora_r") if m.flag(k, v) else m.ignore(k, "false"),
    "auto_find_batch_size": lambda m, k, v: m.ignore(k, "the batch it finds at run time: memplan takes "
                                                        "per_device_train_batch_size"),
}
