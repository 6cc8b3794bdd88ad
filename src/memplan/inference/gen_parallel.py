"""Tensor-parallel `generate()`: transformers' own TP plan on memplan's model, rank 0 traced on
PyTorch's fake process group, every rank measured for real on gloo.

What users run (transformers 5.23) is `AutoModelForCausalLM.from_pretrained(id,
distributed_config=DistributedConfig(tp_size=T))` (or the older `tp_plan="auto"`) under
`torchrun --nproc-per-node T`, then `model.generate(...)` on every rank. `from_pretrained`
builds the model, then `maybe_distribute_model` (`distributed/mixin.py` L304-343) resolves the
model's TP plan (its config's `base_model_tp_plan` and the head class's `_tp_plan`,
`_resolve_parallel_plans` L233-302) and applies it (`distributed/tensor_parallel.py`,
`apply_tensor_parallelism` L639-662): each planned weight becomes a DTensor holding the rank's
shard, each planned module gets the style's forward; the checkpoint's slices are then loaded
into the shards and tied weights are tied again (`_finalize_model_loading`).

`tensor_parallel_model(model, tp)` runs those transformers functions themselves on the model
memplan builds (`gen_capture.build_generation_model`, fake or real tensors), then gives every
shard a storage of its own, as loading a checkpoint slice does: DTensor's
`distribute_tensor(..., src_data_rank=None)` splits by view, so a shard along the first
dimension would otherwise keep the whole weight alive.

Under `torch.no_grad()` the styles take their local paths (`ColwiseParallel` and
`RowwiseParallel.should_use_local_tensors`): column-wise projections multiply the rank's
shard, row-wise ones all-reduce their output in place, the vocabulary-sharded embedding
all-reduces its partial lookup and the LM head all-gathers the logits; attention runs on the
rank's heads, so the KV cache holds `kv_heads / T` heads per rank (`get_kv_heads_per_rank`
sizes a static cache).

`tensor_parallel_rank0(tp)` is the fake process group of `memplan.parallel.traced` joined as
rank 0 (every rank holds the same shapes when the heads divide evenly): its collectives return
correctly shaped outputs and allocate what the op's output needs. Around them, gloo stages each
all-gather's output in a buffer of its own (`memplan.parallel.traced.gloo_staging_buffers`,
added to a cpu estimate) and NCCL keeps its buffers outside PyTorch's allocator (a device-profile
term of device used).

The ground truth, real gloo ranks loading the model by the users' path:
`memplan.inference.gen_groundtruth`.

Assumes a dense decoder whose transformers class has a TP plan, and heads that divide by T.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from memplan.errors import UserError
from memplan.models.build import model_class
from memplan.models.moe import experts_of
from memplan.models.setup import TrainingSetup
from memplan.parallel.apply import tied_embeddings
from memplan.parallel.traced import fake_process_group

if TYPE_CHECKING:  # transformers takes a second to import; only its config class is named here
    from transformers import PretrainedConfig

# the caches traced with TP: transformers builds them per rank from the rank's key states
TP_CACHES = ("dynamic", "static", "sliding", "quantized:fp8")


def check_tensor_parallel(config: PretrainedConfig, setup: TrainingSetup, cache: str, tp: int) -> None:
    """`UserError` for a TP call this version does not trace."""
    if tp == 1:
        return
    if tp < 1:
        raise UserError(f"--tp {tp}: tensor parallelism is a whole number of ranks >= 1")
    text = config.get_text_config(decoder=True)
    model_type = getattr(config, "model_type", "this model")
    if experts_of(config) is not None:
        raise UserError(f"--tp with a mixture of experts ({model_type}) is not traced by this version: leave --tp out")
    if setup.quant != "none":
        raise UserError("--tp with bitsandbytes --quant is not traced (transformers' TP plan shards nn.Linear "
                        "weights): leave one of them out")
    if cache not in TP_CACHES:
        raise UserError(f"--tp is traced with the {', '.join(TP_CACHES)} caches, not --cache {cache}")
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    if heads % tp or kv_heads % tp:
        raise UserError(f"--tp {tp} does not divide the model's {heads} attention heads and {kv_heads} key/value "
                        "heads: transformers' TP plan shards whole heads")
    if not (getattr(text, "base_model_tp_plan", None) or getattr(model_class(config), "_tp_plan", None)):
        raise UserError(f"transformers has no tensor-parallel plan for model type {model_type!r}: leave --tp out")


def tensor_parallel_model(model: torch.nn.Module, tp: int) -> torch.nn.Module:
    """`model` with transformers' TP plan applied over `tp` ranks, as `from_pretrained` applies it
    before loading (module docstring); its shards in storages of their own. The process group
    (real or fake) must be initialised with `tp` ranks."""
    from transformers.distributed import DistributedConfig

    cls = type(model)
    with unset_fake_temporarily():  # the device mesh holds real rank tables
        config, _, meshes = cls.prepare_distribute_model(DistributedConfig(tp_size=tp))
    if tied_embeddings(model):  # tied by loading, after the plan is applied (`_finalize_model_loading`)
        head = model.get_output_embeddings()
        head.weight = torch.nn.Parameter(torch.empty_like(head.weight), requires_grad=head.weight.requires_grad)
    try:
        model = cls.maybe_distribute_model(model, config, meshes)
    except ValueError as exc:  # transformers' refusal of a plan it cannot apply
        raise UserError(f"transformers cannot apply its TP plan to {cls.__name__}: {exc}") from None
    _own_shard_storages(model)
    model.tie_weights()
    return model


def _own_shard_storages(model: torch.nn.Module) -> None:
    """Every DTensor parameter's local tensor copied into a storage of its own size."""
    from torch.distributed.tensor import DTensor

    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if isinstance(param, DTensor) and param._local_tensor.untyped_storage().nbytes() > \
                    param._local_tensor.nbytes:
                local = param._local_tensor.detach().clone()
                shard = DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                           shape=param.shape, stride=param.stride())
                module._parameters[name] = torch.nn.Parameter(shard, requires_grad=param.requires_grad)


@contextlib.contextmanager
def tensor_parallel_rank0(tp: int) -> Iterator[None]:
    """PyTorch's fake process group of `tp` ranks, joined as rank 0 (nothing for `tp` 1)."""
    if tp == 1:
        yield
        return
    with fake_process_group(0, tp):
        yield
