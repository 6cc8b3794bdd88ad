"""The YAML `accelerate config` writes, read as memplan's setup and layout (keys of
accelerate's commands/config/cluster.py; docs/inputs.md lists each)."""

from __future__ import annotations

from typing import Any

from memplan.trainers import mapping as tm
from memplan.trainers.mapping import NOT_MEMORY, Mapper

ACCELERATE_NOT_MEMORY = {
    "compute_environment", "debug", "machine_rank", "main_training_function", "rdzv_backend", "same_network",
    "tpu_env", "tpu_use_cluster", "tpu_use_sudo", "downcast_bf16", "gpu_ids", "main_process_ip",
    "main_process_port", "enable_cpu_affinity", "use_cpu", "num_machines", "megatron_lm_config", "ipex_config",
}
ACCELERATE_KEYS = ("distributed_type", "mixed_precision", "fsdp_config", "deepspeed_config", "dynamo_config",
                   "num_processes")
ACCELERATE_SHARDING = {"FULL_SHARD": 3, "1": 3, "SHARD_GRAD_OP": 2, "2": 2, "NO_SHARD": 0, "3": 0,
                       "HYBRID_SHARD": 3, "4": 3}


def read(m: Mapper, data: dict[str, Any]) -> None:
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
            m.unknown(key, [*ACCELERATE_NOT_MEMORY, *ACCELERATE_KEYS, *cluster_config_fields()])


def _accelerate_precision(m: Mapper, key: str, value: Any, *, fsdp: bool) -> None:
    """Accelerator(mixed_precision=...) autocasts the forward; the parameters stay fp32 (a
    -mixed precision). Under FSDP memplan traces it as FSDP2's MixedPrecisionPolicy with fp32
    reduction, as torchtitan does; accelerate's own policy reduces in the half dtype
    (accelerate/utils/dataclasses.py, `FullyShardedDataParallelPlugin.set_mixed_precision`)."""
    if value in ("no", None, False):  # YAML 1.1 reads an unquoted no as false
        m.ignore(key, "no: fp32")
    elif value in ("bf16", "fp16"):
        m.set(key, "autocast", value, "traced as FSDP2's MixedPrecisionPolicy, reducing in fp32" if fsdp else "")
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


def cluster_config_fields() -> list[str]:
    """The fields of accelerate's `ClusterConfig` (accelerate/commands/config/config_args.py):
    the keys `accelerate config` writes."""
    import dataclasses

    from accelerate.commands.config.config_args import ClusterConfig

    return [f.name for f in dataclasses.fields(ClusterConfig)]
