"""A torchtune recipe YAML, read as memplan's setup and layout (keys after torchtune's
`recipes/configs/`, its recipes and `torchtune/models/*/_model_builders.py`; docs/inputs.md
lists each)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from memplan.models.setup import DEFAULT_LOSS_CHUNKS
from memplan.trainers import mapping as tm
from memplan.trainers.mapping import NOT_MAPPED, NOT_MEMORY, Mapper

TORCHTUNE_NOT_MEMORY = {
    "output_dir", "seed", "shuffle", "epochs", "max_steps_per_epoch", "metric_logger", "log_every_n_steps",
    "log_peak_memory_stats", "profiler", "resume_from_checkpoint", "save_adapter_weights_only", "lr_scheduler",
    "clip_grad_norm", "dataset_val", "run_val_every_n_steps", "log_level", "tokenizer", "dataset",
    "checkpointer", "device", "compile_loss", "collate_fn",
}
TORCHTUNE_SHARDING = ("fsdp_cpu_offload", "fsdp_reshard_after_forward", "data_parallel_shard_dim",
                      "data_parallel_replicate_dim", "tensor_parallel_dim", "custom_sharded_layers")


def read(m: Mapper, data: dict[str, Any]) -> None:
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
            m.unknown(key, ["model", "optimizer", "loss", *TORCHTUNE_KEYS, *TORCHTUNE_SHARDING,
                            *TORCHTUNE_NOT_MEMORY])
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


TORCHTUNE_KEYS = {
    "batch_size": lambda m, k, v: m.set(k, "batch", m.whole(k, v)),
    "gradient_accumulation_steps": lambda m, k, v: m.set(k, "grad_accum", m.whole(k, v)),
    "dtype": lambda m, k, v: m.set(k, "dtype", m.dtype(k, v), "torchtune trains in it, without autocast"),
    "compile": tm.set_if_true("compile", "blocks", "torchtune compiles each layer and the loss"),
    "enable_activation_checkpointing": tm.set_if_true("checkpointing", "full"),
    "enable_activation_offloading": tm.set_if_true("activation_offload", "torchtune"),
    "optimizer_in_bwd": tm.set_if_true("optimizer_in_backward", True),
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
        m.unresolved("world_size", f"{m.path} shards over every GPU the launcher starts: give `world_size=N`")
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


