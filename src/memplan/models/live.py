"""What a live model and optimizer say about the training job: identity, config, setup.

Read from the objects themselves and from the forward calls of one step (docs/watch.md lists
each field): batch and sequence from the first forward call's `input_ids` (or first 2-D
integer tensor), the precision from the trainable parameters' dtype and the autocast state at
the forward, the optimizer from its class and its `foreach` / `fused` flags, `grad_accum`
from the forward calls of one optimizer step, `checkpointing="full"` from a Hugging Face
model's `is_gradient_checkpointing`, `lora_rank` from a peft model's config,
`head="seq-cls"` from a `...ForSequenceClassification` model. `memplan.watch` (a job it
watches) and `memplan.program` (a program it runs) both say back what they saw with it.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from memplan.models.setup import TrainingSetup, precision_fields

ForwardCall = tuple[tuple[Any, ...], dict[str, Any]]

# torch.optim / bitsandbytes / torchao class names -> memplan's --optimizer names
OPTIMIZER_NAMES = {
    "AdamW": "adamw", "Adam": "adam", "SGD": "sgd", "Adafactor": "adafactor",
    "AdamW8bit": "adamw8bit", "PagedAdamW8bit": "paged-adamw8bit", "PagedAdamW": "paged-adamw",
    "Lion": "lion", "Lion8bit": "lion",
}
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def model_identity(model: torch.nn.Module) -> dict[str, Any]:
    """Class, parameter count and a fingerprint of every parameter's name, shape and dtype:
    what `memplan compare` checks so that a measurement is compared with its own model's estimate."""
    digest = hashlib.sha1()
    count = 0
    for name, p in model.named_parameters():
        digest.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
        count += p.numel()
    return {"name": _model_name(model), "class": type(model).__name__, "parameters": count,
            "fingerprint": digest.hexdigest()[:16]}


def _model_name(model: torch.nn.Module) -> str:
    config = model_config(model)
    name = getattr(config, "name_or_path", "") if config is not None else ""
    return name or type(model).__name__


def model_config(model: torch.nn.Module) -> Any:
    """The model's Hugging Face `PretrainedConfig` (a peft model's base model's), or None."""
    config = getattr(model, "config", None)
    if config is None and hasattr(model, "get_base_model"):
        config = getattr(model.get_base_model(), "config", None)
    return config if hasattr(config, "to_dict") else None


def _batch_and_seq(calls: list[ForwardCall]) -> tuple[int, int | None] | None:
    if not calls:
        return None
    args, kwargs = calls[0]
    ids = kwargs.get("input_ids")
    if not isinstance(ids, torch.Tensor):
        tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
        ids = next((t for t in tensors if not t.is_floating_point() and t.dim() == 2), None)
    if ids is None or ids.dim() != 2:
        return None
    return int(ids.shape[0]), int(ids.shape[1])


def _optimizer_fields(optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    if optimizer is None:
        return {}
    name = OPTIMIZER_NAMES.get(type(optimizer).__name__)
    fields: dict[str, Any] = {"optimizer": name} if name else {}
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    if group.get("fused"):
        fields["optimizer_impl"] = "fused"
    elif group.get("foreach"):
        fields["optimizer_impl"] = "foreach"
    elif group.get("foreach") is False:
        fields["optimizer_impl"] = "loop"
    return fields


def infer_setup(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, calls: list[ForwardCall],
                autocast: tuple[str, torch.dtype] | None) -> tuple[TrainingSetup, list[str]]:
    """The live job's `TrainingSetup`, and the fields that could not be seen (left at
    memplan's defaults)."""
    fields: dict[str, Any] = {}
    unseen = []
    shape = _batch_and_seq(calls)
    if shape is not None:
        fields["batch"], fields["seq"] = shape
    else:
        unseen += ["batch", "seq"]
    trainable = [p for p in model.parameters() if p.requires_grad] or list(model.parameters())
    dtypes = [p.dtype for p in trainable]
    main = max(set(dtypes), key=dtypes.count) if dtypes else torch.float32
    dtype = DTYPE_NAMES.get(main, "fp32")
    fields.update(precision_fields(dtype, DTYPE_NAMES.get(autocast[1], "bf16") if autocast is not None else "none"))
    optimizer_fields = _optimizer_fields(optimizer)
    if "optimizer" not in optimizer_fields:
        unseen.append("optimizer")
    fields.update(optimizer_fields)
    fields["grad_accum"] = max(1, len(calls))
    if getattr(model, "is_activation_checkpointing", getattr(model, "is_gradient_checkpointing", False)):
        fields["checkpointing"] = "full"
    peft = getattr(model, "peft_config", None)
    if isinstance(peft, dict) and peft:
        rank = getattr(next(iter(peft.values())), "r", 0)
        if rank:
            fields["lora_rank"] = int(rank)
    if type(model).__name__.endswith("ForSequenceClassification"):
        fields["head"] = "seq-cls"
        fields["num_labels"] = int(getattr(model_config(model), "num_labels", 2) or 2)
    return TrainingSetup(**fields), unseen
