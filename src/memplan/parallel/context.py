"""Context parallelism (CP) applied to a Hugging Face decoder, as PyTorch runs it.

CP splits each sequence over the ranks of a "cp" mesh dimension and computes attention
as a ring (`torch.distributed.tensor.experimental.context_parallel`, PyTorch's
`_context_parallel/_attention.py`): inside the context, `F.scaled_dot_product_attention`
is wrapped so that its query, key and value become DTensors sharded on the sequence
dimension (`Shard(2)`), and DTensor sends the fused SDPA ops to
`_templated_ring_attention` (forward) and `_templated_ring_attention_backward`: each rank
keeps its queries, receives the other ranks' keys and values (rotate method "allgather",
PyTorch's and torchtitan's default: one all-gather of the concatenated [k, v] of the
block, then a chunk per ring step; the backward rotates the key/value gradients with
all-to-all, `_RotateMethod.ALL_TO_ALL`, whatever the setting), runs the kernel per
chunk and merges the partial outputs by their log-sum-exp in fp32 (`_SDPAMerger`).
The sequence is load-balanced for causal attention (`_HeadTailLoadBalancer`): it is cut
into 2C chunks of seq / 2C and rank r holds chunks r and 2C - 1 - r.

The step is the one Hugging Face's Trainer runs with accelerate's
`ParallelismConfig(cp_size=C)` (`Trainer._prepare_context_parallel_inputs`,
`Accelerator.maybe_context_parallel`): per micro-batch, `shift_labels` (the labels
shifted once, before the sequence is split) and `position_ids` (the rotary embeddings
are computed from them, so they are split with the tokens) are added to the batch,
and the forward and backward run inside `context_parallel(cp_mesh, buffers=[input_ids,
labels, shift_labels, position_ids], buffer_seq_dims=[1, 1, 1, 1],
no_restore_buffers=...)`, which shards the four in place. Each attention module gets
accelerate's `_attach_context_parallel_hooks` pre-hook (the attention mask dropped,
`is_causal=True`): with split position ids, transformers would otherwise detect packed
sequences and build a mask, which the ring does not take (it refuses `attn_bias`).
torchtitan's `train.py` is the same with its own model (buffers: inputs, labels and the
rotary `freqs_cis`). Both shard the parameters with FSDP2 over the data-parallel x CP
ranks (torchtitan's "dp_shard_cp" mesh dimension; accelerate's too): CP is applied with
`--zero 3` only (`memplan.parallel.apply`).

PyTorch's ring dispatches only the CUDA kernels (`_scaled_dot_product_flash_attention`,
`_efficient_attention`, `_cudnn_attention`); on a CPU tensor SDPA runs
`_scaled_dot_product_flash_attention_for_cpu`, which DTensor has no sharding strategy for
(a gloo run of `context_parallel` fails with "Operator
aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy
registered"). `cpu_ring_attention()` adds the CPU flash kernel to the ring's dispatch
table, calling PyTorch's own `_templated_ring_attention` / `_backward` with it (its
outputs, out and log-sum-exp [B, H, S], are what the ring expects), so that a CPU job
(the gloo ground truth, and its estimate) runs the same ring as a GPU; a CUDA job traced
on fake cpu tensors runs CUDA's kernels (`memplan.capture.cuda_kernels`) through
PyTorch's own handler.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from memplan import models
from memplan.capture.cuda_kernels import kernels_as_on_cuda
from memplan.errors import UserError
from memplan.models.setup import TrainingSetup

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

IGNORE_INDEX = -100  # transformers' and PyTorch's cross-entropy ignore index
CP_BUFFERS = ("input_ids", "labels", "shift_labels", "position_ids")  # Trainer's order, each split on dim 1

aten = torch.ops.aten


def context_parallel_batch(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A fresh copy of a causal-LM `batch` with `shift_labels` and `position_ids` added,
    as `Trainer._prepare_context_parallel_inputs` adds them (the copy stands for the
    data loader's new batch of each step: `context_parallel` splits the buffers in place)."""
    ids, labels = batch["input_ids"].clone(), batch["labels"].clone()
    shifted = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:].contiguous()
    positions = torch.arange(ids.size(1), device=ids.device).expand(ids.size(0), -1)
    return {"input_ids": ids, "labels": labels, "shift_labels": shifted, "position_ids": positions}


def attach_attention_hooks(model: torch.nn.Module) -> None:
    """accelerate's `_attach_context_parallel_hooks`: every `self_attn` module's mask is
    dropped for `is_causal=True` (module docstring). accelerate refuses models whose
    layers use a stricter mask (sliding-window, chunked): a `UserError` here."""
    from accelerate.big_modeling import _attach_context_parallel_hooks

    try:
        _attach_context_parallel_hooks(model)
    except ValueError as exc:
        raise UserError(f"`cp`: {str(exc).split('. ')[0]}: context parallelism needs full causal attention") from exc


def _ring_output(local: torch.Tensor, like: Any) -> Any:
    """`local`, a rank's shard of an SDPA output, as a DTensor sharded like `like`."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._utils import compute_global_tensor_info

    mesh, placements = like.device_mesh, like.placements
    shape, stride = compute_global_tensor_info(local, mesh, placements)
    spec = DTensorSpec(mesh, placements, tensor_meta=TensorMeta(torch.Size(shape), tuple(stride), local.dtype))
    return DTensor(local, spec, requires_grad=False)


def _cpu_flash_ring(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """DTensor handler of the CPU flash kernel and its backward under CP: PyTorch's ring
    (`_templated_ring_attention` / `_backward`) over the kernel, as `_sdpa_handler` runs
    the CUDA kernels."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental._context_parallel import _attention

    op_info = DTensor._op_dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    group = op_info.compute_mesh.get_group()
    local = list(op_info.local_args)
    options = dict(op_info.local_kwargs)
    if op_call is aten._scaled_dot_product_flash_attention_for_cpu.default:
        query, key, value, *rest = local
        names = ("dropout_p", "is_causal")
        options.update(dict(zip(names, rest)))
        is_causal = bool(options.pop("is_causal", False))
        out, lse = _attention._templated_ring_attention(
            group, 2, aten._scaled_dot_product_flash_attention_for_cpu, query, key, value,
            is_causal=is_causal, **options)
        return _ring_output(out, args[0]), _ring_output(lse, args[0])
    grad_out, query, key, value, out, lse, *rest = local
    options.update(dict(zip(("dropout_p", "is_causal"), rest)))
    is_causal = bool(options.pop("is_causal", False))
    grads = _attention._templated_ring_attention_backward(
        group, 2, aten._scaled_dot_product_flash_attention_for_cpu_backward.default, grad_out, "grad_out",
        query, key, value, out, lse, is_causal, **options)
    return tuple(_ring_output(g, args[1]) for g in grads[:3])


@contextlib.contextmanager
def cpu_ring_attention() -> Iterator[None]:
    """Within this block, `context_parallel` also runs the CPU flash kernel as a ring
    (module docstring); the entries are added to the table PyTorch installs when the
    context is entered (`_attention.custom_ops`), and removed after."""
    from torch.distributed.tensor.experimental._context_parallel import _attention

    ops = (aten._scaled_dot_product_flash_attention_for_cpu.default,
           aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
    for op in ops:
        _attention.custom_ops[op] = _cpu_flash_ring
    try:
        yield
    finally:
        for op in ops:
            _attention.custom_ops.pop(op, None)


def context_parallel_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                          batches: list[dict[str, torch.Tensor]], setup: TrainingSetup, cp_mesh: DeviceMesh, *,
                          cuda_kernels: bool = False) -> Callable[[], None]:
    """The training step of a CP rank (module docstring): per micro-batch, a fresh batch
    split by `context_parallel` around its forward and backward; then the optimizer."""
    from torch.distributed.tensor.experimental import context_parallel

    accum = len(batches)

    def micro_batch(batch: dict[str, torch.Tensor]) -> None:
        inputs = context_parallel_batch(batch)
        buffers = [inputs[name] for name in CP_BUFFERS]
        with context_parallel(cp_mesh, buffers=buffers, buffer_seq_dims=[1] * len(buffers),
                              no_restore_buffers=set(buffers)):
            with models.autocast(setup, "cpu"):
                loss = models.forward_loss(model, inputs)
                if accum > 1:
                    loss = loss / accum
            loss.backward()
            del loss

    def step() -> None:
        with kernels_as_on_cuda() if cuda_kernels else contextlib.nullcontext(), cpu_ring_attention():
            for batch in batches:
                micro_batch(batch)
        optimizer.step()
        optimizer.zero_grad(set_to_none=setup.zero_grad == "none")

    return step
