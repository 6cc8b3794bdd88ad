"""What an estimate assumed, said back in one line and in its JSON (`assumptions`).

The precision and how it is traced (`memplan.parallel.apply.traced_precision`), where the
weights, gradients and optimizer states live and in which dtype, activation checkpointing,
the allocator, whose model code and attention ran, a mixture of experts' routing, every
default memplan filled in for a field the caller left out, and the large terms people do
not expect: peft's k-bit preparation casting the unquantised embeddings and LM head to fp32
(peft/utils/other.py, `prepare_model_for_kbit_training`), and the [B, S, V] logits the loss
upcasts to fp32 (transformers/loss/loss_utils.py, `ForCausalLMLoss`: `logits.float()`).

Library text names fields in backquotes (`seq`); the CLI prints them as flags.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from memplan.models.build import max_positions, sequence_length
from memplan.models.fields import declared
from memplan.models.moe import experts_of
from memplan.models.registry import FactorySpec
from memplan.models.setup import DEFAULT_MAX_SEQ, TORCH_OPTIMIZERS, TrainingSetup
from memplan.parallel.layout import Layout
from memplan.units import format_bytes

if TYPE_CHECKING:  # transformers takes a second to import; only its config class is named here
    from transformers import PretrainedConfig

GiB = 1 << 30
NOTE_MIN_BYTES = 256 << 20  # a surprising term is explained from this size on
# The fields whose default is said back when the caller left them at it.
SAID_DEFAULTS = ("precision", "batch", "grad_accum", "optimizer", "checkpointing", "attn")
ALLOCATORS = {"caching": "PyTorch's caching allocator", "expandable": "the caching allocator with expandable "
              "segments", "planned": "memplan's planned allocator", "none": "no allocator (tensor bytes only)"}
IMPLS = {"hf": "Hugging Face transformers", "litgpt": "LitGPT"}


def job_assumptions(config: PretrainedConfig | FactorySpec, setup: TrainingSetup, layout: Layout, precision: str,
                    *, device: str = "cuda", allocator: str = "caching") -> dict[str, Any]:
    """The assumptions of one estimate (module docstring); `precision` is how the precision
    was traced. `line` is all of it in one sentence."""
    out: dict[str, Any] = {
        "precision": precision,
        "weights": weights(setup),
        "optimizer_states": optimizer_states(setup, layout),
        "checkpointing": setup.checkpointing,
        "allocator": allocator if device == "cuda" else "none (the host's CPU)",
        "implementation": f"{IMPLS.get(setup.impl, setup.impl)}, {setup.attn} attention",
    }
    if not isinstance(config, FactorySpec) and experts_of(config) is not None:
        out["routing"] = setup.routing
    out["defaults"] = filled_defaults(config, setup, device)
    out["notes"] = surprising_terms(config, setup, layout)
    out["line"] = _line(out, device)
    return out


def setup_assumptions(model: str | PretrainedConfig | FactorySpec, setup: TrainingSetup, layout: Layout | None = None,
                      **options: Any) -> dict[str, Any]:
    """`job_assumptions` of a job not estimated here (the base of a search: `memplan fit`)."""
    from memplan.models.registry import load_config
    from memplan.parallel.apply import traced_precision

    config = load_config(model) if isinstance(model, str) else model
    layout = layout if layout is not None else Layout()
    _, _, precision = traced_precision(setup, layout, None if isinstance(config, FactorySpec) else config)
    return job_assumptions(config, setup, layout, precision, **options)


def weights(setup: TrainingSetup) -> str:
    """Which weights train, and in which dtype they are held."""
    where = " on the host (FSDP2 CPUOffloadPolicy)" if setup.cpu_offload == "params" else ""
    if setup.quant != "none":
        prep = ", its other parameters cast to fp32 (k-bit preparation)" if setup.kbit_prep else ""
        trained = f"LoRA rank {setup.lora_rank} adapters in {setup.dtype}" if setup.lora_rank else \
            "the unquantised parameters train"
        return f"{setup.quant} frozen base (bitsandbytes){prep}; {trained}{where}"
    if setup.lora_rank:
        return f"{setup.dtype} frozen base; LoRA rank {setup.lora_rank} adapters in {setup.dtype}{where}"
    return f"every weight trains, {setup.dtype}{where}"


def optimizer_states(setup: TrainingSetup, layout: Layout) -> str:
    """Where the optimizer's states live and in which dtype."""
    where = "on the host" if setup.cpu_offload != "none" else "in device memory"
    shard = f", sharded over {layout.shard_degree} ranks" if layout.zero >= 1 and layout.shard_degree > 1 else ""
    if setup.optimizer not in TORCH_OPTIMIZERS:
        kind = {"lion": "Lion"}.get(setup.optimizer, setup.optimizer)
        return f"{kind}'s own states{' (8-bit)' if '8bit' in setup.optimizer else ''} {where}{shard}"
    dtype = "fp32" if layout.zero_engine == "deepspeed" else setup.dtype
    count = {"adamw": "2", "adam": "2", "sgd": "no", "adafactor": "factored"}[setup.optimizer]
    return f"{setup.optimizer}: {count} {dtype} states per trainable parameter {where}{shard}"


def filled_defaults(config: PretrainedConfig | FactorySpec, setup: TrainingSetup, device: str = "cuda") -> dict[str, str]:
    """Field -> the value memplan filled in for it (and why, where that is not just the
    default), where the caller left it out."""
    out: dict[str, str] = {}
    if setup.seq is None and not isinstance(config, FactorySpec):
        limit = max_positions(config)
        seq = sequence_length(setup, config)
        out["seq"] = (f"{seq} (the model's {limit} max positions capped at {DEFAULT_MAX_SEQ})"
                      if limit and limit > DEFAULT_MAX_SEQ else f"{seq} (the model's max positions)")
    for field in declared(TrainingSetup):
        if field.name in SAID_DEFAULTS and getattr(setup, field.name) == field.default:
            out[field.name] = field.format(field.default)
    if setup.optimizer_impl is None and setup.optimizer in TORCH_OPTIMIZERS:
        out["optimizer_impl"] = f"{setup.resolved_optimizer_impl(device)} (PyTorch's choice on {device})"
    return out


def surprising_terms(config: PretrainedConfig | FactorySpec, setup: TrainingSetup, layout: Layout) -> list[str]:
    """The large terms a reader would not expect, each with its size and the reason."""
    if isinstance(config, FactorySpec) or not hasattr(config, "vocab_size"):
        return []
    vocab, hidden = int(config.vocab_size), int(getattr(config, "hidden_size", 0) or 0)
    notes = []
    if setup.quant != "none" and setup.kbit_prep:
        tables = 1 if getattr(config, "tie_word_embeddings", False) else 2
        size = tables * vocab * hidden * 4 // max(1, layout.tp)
        if size >= NOTE_MIN_BYTES:
            notes.append(f"peft's prepare_model_for_kbit_training casts the unquantised embedding{'' if tables == 1 else ' and LM head'} "
                         f"to fp32: {format_bytes(size)} of parameters (`kbit_prep=False` skips it)")
    if setup.loss == "full" and setup.head == "lm":
        size = setup.batch * sequence_length(setup, config) * vocab * 4 // max(1, layout.cp)
        if size >= NOTE_MIN_BYTES:
            notes.append(f"the loss upcasts the [batch, seq, vocab] logits to fp32: {format_bytes(size)} per "
                         "micro-batch (`loss=chunked` or fused-linear avoids them)")
    return notes


def _line(parts: dict[str, Any], device: str) -> str:
    """The assumptions in one sentence."""
    said = [parts["precision"], parts["weights"], f"optimizer states: {parts['optimizer_states']}",
            f"checkpointing {parts['checkpointing']}"]
    if device == "cuda":
        said.append(ALLOCATORS.get(parts["allocator"], parts["allocator"]))
    said.append(parts["implementation"])
    if "routing" in parts:
        said.append(f"routing {parts['routing']}")
    line = "assumed: " + "; ".join(said)
    if parts["defaults"]:
        filled = [f"`{name}={text.split(' ', 1)[0]}`{text[len(text.split(' ', 1)[0]):]}"
                  for name, text in parts["defaults"].items()]
        line += "; defaults filled (give the flag to change one): " + ", ".join(filled)
    return line
