"""Reshape a single-GPU step trace into one rank's trace of a parallel layout.

The traced terms stay traced; what a parallel layout changes is *modelled* on top of
the single-device trace, rule by rule (the method of LLMem, arXiv 2404.10933, which
models sharded DP and TP analytically over a measured single-GPU base; memplan applies
the rules to every buffer of a trace instead of to totals):

- **TP degree t** (torchtitan's Llama plan with sequence parallel and loss parallel):
  parameters outside normalisation layers, their gradients, optimizer states and
  optimizer temporaries shrink by t; forward/backward activations and temporaries
  shrink by t (heads and MLP columns split, the sequence split between blocks,
  vocabulary-parallel logits); plus, per block, the two all-gathered [B, S, H]
  block-input copies that feed the attention and MLP projections (sequence-parallel
  all-gather outputs saved for the weight gradients; live only inside the block
  under full checkpointing).
- **ZeRO over d ranks** (DeepSpeed semantics for stages 1-2, FSDP2 `fully_shard` with
  `reshard_after_forward=True` for stage 3; HSDP shards over `shard_size`): stage >= 1
  shards optimizer states and optimizer temporaries by d; stage >= 2 shards gradients
  (plus one persistent reduce bucket of min(gradients, 5e8 elements), DeepSpeed's
  `reduce_bucket_size` default with `contiguous_gradients`); stage 3 shards parameters,
  and adds per block the unsharded all-gather output (the block's full parameter
  bytes) during its forward and, again, its backward, prefetched one block ahead, and
  the unsharded gradients of the block from its backward until the next block's
  reduce-scatter; the root module's parameters (embeddings, head, final norm) are
  gathered for the whole step.
- **DDP** (data parallel, stage 0, d > 1): the reducer's gradient buckets, one
  persistent copy of the gradients (`gradient_as_bucket_view=False`, the default).
- **PP degree p** with m micro-batches (1F1B): the rank traces one micro-batch of a
  model with L/p blocks; middle stages carry no embedding/head buffers; activations are
  multiplied by the micro-batches in flight at the stage: min(m, p - s) (Narayanan et
  al. 2021). PyTorch's multi-stage schedules are traced, not modelled
  (`memplan.parallel.schedules`).

These rules are the fast path: the estimate traces FSDP2 and DTensor TP for real on a
fake process group where it can (`memplan.parallel.traced`) and uses the rules for DDP,
ZeRO-1/2, PP, and `memplan fit`'s search. Against real gloo runs (docs/estimation.md):
the DDP rule is exact on every rank; the modelled ZeRO-3 rule is 2% low on a tiny Llama;
the TP rule assumes sequence and loss parallel, which the real (and traced) TP does not
apply: it is 31% low on Qwen2.5 TP 2, so `estimate` refuses TP it cannot trace and only
`fit` uses this rule.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import numpy as np

from memplan.capture.step import StepTrace
from memplan.hardware.roofline import matmul_dtype
from memplan.models.setup import TrainingSetup
from memplan.parallel import deepspeed
from memplan.parallel.layout import Layout
from memplan.trace.edit import ExtraBuffer, with_extra_buffers
from memplan.trace.model import CATEGORY, PHASE, Trace

NORM_PATTERN = re.compile(r"(norm|ln_|layernorm|ln\d|\.ln$)", re.IGNORECASE)
ZERO2_BUCKET_ELEMENTS = 500_000_000


def _shrink(nbytes: np.ndarray, mask: np.ndarray, factor: float) -> np.ndarray:
    out = nbytes.copy()
    out[mask] = np.ceil(nbytes[mask] / factor).astype(np.int64)
    return out


def _block_index(trace: Trace, blocks_path: str) -> np.ndarray:
    """Per module-table entry: the block index it belongs to, or -1."""
    tail = re.escape(blocks_path.split(".")[-1])
    rx = re.compile(rf"(?:^|\.){tail}\.(\d+)(?:\.|$)")
    out = np.full(len(trace.modules), -1, np.int64)
    for i, name in enumerate(trace.modules):
        m = rx.search(name)
        if m:
            out[i] = int(m.group(1))
    return out


def block_spans(trace: Trace, blocks_path: str) -> dict[int, dict[str, tuple[int, int]]]:
    """Per block: the (first, one-past-last) event of its forward and of its backward ops."""
    index = _block_index(trace, blocks_path)
    spans: dict[int, dict[str, tuple[int, int]]] = {}
    if trace.num_ops == 0:
        return spans
    first = trace.ops["first_event"]
    ends = np.append(first[1:], trace.num_events)
    block_of_op = index[trace.ops["module"]]
    phase = trace.ops["phase"]
    for name, phases in (("forward", (PHASE["forward"],)), ("backward", (PHASE["backward"], PHASE["recompute"]))):
        sel = (block_of_op >= 0) & np.isin(phase, phases)
        for b in np.unique(block_of_op[sel]).tolist():
            ops = np.flatnonzero(sel & (block_of_op == b))
            spans.setdefault(b, {})[name] = (int(first[ops].min()), int(ends[ops].max()))
    return spans


def _with_nbytes(trace: Trace, nbytes: np.ndarray) -> Trace:
    """`trace` with its buffers resized to `nbytes` (same events, ops and names)."""
    return Trace(buffers={**trace.buffers, "nbytes": nbytes}, events=trace.events, ops=trace.ops, csr=trace.csr,
                 op_names=trace.op_names, modules=trace.modules, devices=trace.devices, meta=dict(trace.meta))


def data_parallel_trace(step: StepTrace, layout: Layout, setup: TrainingSetup) -> Trace:
    """One rank of `layout` from the traced step of its TP (x PP) or multi-stage PP part
    (`memplan.parallel.apply.traced_part`): the data-parallel rules of `rank_trace` (DDP,
    ZeRO 1-3, HSDP) on the traced buffers, which are already the rank's TP shards. With
    PP, FSDP2 keeps a block's parameters unsharded from its first micro-batch's forward to
    its last micro-batch's backward (torchtitan's `reshard_after_forward` default when PP
    is on: resharding after every micro-batch's forward would gather them again per
    micro-batch)."""
    trace = step.trace
    data_parallel = Layout(world_size=layout.dp, zero=layout.zero, shard_size=layout.shard_size, engine=layout.engine)
    return rank_trace(replace(step, trace=trace), data_parallel, setup, 0, reshard_after_forward=layout.pp == 1)


@dataclass
class _Buffers:
    """Per-buffer masks of a trace that the layout rules select by."""

    cat: np.ndarray
    in_block: np.ndarray
    block: np.ndarray  # the block index of each buffer's module, or -1
    is_param: np.ndarray
    is_grad: np.ndarray
    is_state: np.ndarray
    opt_temp: np.ndarray  # temporaries of the optimizer step
    flowing: np.ndarray  # forward / backward activations and temporaries
    is_norm: np.ndarray
    device: int

    @classmethod
    def of(cls, trace: Trace, blocks_path: str) -> _Buffers:
        b = trace.buffers
        cat, phase = b["category"], b["phase"]
        block = _block_index(trace, blocks_path)[b["module"]]
        in_optimizer = phase == PHASE["optimizer"]
        module_names = np.asarray(trace.modules, dtype=object)
        is_norm = np.array([bool(NORM_PATTERN.search(str(m))) for m in module_names], bool)[b["module"]]
        return cls(cat=cat, in_block=block >= 0, block=block, is_param=cat == CATEGORY["parameter"],
                   is_grad=cat == CATEGORY["gradient"], is_state=cat == CATEGORY["optimizer_state"],
                   opt_temp=in_optimizer & (cat == CATEGORY["temporary"]),
                   flowing=~in_optimizer & np.isin(cat, [CATEGORY["activation"], CATEGORY["temporary"]]),
                   is_norm=is_norm, device=trace.main_device())


def rank_trace(step: StepTrace, layout: Layout, setup: TrainingSetup, stage: int, *,
               reshard_after_forward: bool = True) -> Trace:
    """The trace of one rank (pipeline `stage`) of `layout`; see the module docstring.
    `reshard_after_forward=False`: ZeRO-3 keeps each block's parameters unsharded from
    its forward to the end of its backward."""
    trace = step.trace
    if layout.tp == 1 and layout.dp == 1 and layout.pp == 1:
        return trace
    nbytes = trace.buffers["nbytes"].astype(np.int64)
    buf = _Buffers.of(trace, step.blocks_path)
    extras: list[ExtraBuffer] = []
    if layout.pp > 1:
        _pipeline_stage_rule(nbytes, buf, layout, stage)
    if layout.tp > 1:
        nbytes = _tensor_parallel_rule(nbytes, buf, layout.tp)
        extras += _sequence_parallel_buffers(step, setup, buf.device)
    # data parallel / ZeRO: the buckets hold one gradient per trainable parameter, sized
    # as the parameter (the traced rank's shard; the storage of a gradient can be larger)
    grad_bytes_full = int(nbytes[buf.is_grad].sum())
    if layout.tp == 1 and "trainable_bytes" in trace.meta:
        grad_bytes_full = min(grad_bytes_full, int(trace.meta["trainable_bytes"]))
    if layout.dp > 1 and layout.zero_engine == "deepspeed":
        nbytes = _deepspeed_rule(nbytes, buf, layout, setup, grad_bytes_full, step, extras)
    elif layout.dp > 1:
        nbytes = _data_parallel_rule(nbytes, buf, layout, setup, grad_bytes_full, extras)
        if layout.zero == 3:
            nbytes = _zero3_rule(nbytes, buf, layout.shard_degree, trace, step.blocks_path, reshard_after_forward,
                                 extras)
    return with_extra_buffers(_with_nbytes(trace, nbytes), extras)


def optimizer_offload_trace(trace: Trace) -> Trace:
    """One data-parallel rank's trace under DeepSpeed's ZeRO-Offload (`offload_optimizer`
    with ZeRO stage 2 or 3): the optimizer steps on the host's CPU over the rank's
    partition, so its states are host memory (pageable: DeepSpeedCPUAdam's states are
    made on the host partition), its step has no temporaries (DeepSpeedCPUAdam updates
    in place, `csrc/adam/cpu_adam_impl.cpp`; the traced GPU step's are dropped), and the
    rank's gradients the step reads are host memory too (pinned: `stage_1_and_2.py`,
    `DeepSpeedZeroOptimizer.initialize_optimizer_states` keeps the fp32 gradient
    partition in `get_accelerator().pin_memory(...)` when `cpu_offload` is on, and does not
    build `averaged_gradients` on the device; `stage3.py` likewise with `offload_optimizer`).
    The gradients are those live when the optimizer step starts: the rank's shards (and
    ZeRO-2's device-side reduce bucket, category other, stays on the device). Sizes are
    the traced ones: DeepSpeed's fp32 master partition and fp32 gradients of a bf16/fp16
    model (its mixed precision, not the offload) are not added (docs/estimation.md)."""
    b = trace.buffers
    cat, phase = b["category"], b["phase"]
    optimizer_ops = np.flatnonzero(trace.ops["phase"] == PHASE["optimizer"]) if trace.num_ops else np.zeros(0, int)
    start = int(trace.ops["first_event"][optimizer_ops[0]]) if optimizer_ops.shape[0] else trace.num_events
    live_at_step = (b["alloc_event"] < start) & (trace.free_event_or_end() >= start)
    devices = list(trace.devices)
    for name in ("host:pageable", "host:pinned"):
        if name not in devices:
            devices.append(name)
    device = b["device"].copy()
    device[cat == CATEGORY["optimizer_state"]] = devices.index("host:pageable")
    device[(cat == CATEGORY["gradient"]) & live_at_step] = devices.index("host:pinned")
    step_temporaries = (phase == PHASE["optimizer"]) & (cat == CATEGORY["temporary"])
    nbytes = np.where(step_temporaries, 0, b["nbytes"])
    return Trace(buffers={**b, "device": device.astype(b["device"].dtype), "nbytes": nbytes}, events=trace.events,
                 ops=trace.ops, csr=trace.csr, op_names=trace.op_names, modules=trace.modules, devices=devices,
                 meta=dict(trace.meta))


def _pipeline_stage_rule(nbytes: np.ndarray, buf: _Buffers, layout: Layout, stage: int) -> None:
    """Pipeline `stage`, in place: middle stages hold no embedding / head; activations
    times the micro-batches in flight."""
    last = layout.pp - 1
    if 0 < stage < last:
        nbytes[~buf.in_block & (buf.is_param | buf.is_grad | buf.flowing)] = 0
    in_flight = min(layout.microbatches, layout.pp - stage)
    act = buf.cat == CATEGORY["activation"]
    nbytes[act] = np.ceil(nbytes[act] * in_flight).astype(np.int64)


def _tensor_parallel_rule(nbytes: np.ndarray, buf: _Buffers, tp: int) -> np.ndarray:
    """TP degree `tp`: parameters outside norms and their gradients by `tp`, optimizer
    states and temporaries by the parameters' ratio, activations and temporaries by `tp`."""
    tp_state = (buf.is_param | buf.is_grad) & ~buf.is_norm
    full_param = nbytes[buf.is_param].sum()
    nbytes = _shrink(nbytes, tp_state, tp)
    ratio = nbytes[buf.is_param].sum() / full_param if full_param else 1.0
    nbytes = _shrink(nbytes, buf.is_state | buf.opt_temp, 1.0 / ratio if ratio else 1.0)
    return _shrink(nbytes, buf.flowing, tp)


def _sequence_parallel_buffers(step: StepTrace, setup: TrainingSetup, device: int) -> list[ExtraBuffer]:
    """Per block, the two all-gathered [B, S, H] inputs of attention and MLP (module docstring)."""
    hidden_bytes = _block_input_bytes(step, setup)
    full_ckpt = setup.checkpointing == "full"
    extras = []
    for spans in block_spans(step.trace, step.blocks_path).values():
        fwd, bwd = spans.get("forward"), spans.get("backward")
        if fwd is None:
            continue
        for _ in range(2):  # attention input and MLP input, all-gathered
            if full_ckpt or bwd is None:
                extras.append(ExtraBuffer(hidden_bytes, fwd[0], fwd[1], "activation", "forward", device=device))
                if bwd is not None:
                    extras.append(ExtraBuffer(hidden_bytes, bwd[0], bwd[1], "activation", "backward", device=device))
            else:
                extras.append(ExtraBuffer(hidden_bytes, fwd[0], bwd[1], "activation", "forward", device=device))
    return extras


def _data_parallel_rule(nbytes: np.ndarray, buf: _Buffers, layout: Layout, setup: TrainingSetup,
                        grad_bytes_full: int, extras: list[ExtraBuffer]) -> np.ndarray:
    """DDP's buckets, ZeRO-1/2's sharded states and gradients and ZeRO-2's reduce bucket
    (module docstring); the buckets are appended to `extras`."""
    zero, d = layout.zero, layout.shard_degree
    if zero == 0:
        extras.append(ExtraBuffer(grad_bytes_full, 0, -1, "other", device=buf.device))
    if zero >= 1:
        nbytes = _shrink(nbytes, buf.is_state | buf.opt_temp, d)
    if zero >= 2:
        nbytes = _shrink(nbytes, buf.is_grad, d)
    if zero == 2:
        element = 4 if setup.dtype == "fp32" else 2
        extras.append(ExtraBuffer(min(grad_bytes_full, ZERO2_BUCKET_ELEMENTS * element), 0, -1, "other",
                                  device=buf.device))
    return nbytes


def _block_bytes(nbytes: np.ndarray, buf: _Buffers, mask: np.ndarray) -> dict[int, int]:
    """Per block index, the bytes of the buffers `mask` selects in it."""
    return {int(k): int(nbytes[mask & (buf.block == k)].sum()) for k in np.unique(buf.block[mask & buf.in_block])}


def _deepspeed_rule(nbytes: np.ndarray, buf: _Buffers, layout: Layout, setup: TrainingSetup, grad_bytes_full: int,
                    step: StepTrace, extras: list[ExtraBuffer]) -> np.ndarray:
    """DeepSpeed's ZeRO stages 1-3 (`memplan.parallel.deepspeed`); its buffers are
    appended to `extras`."""
    trace, d, config = step.trace, layout.shard_degree, layout.deepspeed
    nbytes = _shrink(nbytes, buf.is_state | buf.opt_temp, 1.0 / deepspeed.optimizer_factor(setup, d))
    block_grads = _block_bytes(nbytes, buf, buf.is_grad)
    root_grads = int(nbytes[buf.is_grad & ~buf.in_block].sum())
    first, last = deepspeed.backward_start(trace), deepspeed.backward_end(trace)
    if layout.zero in (1, 2):
        extras += deepspeed.stage12_buffers(trace, setup, layout.zero, d, grad_bytes_full, config, buf.device)
        nbytes[buf.is_grad] = 0
        if layout.zero == 1:  # whole gradients until the backward's end reduces them into the partition
            spans = block_spans(trace, step.blocks_path)
            extras += [ExtraBuffer(block_grads[b], spans[b]["backward"][0], last, "gradient", "backward",
                                   device=buf.device) for b in block_grads if "backward" in spans.get(b, {})]
            extras.append(ExtraBuffer(root_grads, first, last, "gradient", "backward", device=buf.device))
        # stage 2: each gradient is copied into the reduce bucket as it is made, and freed
        return nbytes
    element = deepspeed.element_bytes(setup)
    full = nbytes.copy()
    nbytes[buf.is_param] = deepspeed.partitioned_bytes(full[buf.is_param], element, d,
                                                       config.param_persistence_threshold)
    gathered = buf.is_param & (nbytes != full)  # partitioned, so gathered where used
    block_params = _block_bytes(full, buf, gathered)
    nbytes[buf.is_grad] = 0
    extras += _fsdp_buffers(trace, step.blocks_path, block_params, block_grads,
                            int(full[gathered & ~buf.in_block].sum()), buf.device,
                            prefetch=deepspeed.stage3_prefetches(block_params, setup, config))
    extras += deepspeed.stage3_buffers(trace, setup, d, grad_bytes_full, config, buf.device)
    # the gradients outside the blocks are reduced by the backward's epilogue
    extras.append(ExtraBuffer(root_grads, first, last, "gradient", "backward", device=buf.device))
    return nbytes


def _zero3_rule(nbytes: np.ndarray, buf: _Buffers, d: int, trace: Trace, blocks_path: str,
                reshard_after_forward: bool, extras: list[ExtraBuffer]) -> np.ndarray:
    """ZeRO-3 / FSDP2 over `d` ranks: parameters sharded; the all-gather outputs and
    unsharded gradients (`_fsdp_buffers`) appended to `extras`."""
    block_param_bytes = {int(k): int(nbytes[buf.is_param & (buf.block == k)].sum())
                         for k in np.unique(buf.block[buf.is_param & buf.in_block])}
    block_grad_bytes = {int(k): int(nbytes[buf.is_grad & (buf.block == k)].sum())
                        for k in np.unique(buf.block[buf.is_grad & buf.in_block])}
    root_param_bytes = int(nbytes[buf.is_param & ~buf.in_block].sum())
    nbytes = _shrink(nbytes, buf.is_param, d)
    extras += _fsdp_buffers(trace, blocks_path, block_param_bytes, block_grad_bytes, root_param_bytes, buf.device,
                            reshard_after_forward)
    return nbytes


def _block_input_bytes(step: StepTrace, setup: TrainingSetup) -> int:
    """Bytes of one [B, S, H] block input in the activation dtype."""
    hidden = step.head_dim * step.heads
    element = 4 if matmul_dtype(setup) == "fp32" else 2
    return int(setup.batch * step.seq * hidden * element)


def _fsdp_buffers(trace: Trace, blocks_path: str, param_bytes: dict[int, int], grad_bytes: dict[int, int],
                  root_bytes: int, device: int, reshard_after_forward: bool = True,
                  prefetch: bool = True) -> list[ExtraBuffer]:
    """FSDP2 all-gather outputs (prefetched one block ahead; `prefetch=False`: gathered
    when the block starts) and unsharded gradients; without `reshard_after_forward`, one
    all-gather output per block, from its forward (prefetched) to the end of its backward."""
    spans = block_spans(trace, blocks_path)
    order_fwd = sorted(b for b in spans if "forward" in spans[b])
    extras = []
    fwd_start = min((spans[b]["forward"][0] for b in order_fwd), default=0)
    bwd_ends = [spans[b]["backward"][1] for b in spans if "backward" in spans[b]]
    if root_bytes:
        extras.append(ExtraBuffer(root_bytes, fwd_start, max(bwd_ends) if bwd_ends else -1, "other", "forward",
                                  device=device))
    for i, blk in enumerate(order_fwd):
        start = spans[order_fwd[i - 1]]["forward"][0] if i > 0 and prefetch else spans[blk]["forward"][0]
        end = spans[blk]["forward"][1]
        if not reshard_after_forward:
            end = spans[blk].get("backward", (start, end))[1]
        extras.append(ExtraBuffer(param_bytes.get(blk, 0), start, end, "other", "forward", device=device))
    if not reshard_after_forward:
        param_bytes = {}  # the forward's all-gather output stays for the backward
    order_bwd = sorted((b for b in spans if "backward" in spans[b]), key=lambda b: spans[b]["backward"][0])
    for i, blk in enumerate(order_bwd):
        start = spans[order_bwd[i - 1]]["backward"][0] if i > 0 and prefetch else spans[blk]["backward"][0]
        end = spans[blk]["backward"][1]
        extras.append(ExtraBuffer(param_bytes.get(blk, 0), start, end, "other", "backward", device=device))
        grad_end = spans[order_bwd[i + 1]]["backward"][1] if i + 1 < len(order_bwd) else end
        extras.append(ExtraBuffer(grad_bytes.get(blk, 0), spans[blk]["backward"][0], grad_end, "gradient",
                                  "backward", device=device))
    return [x for x in extras if x.nbytes > 0]
