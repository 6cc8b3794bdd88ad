"""What `memplan.trainers` reads a trainer's file into, and the mappings the formats share:
the result (`TrainerConfig`, which builds a real `TrainingSetup` and `Layout`), the
key-by-key recorder (`Mapper`), the Hugging Face Trainer's optimizer names, FSDP, DeepSpeed
and bitsandbytes options (used by axolotl, `TrainingArguments` and accelerate), and the
tables of torchtune's and torchtitan's components. The fields a file may set are the
declared fields of `TrainingSetup` and `Layout` (`memplan.models.fields`). docs/inputs.md
lists every key with its source.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memplan.errors import UserError
from memplan.models.fields import declared
from memplan.models.setup import TrainingSetup, precision_fields
from memplan.parallel.layout import Layout

SETUP_FIELDS = tuple(f.dotted for f in declared(TrainingSetup))
# What a trainer's keys say apart (the parameters' dtype, the forward's autocast): one precision
# together (`Mapper.finish`).
PRECISION_PARTS = ("dtype", "autocast")
LAYOUT_FIELDS = tuple(f.dotted for f in declared(Layout))

# Reasons a key is left out, shared by the formats.
NOT_MEMORY = "does not change the memory of one training step"
NOT_MAPPED = "not a key memplan maps"
LORA_DROPOUT = "memplan builds LoRA without dropout: the dropout mask of each adapted layer is not counted"

# Hugging Face Trainer's `optim` names (transformers.training_args.OptimizerNames), used by
# axolotl and TrainingArguments: memplan's optimizer and, where the name fixes it, its kernels.
HF_OPTIMIZERS: dict[str, tuple[str, str | None]] = {
    "adamw_torch": ("adamw", None), "adamw_torch_fused": ("adamw", "fused"), "sgd": ("sgd", None),
    "adamw_bnb_8bit": ("adamw8bit", None), "adamw_8bit": ("adamw8bit", None),
    "paged_adamw_8bit": ("paged-adamw8bit", None), "paged_adamw_32bit": ("paged-adamw", None),
    "lion_32bit": ("lion", None), "adamw_torch_8bit": ("ao-adamw8bit", None),
    "adamw_torch_4bit": ("ao-adamw4bit", None),
}
# `_component_` paths of optimizers (torchtune's configs name torch's, bitsandbytes' and torchao's).
COMPONENT_OPTIMIZERS = {
    "torch.optim.AdamW": "adamw", "torch.optim.Adam": "adam", "torch.optim.SGD": "sgd",
    "torch.optim.Adafactor": "adafactor", "bitsandbytes.optim.AdamW8bit": "adamw8bit",
    "bitsandbytes.optim.PagedAdamW8bit": "paged-adamw8bit", "bitsandbytes.optim.PagedAdamW": "paged-adamw",
    "bitsandbytes.optim.Lion": "lion", "torchao.optim.AdamW8bit": "ao-adamw8bit",
    "torchao.optim.AdamW4bit": "ao-adamw4bit", "torchao.optim.AdamWFp8": "ao-adamw-fp8",
    "torchao.prototype.low_bit_optim.AdamW8bit": "ao-adamw8bit",
    "torchao.prototype.low_bit_optim.AdamW4bit": "ao-adamw4bit",
    "torchao.prototype.low_bit_optim.AdamWFp8": "ao-adamw-fp8",
}
CPU_OFFLOAD_OPTIMIZERS = ("torchao.optim.CPUOffloadOptimizer", "torchao.prototype.low_bit_optim.CPUOffloadOptimizer")
# torchtune's `loss._component_`: memplan's loss (torchtune's LinearCrossEntropyLoss projects
# and takes the cross-entropy chunk by chunk too, torchtune/modules/loss/ce_chunked_output_loss.py).
COMPONENT_LOSSES = {
    "torchtune.modules.loss.CEWithChunkedOutputLoss": "chunked",
    "torchtune.modules.loss.LinearCrossEntropyLoss": "chunked",
    "torch.nn.CrossEntropyLoss": "full",
}
# torchtune's LoRA module names (torchtune/modules/peft/lora.py) -> Hugging Face module names.
TORCHTUNE_LORA_MODULES = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "output_proj": "o_proj"}
TORCHTUNE_MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
# torchtune model builders (`torchtune.models.<family>.<builder>`) -> memplan registry names.
TORCHTUNE_MODELS = {
    "llama2_7b": "llama-2-7b", "llama2_13b": "llama-2-13b", "llama2_70b": "llama-2-70b",
    "llama3_8b": "llama-3-8b", "llama3_70b": "llama-3-70b", "llama3_1_8b": "llama-3.1-8b",
    "llama3_1_70b": "llama-3.1-70b", "llama3_2_1b": "llama-3.2-1b", "llama3_2_3b": "llama-3.2-3b",
    "mistral_7b": "mistral-7b", "gemma_2b": "gemma-2b", "gemma_7b": "gemma-7b", "phi3_mini": "phi-3-mini",
    "qwen2_5_0_5b": "qwen2.5-0.5b", "qwen2_5_1_5b": "qwen2.5-1.5b", "qwen2_5_3b": "qwen2.5-3b",
    "qwen2_5_7b": "qwen2.5-7b", "qwen2_5_14b": "qwen2.5-14b", "qwen2_5_32b": "qwen2.5-32b",
    "qwen2_5_72b": "qwen2.5-72b",
}
# torchtitan `[model] name` + `flavor` -> memplan registry names (torchtitan/models/llama3/__init__.py).
TORCHTITAN_MODELS = {("llama3", "8b"): "llama-3-8b", ("llama3", "70b"): "llama-3-70b",
                     ("llama2", "7b"): "llama-2-7b", ("llama2", "13b"): "llama-2-13b",
                     ("llama2", "70b"): "llama-2-70b"}
TORCH_DTYPE_NAMES = {"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16", "half": "fp16",
                     "float32": "fp32", "fp32": "fp32", "float": "fp32"}
QUANT_STORAGE_NAMES = {"uint8": "uint8", **{k: v for k, v in TORCH_DTYPE_NAMES.items()}}
ATTENTIONS = {"flash_attention_2": "flash", "flash_attention_3": "flash", "sdpa": "sdpa", "eager": "eager"}


@dataclass
class TrainerConfig:
    """What one trainer configuration file says, in memplan's terms."""

    path: str
    format: str
    model: str | None = None
    setup: dict[str, Any] = field(default_factory=dict)  # TrainingSetup field -> value
    layout: dict[str, Any] = field(default_factory=dict)  # Layout field -> value
    used: dict[str, str] = field(default_factory=dict)  # file key -> the fields it set
    ignored: dict[str, str] = field(default_factory=dict)  # file key -> why it was left out
    unresolved: dict[str, str] = field(default_factory=dict)  # field -> what the user must give
    set_by: dict[str, list[str]] = field(default_factory=dict)  # file key -> the fields it set
    defaults: dict[str, str] = field(default_factory=dict)  # field -> the trainer's default memplan filled in

    def to_setup(self, **given: Any) -> TrainingSetup:
        """The `TrainingSetup` the file describes (`given` fields override it)."""
        return TrainingSetup(**{**self.setup, **given})

    def to_layout(self, **given: Any) -> Layout:
        """The `Layout` the file describes (`given` fields override it: the world size a
        launcher decides, which the file leaves `unresolved`)."""
        missing = [name for name in self.unresolved if name in LAYOUT_FIELDS and name not in given]
        if missing:
            raise UserError(self.unresolved[missing[0]])
        return Layout(**{**self.layout, **given})

    def to_json(self) -> dict[str, Any]:
        return {"file": self.path, "format": self.format, "model": self.model, "setup": dict(self.setup),
                "layout": dict(self.layout), "used": dict(self.used), "ignored": dict(self.ignored),
                "unresolved": dict(self.unresolved), "defaults": dict(self.defaults)}


class Mapper:
    """Records, key by key, what a file sets, what it leaves out and what it refuses."""

    def __init__(self, path: Path, fmt: str) -> None:
        self.path = path
        self.config = TrainerConfig(str(path), fmt)

    def set(self, key: str, name: str, value: Any, note: str = "") -> None:
        """`key` of the file sets memplan's `name` (a setup or layout field, or "model")."""
        if name == "model":
            self.config.model = value
        elif name in SETUP_FIELDS or name in PRECISION_PARTS:
            self.config.setup[name] = value
        elif name in LAYOUT_FIELDS:
            self.config.layout[name] = value
        else:
            raise AssertionError(f"{name} is neither a setup nor a layout field")
        self.config.set_by.setdefault(key, []).append(name)
        shown = ",".join(value) if isinstance(value, (list, tuple)) else value
        text = f"{name}={shown}" + (f" ({note})" if note else "")
        used = self.config.used
        used[key] = f"{used[key]}; {text}" if key in used else text

    def finish(self, precision: str, why: str) -> None:
        """The precision the file's dtype and autocast keys say together; where it has neither,
        the trainer's own default `precision` (filled in, with `why`)."""
        dtype, autocast = (self.config.setup.pop(name, None) for name in PRECISION_PARTS)
        if dtype is None and autocast is None and "precision" not in self.config.setup:
            self.config.setup["precision"] = precision
            self.config.defaults["precision"] = f"{precision}: {why}"
        elif dtype is not None or autocast is not None:
            self.config.setup.update(precision_fields(dtype or "fp32", autocast or "none"))

    def note(self, key: str, text: str) -> None:
        """`key` was used together with other keys (which set the fields)."""
        self.config.used[key] = text

    def ignore(self, key: str, why: str) -> None:
        self.config.ignored[key] = why

    def unknown(self, key: str, known: Iterable[str]) -> None:
        """A key the format's reader does not know: refused, naming the closest key it knows,
        where one is close (a misspelt key would leave its field at memplan's default);
        else left out as not mapped (a key of the trainer's that memplan does not list)."""
        close = difflib.get_close_matches(key, sorted(set(known)), n=1, cutoff=0.8)
        if close and close[0] != key:
            raise UserError(f"{self.path}: unknown key {key!r}: did you mean {close[0]!r}? Fix the key, or "
                            "leave it out")
        self.ignore(key, NOT_MAPPED)

    def unresolved(self, name: str, message: str) -> None:
        self.config.unresolved[name] = message

    def refuse(self, key: str, value: Any, known: str) -> UserError:
        return UserError(f"{self.path}: {key}: {value!r} is not a value memplan knows ({known}): change it, "
                         "or leave the key out and give the matching flag")

    def whole(self, key: str, value: Any, low: int = 1) -> int:
        """`value` as a whole number >= `low`, or the refusal."""
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise self.refuse(key, value, f"a whole number >= {low}")
        return value

    def number(self, key: str, value: Any) -> float:
        """`value` as a number > 0, or the refusal."""
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise self.refuse(key, value, "a number > 0")
        return float(value)

    def flag(self, key: str, value: Any) -> bool:
        """A yes/no value (a boolean, or 'true'/'false')."""
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise self.refuse(key, value, "true or false")

    def dtype(self, key: str, value: Any, names: dict[str, str] = TORCH_DTYPE_NAMES) -> str:
        """A dtype as a trainer spells it (`bfloat16`, `torch.bfloat16`, `bf16`) -> memplan's."""
        name = str(value).removeprefix("torch.")
        if name not in names:
            raise self.refuse(key, value, ", ".join(sorted(set(names))))
        return names[name]


def hf_optimizer(m: Mapper, key: str, value: Any) -> None:
    """Hugging Face Trainer's `optim` name (axolotl's `optimizer`, TrainingArguments' `optim`)."""
    if value == "adafactor":
        raise UserError(f"{m.path}: {key}: adafactor is transformers' Adafactor, which memplan does not build "
                        "(its adafactor is torch.optim.Adafactor): leave the key out and give `optimizer`")
    if value not in HF_OPTIMIZERS:
        raise m.refuse(key, value, ", ".join(HF_OPTIMIZERS))
    optimizer, impl = HF_OPTIMIZERS[value]
    m.set(key, "optimizer", optimizer)
    if impl is not None:
        m.set(key, "optimizer_impl", impl)


def hf_fsdp(m: Mapper, key: str, value: Any) -> None:
    """The Trainer's `fsdp` option: a list or a space-separated string of FSDP options."""
    options = value.split() if isinstance(value, str) else list(value or [])
    stages = {"full_shard": 3, "shard_grad_op": 2, "no_shard": 0}
    chosen = [stages[o] for o in options if o in stages]
    if any(o not in (*stages, "auto_wrap", "offload") for o in options) or len(chosen) > 1:
        raise m.refuse(key, value, "full_shard, shard_grad_op or no_shard, with auto_wrap and offload")
    if not options:
        m.ignore(key, "empty: no FSDP")
        return
    if chosen:
        m.set(key, "zero", chosen[0], "FSDP2 fully_shard" if chosen[0] == 3 else "ZeRO-style sharding")
    if "offload" in options:
        m.set(key, "cpu_offload", "params")
    launcher_world_size(m, "shards")


def fsdp_options(m: Mapper, key: str, options: dict[str, Any]) -> None:
    """An FSDP config block (`fsdp_config` of axolotl, TrainingArguments and accelerate): the
    options that change memory; the wrapping and state-dict ones are listed as left out."""
    for name, value in options.items():
        sub, bare = f"{key}.{name}", name.removeprefix("fsdp_")
        if bare == "offload_params":
            if m.flag(sub, value):
                m.set(sub, "cpu_offload", "params")
        elif bare == "activation_checkpointing":
            if m.flag(sub, value):
                m.set(sub, "checkpointing", "full")
        elif bare == "reshard_after_forward":
            if value not in (True, "true", "FULL_SHARD"):
                raise m.refuse(sub, value, "true: memplan's FSDP2 reshards after forward")
            m.ignore(sub, "true is what memplan's FSDP2 does")
        elif bare == "version":
            m.ignore(sub, "memplan traces FSDP2's fully_shard" + ("" if str(value) == "2" else
                                                                  "; FSDP1's flat parameters differ"))
        else:
            m.ignore(sub, "wrapping and checkpoint options: memplan shards every transformer block")


def deepspeed(m: Mapper, key: str, value: Any) -> None:
    """A DeepSpeed config (a dict, or the path of its JSON): its ZeRO stage and offloading."""
    if isinstance(value, str):
        path = Path(value).expanduser()
        path = path if path.is_absolute() else m.path.parent / path
        try:
            value = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            m.ignore(key, f"the DeepSpeed config {path} cannot be read here")
            m.unresolved("zero", f"{m.path}: {key} names {path}, which cannot be read here: give `zero=N`")
            return
    for half, precision in (("fp16", "16-mixed"), ("bf16", "bf16-mixed")):
        if isinstance(value, dict) and (value.get(half) or {}).get("enabled") not in (None, False, "auto"):
            m.set(f"{key}.{half}", "precision", precision, "DeepSpeed's mixed precision: half-precision weights, "
                                                           "an fp32 master partition")
    zero = value.get("zero_optimization", {}) if isinstance(value, dict) else {}
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise m.refuse(f"{key}.zero_optimization.stage", stage, "0, 1, 2 or 3")
    m.set(key, "zero", stage, "DeepSpeed ZeRO")
    for part, target in (("offload_optimizer", "optimizer"), ("offload_param", "params")):
        device = (zero.get(part) or {}).get("device", "none")
        if device == "cpu":
            m.set(key, "cpu_offload", target)
        elif device not in ("none", None):
            raise m.refuse(f"{key}.zero_optimization.{part}.device", device, "cpu or none")
    launcher_world_size(m, "runs ZeRO")


def launcher_world_size(m: Mapper, what: str) -> None:
    """A file that shards but does not say over how many GPUs (its launcher decides)."""
    if "world_size" not in m.config.layout:
        m.unresolved("world_size", f"{m.path} {what} over the GPUs its launcher starts: give `world_size=N`")


def lora_targets(m: Mapper, key: str, value: Any) -> None:
    if value in ("all-linear", "all_linear"):
        m.set(key, "lora_targets", ("all-linear",))
    elif isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        m.set(key, "lora_targets", tuple(value))
    else:
        raise m.refuse(key, value, "a list of module names, or all-linear")


def attention(m: Mapper, key: str, value: Any) -> None:
    """Hugging Face's `attn_implementation` names -> memplan's `attn`."""
    if value not in ATTENTIONS:
        raise m.refuse(key, value, ", ".join(ATTENTIONS))
    m.set(key, "attn", ATTENTIONS[value])


def set_if_true(name: str, value: Any, note: str = "") -> Any:
    """A key handler: a true flag sets `name` to `value`; false is left out."""
    def handler(m: Mapper, key: str, flag: Any) -> None:
        if m.flag(key, flag):
            m.set(key, name, value, note)
        else:
            m.ignore(key, "false")
    return handler


def bnb_option(m: Mapper, key: str, name: str, value: Any) -> None:
    """A `BitsAndBytesConfig` argument (axolotl's bnb_config_kwargs, TRL's model options)."""
    if name == "bnb_4bit_quant_type":
        if value not in ("nf4", "fp4"):
            raise m.refuse(key, value, "nf4 or fp4")
        m.set(key, "quant", value)
    elif name in ("bnb_4bit_use_double_quant", "use_bnb_nested_quant"):
        m.set(key, "double_quant", m.flag(key, value))
    elif name == "bnb_4bit_quant_storage":
        m.set(key, "quant_storage", m.dtype(key, value, QUANT_STORAGE_NAMES))
    elif name == "bnb_4bit_compute_dtype":
        m.set(key, "compute_dtype", m.dtype(key, value))
    else:
        m.ignore(key, NOT_MAPPED)
