"""An RL trainer's own configuration file, read as `memplan rl`'s flags.

`read_rl_config(path)` reads a JSON or YAML mapping (nested mappings are read as dotted
keys, so verl's `ppo_trainer.yaml` and its command-line overrides
`actor_rollout_ref.rollout.gpu_memory_utilization=0.6`, and OpenRLHF's dotted arguments
`--vllm.gpu_memory_utilization 0.5` written as a mapping, read alike) and recognises whose
it is:

| format | recognised by | keys from |
|---|---|---|
| TRL `GRPOConfig` / `DPOConfig` | `num_generations`, `use_vllm`, `vllm_mode` or `precompute_ref_log_probs` | trl 1.16.0 `trl/trainer/grpo_config.py`, `dpo_config.py` |
| verl | keys under `actor_rollout_ref.` | verl `verl/trainer/config/ppo_trainer.yaml`, `rollout/rollout.yaml` |
| OpenRLHF | dotted arguments under `actor.`, `vllm.`, `ds.`, `rollout.`, `train.`, `algo.` | OpenRLHF `openrlhf/cli/train_ppo_ray.py` (commit 3c3be62) |

Every key is reported as used (with what it set) or ignored (what it would need); a value
of the wrong type is refused in one line. Keys that are not about memory (learning rate,
logging, paths) are ignored by name.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from memplan.errors import UserError

Target = tuple[str, str, Callable[[Any], Any]]  # (section, field, converter)


def _int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v:
        raise ValueError(v)
    return int(v)


def _float(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(v)
    return float(v)


def _bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError(v)
    return v


def _str(v: Any) -> str:
    if not isinstance(v, str):
        raise ValueError(v)
    return v


def _checkpointing(v: Any) -> str:
    return "full" if _bool(v) else "none"


TRL_KEYS: dict[str, Target] = {
    "model_name_or_path": ("", "model", _str), "per_device_train_batch_size": ("setup", "batch", _int),
    "gradient_accumulation_steps": ("setup", "grad_accum", _int),
    "gradient_checkpointing": ("setup", "checkpointing", _checkpointing),
    "num_generations": ("", "num_generations", _int), "max_prompt_length": ("", "prompt_len", _int),
    "max_completion_length": ("", "completion_len", _int), "beta": ("", "beta", _float),
    "vllm_gpu_memory_utilization": ("engine", "gpu_memory_utilization", _float),
    "vllm_tensor_parallel_size": ("engine", "tp", _int), "vllm_max_model_length": ("engine", "max_model_len", _int),
    "vllm_enable_sleep_mode": ("", "sleep_level", lambda v: 2 if _bool(v) else 0),
    "ds3_gather_for_generation": ("generation", "ds3_gather_for_generation", _bool),
}
# the transformers rollout's generation settings (grpo_config.py L532-584), and the same keys
# in `generation_kwargs`, which TRL applies over them (grpo_trainer.py L1171-1172)
_GENERATION: dict[str, Callable[[Any], Any]] = {
    "temperature": _float, "top_p": _float, "top_k": _int, "min_p": lambda v: None if v is None else _float(v),
    "repetition_penalty": _float, "cache_implementation": lambda v: None if v is None else _str(v)}
TRL_KEYS.update({key: ("generation", key, convert) for key, convert in _GENERATION.items()})
TRL_KEYS.update({f"generation_kwargs.{key}": ("generation", key, convert) for key, convert in _GENERATION.items()})
VERL_KEYS: dict[str, Target] = {
    "actor_rollout_ref.model.path": ("", "model", _str),
    "actor_rollout_ref.model.enable_gradient_checkpointing": ("setup", "checkpointing", _checkpointing),
    "actor_rollout_ref.model.lora_rank": ("setup", "lora_rank", _int),
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": ("setup", "batch", _int),
    "actor_rollout_ref.actor.use_kl_loss": ("", "reference", lambda v: "copy" if _bool(v) else "none"),
    "actor_rollout_ref.actor.kl_loss_coef": ("", "kl_loss_coef", _float),
    "actor_rollout_ref.actor.fsdp_config.param_offload": ("offload", "params", _bool),
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload": ("offload", "optimizer", _bool),
    "actor_rollout_ref.rollout.n": ("", "num_generations", _int),
    "actor_rollout_ref.rollout.gpu_memory_utilization": ("engine", "gpu_memory_utilization", _float),
    "actor_rollout_ref.rollout.tensor_model_parallel_size": ("engine", "tp", _int),
    "actor_rollout_ref.rollout.max_num_batched_tokens": ("engine", "max_num_batched_tokens", _int),
    "actor_rollout_ref.rollout.max_num_seqs": ("engine", "max_num_seqs", _int),
    "actor_rollout_ref.rollout.free_cache_engine": ("", "sleep_level", lambda v: 2 if _bool(v) else 0),
    "data.max_prompt_length": ("", "prompt_len", _int), "data.max_response_length": ("", "completion_len", _int),
    "critic.model.path": ("", "critic", _str), "reward_model.model.path": ("", "reward_model", _str),
    "trainer.n_gpus_per_node": ("layout", "world_size", _int),
    "algorithm.adv_estimator": ("", "algo", lambda v: {"grpo": "grpo", "gae": "ppo", "rloo": "rloo"}[_str(v)]),
}
OPENRLHF_KEYS: dict[str, Target] = {
    "actor.model_name_or_path": ("", "model", _str), "critic.model_name_or_path": ("", "critic", _str),
    "reward.model_name_or_path": ("", "reward_model", _str), "train.micro_batch_size": ("setup", "batch", _int),
    "rollout.n_samples_per_prompt": ("", "num_generations", _int),
    "rollout.max_new_tokens": ("", "completion_len", _int), "data.max_len": ("", "max_len", _int),
    "ds.zero_stage": ("layout", "zero", _int),
    "actor.gradient_checkpointing_enable": ("setup", "checkpointing", _checkpointing),
    "ds.lora.rank": ("setup", "lora_rank", _int), "algo.kl.init_coef": ("", "beta", _float),
    "ds.adam_offload": ("setup", "cpu_offload", lambda v: "optimizer" if _bool(v) else "none"),
    "vllm.gpu_memory_utilization": ("engine", "gpu_memory_utilization", _float),
    "vllm.tensor_parallel_size": ("engine", "tp", _int),
    "vllm.enable_sleep": ("", "sleep_level", lambda v: 1 if _bool(v) else 0),
    "ds.enable_sleep": ("offload", "optimizer", _bool),
    "train.colocate_all": ("", "rollout", lambda v: "vllm-colocate" if _bool(v) else "vllm-server"),
    "algo.advantage.estimator": ("", "algo", lambda v: {"group_norm": "grpo", "dr_grpo": "grpo", "gae": "ppo",
                                                        "rloo": "rloo", "reinforce": "rloo",
                                                        "reinforce_baseline": "rloo"}[_str(v)]),
}
FORMATS = {"trl": TRL_KEYS, "verl": VERL_KEYS, "openrlhf": OPENRLHF_KEYS}


def read_rl_config(path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(values by section, the report: format, used keys, ignored keys) of `path`."""
    data = _flat(_parse(Path(path).expanduser()))
    fmt = detect_format(data)
    keys = FORMATS[fmt]
    values: dict[str, Any] = {"trainer": fmt, "setup": {}, "layout": {}, "engine": {}, "generation": {}, "offload": {}}
    used, ignored = [], []
    for key, value in sorted(data.items(), key=lambda kv: kv[0].startswith("generation_kwargs.")):
        if key not in keys:
            ignored.append(key)
            continue
        section, name, convert = keys[key]
        try:
            converted = convert(value)
        except (ValueError, KeyError):
            raise UserError(f"--from {path}: {key}={value!r} is not a value memplan rl reads") from None
        (values[section] if section else values)[name] = converted
        used.append(f"{key}={value}")
    if fmt == "verl":  # the coefficient applies only with use_kl_loss (actor.yaml L95-105)
        coefficient = values.pop("kl_loss_coef", 0.001)
        if values.get("reference") == "copy":
            values["beta"] = coefficient
    if fmt == "openrlhf" and "max_len" in values:  # data.max_len is prompt + response
        values["prompt_len"] = values.pop("max_len") - values.get("completion_len", 1024)
    if fmt == "trl":
        values["algo"] = "dpo" if "precompute_ref_log_probs" in data else values.get("algo", "grpo")
        if "use_vllm" in data or "vllm_mode" in data:
            values["rollout"] = _trl_rollout(data)
            used.append(f"use_vllm={data.get('use_vllm')}, vllm_mode={data.get('vllm_mode', 'colocate')}")
            ignored = [k for k in ignored if k not in ("use_vllm", "vllm_mode")]
    return values, {"format": fmt, "used": used, "ignored": ignored}


def _trl_rollout(data: dict[str, Any]) -> str:
    if not data.get("use_vllm", False):
        return "hf"
    mode = data.get("vllm_mode", "colocate")
    if mode not in ("colocate", "server"):
        raise UserError(f"vllm_mode={mode!r}: TRL's modes are colocate and server")
    return f"vllm-{mode}"


def detect_format(data: dict[str, Any]) -> str:
    """Whose configuration `data` is (the table in the module docstring)."""
    if any(k.startswith("actor_rollout_ref.") for k in data):
        return "verl"
    if any(k.split(".")[0] in ("actor", "vllm", "ds", "rollout", "train", "algo") for k in data):
        return "openrlhf"
    if {"num_generations", "use_vllm", "vllm_mode", "precompute_ref_log_probs"} & set(data):
        return "trl"
    raise UserError("--from: not a TRL GRPOConfig/DPOConfig, verl or OpenRLHF configuration (none of their keys: "
                    "num_generations, actor_rollout_ref.*, actor.* / vllm.* / ds.*)")


def _parse(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read --from {path}: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        if path.suffix == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as exc:  # json and yaml raise their own error types
        raise UserError(f"--from {path} does not parse: {' '.join(str(exc).split())[:200]}") from None
    if not isinstance(data, dict):
        raise UserError(f"--from {path} must hold a mapping of keys, not {type(data).__name__}")
    return data


def _flat(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings as dotted keys; a dotted key written flat stays as it is."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flat(value, f"{name}."))
        else:
            out[name] = value
    return out
