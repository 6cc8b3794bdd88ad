"""torchtitan's TOML, read as memplan's setup and layout (sections and keys of
torchtitan/config/job_config.py and its `train_configs/*.toml`; docs/inputs.md lists each)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from memplan.errors import UserError
from memplan.trainers import mapping as tm
from memplan.trainers.mapping import NOT_MEMORY, Mapper

# Sections whose keys do not change one step's memory (torchtitan/config/job_config.py).
TORCHTITAN_NOT_MEMORY = ("job", "profiling", "metrics", "lr_scheduler", "checkpoint", "validation", "comm",
                         "fault_tolerance", "experimental", "memory_estimation", "debug", "float8", "mx",
                         "quantize", "dataloader")
TORCHTITAN_SCHEDULES = {"1F1B": "1f1b", "Interleaved1F1B": "interleaved", "InterleavedZeroBubble": "interleaved-zb",
                        "ZBVZeroBubble": "zbv"}


def read(m: Mapper, data: dict[str, Any]) -> None:
    """torchtitan's TOML (sections and keys of torchtitan/config/job_config.py)."""
    readers = {"model": _titan_model, "training": _titan_training, "compile": _titan_compile,
               "optimizer": _titan_optimizer, "parallelism": _titan_parallelism,
               "activation_checkpoint": _titan_checkpointing}
    for section, table in data.items():
        if section in readers and isinstance(table, dict):
            readers[section](m, {f"{section}.{k}": v for k, v in table.items()})
        elif section in TORCHTITAN_NOT_MEMORY and isinstance(table, dict):
            for key in table:
                m.ignore(f"{section}.{key}", NOT_MEMORY)
        else:
            m.unknown(section, [*readers, *TORCHTITAN_NOT_MEMORY])
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
            precision = {"bf16": "bf16-mixed", "fp16": "16-mixed", "fp32": "32-true"}[m.dtype(key, value)]
            m.set(key, "precision", precision, "fp32 weights; under FSDP2 its MixedPrecisionPolicy param_dtype, "
                                               "else torch.autocast (torchtitan's maybe_enable_amp)")
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
    if shard == -1:
        m.unresolved("world_size", f"{m.path}: data_parallel_shard_degree = -1 takes every GPU the launcher "
                                   "starts: give `world_size=N`")
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


