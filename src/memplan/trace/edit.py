"""GPU-only memory terms added to a trace captured on (fake) cpu tensors.

A CUDA job is traced on fake cpu tensors (a CPU-only PyTorch cannot run autograd on
fake cuda tensors; see `memplan.capture.step`), with CUDA's memory-relevant defaults
forced on the CPU path where PyTorch has the same kernels: foreach / fused optimizers
(same temporaries on both devices), the explicit fp32 upcast of the logits in Hugging
Face's loss (`logits.float()` runs on every device), and eager (math) attention.
What the CPU path cannot show is added here, as extra buffers in the trace, so that
the allocator simulator sees them with every other request:

- **SDPA kernels.** The CPU flash kernel saves the output and an fp32 logsumexp
  [B, H, S], as CUDA's flash kernel does. CUDA's flash backward (FlashAttention-2 in
  `aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp`, `mha_bwd`) also
  allocates, for the duration of the kernel, an fp32 `dq_accum`
  [B, round128(S), H, round32(D)] and an fp32 `softmax_d` [B, H, round128(S)]. fp32
  jobs cannot use flash on CUDA and take the memory-efficient kernel, whose logsumexp
  is padded to a multiple of 32 along S (`mem_eff_attention/kernel_forward.h`) and
  whose backward keeps an fp32 grad-q accumulator [B, S, H, D] and `delta` [B, H, S]
  (`kernel_backward.h`, `kNeedsAccumGradQ`; an upper bound: small head dims skip it).
- **cuBLAS workspace.** PyTorch allocates it through the caching allocator at the
  first matmul and keeps it (`CublasHandlePool.cpp`), so it counts in allocated and
  reserved memory; added as a buffer live from the start.

Allocator rounding (512 B) and the caching allocator's reserved memory are not
added here: the allocator simulator (`memplan.alloc.replay`) applies them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from memplan.errors import UserError
from memplan.trace.model import ALLOC, CATEGORY, FREE, HOST_DEVICES, PHASE, Trace
from memplan.trace.validate import validate

FLASH_FORWARD = "aten._scaled_dot_product_flash_attention_for_cpu.default"
FLASH_BACKWARD = "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"
# A fake CUDA step runs CUDA's own kernels (memplan.capture.cuda_kernels): the backward
# op names then say which kernel it is.
SDPA_BACKWARDS = {
    FLASH_BACKWARD: None,  # CPU flash: CUDA's kernel is flash, or memory-efficient in fp32
    "aten._scaled_dot_product_flash_attention_backward.default": "flash",
    "aten._scaled_dot_product_efficient_attention_backward.default": "efficient",
}


@dataclass(frozen=True)
class ExtraBuffer:
    """A buffer to add: allocated just before event `alloc_before`, freed just before
    event `free_before` (-1: live to the end). Both are event indices of the original
    trace. Its events run in `op`, else the allocation in the op of the event it precedes
    and the free in the op of the event it follows."""

    nbytes: int
    alloc_before: int
    free_before: int
    category: str
    phase: str = "other"
    op: int = -1
    device: int = 0


def with_extra_buffers(trace: Trace, extras: list[ExtraBuffer]) -> Trace:
    """A new trace: `trace` plus `extras`, events renumbered, ops and CSR kept."""
    if not extras:
        return trace
    n_old = trace.num_events
    n_buf = trace.num_buffers
    k = len(extras)
    # Sort key per event: an original event e sits at 2e+1; an inserted one before e at 2e.
    old_keys = 2 * np.arange(n_old, dtype=np.int64) + 1
    alloc_at = np.array([min(max(x.alloc_before, 0), n_old) for x in extras], np.int64)
    free_at = np.array([n_old if x.free_before < 0 else min(x.free_before, n_old) for x in extras], np.int64)
    live_to_end = np.array([x.free_before < 0 for x in extras])
    new_keys = [2 * alloc_at]
    new_kind = [np.full(k, ALLOC, np.int8)]
    new_buffer = [n_buf + np.arange(k, dtype=np.int64)]
    freed = ~live_to_end
    new_keys.append(2 * free_at[freed])
    new_kind.append(np.full(int(freed.sum()), FREE, np.int8))
    new_buffer.append(n_buf + np.flatnonzero(freed))
    keys = np.concatenate([old_keys, *new_keys])
    # ties (an alloc and a free inserted at the same spot): allocs first, so lifetimes stay >= 0
    tie = np.concatenate([np.zeros(n_old, np.int8), np.zeros(k, np.int8), np.ones(int(freed.sum()), np.int8)])
    order = np.lexsort((tie, keys))
    kind = np.concatenate([trace.events["kind"], *new_kind])[order]
    ev_buffer = np.concatenate([trace.events["buffer"], *new_buffer])[order]
    # an allocation runs in the op of the event it precedes, a free in the op of the event it follows
    op_at_key = np.concatenate([_op_at_positions(trace, alloc_at), _op_before_positions(trace, free_at[freed])])
    extra_ops = np.array([x.op for x in extras] + [x.op for x, f in zip(extras, freed) if f], np.int64)
    inserted_ops = np.where(extra_ops >= 0, extra_ops, op_at_key)
    ev_op = np.concatenate([trace.events["op"], inserted_ops])[order]
    new_index = np.empty(order.shape[0], np.int64)
    new_index[order] = np.arange(order.shape[0], dtype=np.int64)

    buffers = {}
    for name, col in trace.buffers.items():
        buffers[name] = np.concatenate([col, np.zeros(k, col.dtype)])
    buffers["nbytes"][n_buf:] = [x.nbytes for x in extras]
    buffers["category"][n_buf:] = [CATEGORY[x.category] for x in extras]
    buffers["phase"][n_buf:] = [PHASE[x.phase] for x in extras]
    buffers["alloc_op"][n_buf:] = [x.op for x in extras]
    buffers["device"][n_buf:] = [x.device for x in extras]
    buffers["iteration"][n_buf:] = -1
    buffers["microbatch"][n_buf:] = -1
    is_alloc = kind == ALLOC
    alloc_event = np.full(n_buf + k, -1, np.int64)
    free_event = np.full(n_buf + k, -1, np.int64)
    positions = np.arange(kind.shape[0], dtype=np.int64)
    alloc_event[ev_buffer[is_alloc]] = positions[is_alloc]
    free_event[ev_buffer[~is_alloc]] = positions[~is_alloc]
    buffers["alloc_event"] = alloc_event
    buffers["free_event"] = free_event
    ops = dict(trace.ops)
    if trace.num_ops:
        first = trace.ops["first_event"]
        # an op starts at its first original event (or where it would be, at the end)
        ops["first_event"] = np.where(first < n_old, new_index[np.minimum(first, n_old - 1)], kind.shape[0])
        ops["first_event"] = np.minimum.accumulate(ops["first_event"][::-1])[::-1]
    out = Trace(buffers=buffers, events={"kind": kind, "buffer": ev_buffer, "op": ev_op}, ops=ops,
                csr=trace.csr, op_names=trace.op_names, modules=trace.modules, devices=trace.devices,
                meta=dict(trace.meta))
    return validate(out)


def _op_at_positions(trace: Trace, positions: np.ndarray) -> np.ndarray:
    """The op running at each insertion position (the op of the event it precedes)."""
    if trace.num_events == 0:
        return np.full(positions.shape[0], -1, np.int64)
    idx = np.minimum(positions, trace.num_events - 1)
    return trace.events["op"][idx].astype(np.int64)


def _op_before_positions(trace: Trace, positions: np.ndarray) -> np.ndarray:
    """The op running just before each insertion position (the op of the event it follows;
    at position 0, the op of the first event)."""
    if trace.num_events == 0:
        return np.full(positions.shape[0], -1, np.int64)
    idx = np.clip(positions - 1, 0, trace.num_events - 1)
    return trace.events["op"][idx].astype(np.int64)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _op_event_span(trace: Trace, op: int) -> tuple[int, int]:
    """(first event, one past the last event) of op `op`."""
    first = int(trace.ops["first_event"][op])
    nxt = int(trace.ops["first_event"][op + 1]) if op + 1 < trace.num_ops else trace.num_events
    return first, nxt


def attention_kernel_buffers(trace: Trace, *, dtype: str, attn: str, seq: int, head_dim: int) -> list[ExtraBuffer]:
    """CUDA SDPA workspace that the CPU flash kernel does not allocate (see module docstring).

    Each CPU flash backward op gets one temporary buffer over its own events. `dtype` is
    the dtype the attention runs in ("fp32", "bf16", "fp16"): fp32 means CUDA's
    memory-efficient kernel. Eager attention (`attn="eager"`) has no SDPA op and needs nothing.
    """
    if attn == "eager":
        return []
    kernel_of_op: dict[int, str] = {}
    for name, kernel in SDPA_BACKWARDS.items():
        if name in trace.op_names:
            code = trace.op_names.index(name)
            for op in np.flatnonzero(trace.ops["name"] == code).tolist():
                kernel_of_op[op] = kernel or ("efficient" if dtype == "fp32" else "flash")
    extras = []
    for op in sorted(kernel_of_op):
        outputs = trace.op_outputs(op)
        if outputs.shape[0] == 0:
            continue
        grad_q_bytes = int(trace.buffers["nbytes"][outputs[0]])
        element = 4 if dtype == "fp32" else 2
        tokens_x_heads = grad_q_bytes // (element * max(head_dim, 1))  # B * S * H
        if kernel_of_op[op] == "efficient":  # memory-efficient kernel: fp32 grad-q accumulator + delta
            nbytes = tokens_x_heads * head_dim * 4 + tokens_x_heads * 4
        else:  # flash: dq_accum + softmax_d, with S rounded up to 128 and D to 32
            batch_x_heads = max(tokens_x_heads // max(seq, 1), 1)
            rows = batch_x_heads * _round_up(seq, 128)
            nbytes = rows * _round_up(head_dim, 32) * 4 + rows * 4
        first, end = _op_event_span(trace, op)
        extras.append(ExtraBuffer(nbytes=int(nbytes), alloc_before=first, free_before=end,
                                  category="temporary", phase="backward", op=op,
                                  device=_device_of_op(trace, op)))
    return extras


def _device_of_op(trace: Trace, op: int) -> int:
    outputs = trace.op_outputs(op)
    return int(trace.buffers["device"][outputs[0]]) if outputs.shape[0] else 0


def workspace_buffer(trace: Trace, nbytes: int) -> list[ExtraBuffer]:
    """The cuBLAS workspace: one buffer live from the start of the step."""
    if nbytes <= 0:
        return []
    return [ExtraBuffer(nbytes=int(nbytes), alloc_before=0, free_before=-1, category="other",
                        device=trace.main_device())]

def device_view(trace: Trace, device: str | None = None) -> Trace:
    """The trace with buffers of every other device (cpu and host memory included) given
    zero bytes.

    With no `device` asked for: the one accelerator, else cpu (host memory a cpu job
    keeps apart, `host:*`, left out); the trace itself when every buffer is there.
    """
    names = trace.devices
    used = sorted({names[int(i)] for i in np.unique(trace.buffers["device"])}) if trace.num_buffers else []
    if device is None:
        accelerators = [name for name in used if name != "cpu" and name not in HOST_DEVICES]
        if len(accelerators) > 1:
            raise UserError(f"the trace has buffers on {', '.join(accelerators)}: pick one with --device")
        device = accelerators[0] if accelerators else "cpu" if "cpu" in used else None
        if device is None or len(used) == 1:
            return trace
    if device not in names:
        raise UserError(f"device {device!r} is not in the trace (it has {', '.join(used) or 'no buffers'})")
    keep = trace.buffers["device"] == names.index(device)
    if bool(keep.all()):
        return trace
    buffers = dict(trace.buffers)
    buffers["nbytes"] = np.where(keep, trace.buffers["nbytes"], 0)
    return Trace(buffers=buffers, events=trace.events, ops=trace.ops, csr=trace.csr,
                 op_names=trace.op_names, modules=trace.modules, devices=trace.devices,
                 meta=trace.meta)


def without_host(trace: Trace) -> Trace:
    """The trace with its host-memory buffers (`host:*`, memplan.models.tracing) given
    zero bytes: what the GPU's allocator serves. The trace itself when it has none."""
    host = trace.host_mask()
    if not bool(host.any()):
        return trace
    buffers = {**trace.buffers, "nbytes": np.where(host, 0, trace.buffers["nbytes"])}
    return Trace(buffers=buffers, events=trace.events, ops=trace.ops, csr=trace.csr, op_names=trace.op_names,
                 modules=trace.modules, devices=trace.devices, meta=trace.meta)
