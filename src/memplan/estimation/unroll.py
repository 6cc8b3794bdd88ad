"""The full-depth trace of a deep model, unrolled from its trace at a few blocks.

Method (memplan's own; docs/estimation.md, "Deep models: the unrolled step"): a step of a
model with L blocks is its step with k+1 blocks (the last ones identical) and L-k-1 more
copies of a middle block's events.
Every event of the k+1-block trace gets the block whose segment it is in (the block of
its op's module; an op run in no module's forward or backward takes its neighbour's, as
FSDP2's post-backward does; an optimizer op outside the blocks none), every buffer the
block it belongs to (its module's, else the block of the segment that allocated it,
else, for the optimizer's temporaries, the block of the parameter's tensor the op read
at the same position: `_foreach_*` ops return one tensor per input of their first list;
else the block of the segment that freed it, as a per-parameter optimizer's step count).
Block m = k-1, the second to last (a middle block whose neighbours are traced: the first
block can differ, its input needs no gradient under LoRA; the last one prefetches nothing
under FSDP2), is repeated: after each of its forward segments come its copies in order, before each of its
backward segments (recompute included) the copies in reverse order, and a run of events
outside the blocks on its buffers (its parameters and optimizer state allocated before
the step, the optimizer's temporaries, the gradients freed) is followed by the same run
on each copy's buffers.

The blocks of the unrolled trace are virtual: 0..m, the copies m+1..m+n, then the
traced blocks after m. An event of virtual block V, a copy of traced block S, on a buffer
of traced block t refers to the buffer of virtual block V + (t - S) that plays its part:
the copy of the buffer of block m with the same key (module path with the block number
left out, category, size, device, stream, micro-batch, allocating op, the blocks of its
allocating and freeing segments relative to its own) and the same rank among those. So
a block's output, freed by the next block's backward, and the gradient of its input,
freed by the previous block's backward, chain through the copies as they do through
traced blocks. The copies' modules are numbered as the blocks they stand for, and the
traced blocks after m renumbered past them, so that what reads the unrolled trace by
block (the layout rules, the GPU terms) sees the full-depth step.

Assumptions: the blocks copied are identical (`memplan.estimation.pipeline.unroll_depth`
traces at full depth a model whose blocks alternate kinds), and what runs outside them
does not repeat per block. `unroll` returns None where the trace
does not have that shape (blocks missing, a copied event on a buffer of no block, a key
without a counterpart); the result is checked by `memplan.trace.validate` (every buffer
allocated once, freed at most once, after its allocation).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from memplan.trace.model import ALLOC, CATEGORY, PHASE, Trace
from memplan.trace.validate import TraceError, validate

_OUT = 1 << 20  # an event outside the blocks, as a block offset
_LIVE = 2 << 20  # never freed, as a block offset
_OUTSIDE_RUN = -2  # label of a run of outside events on block m's buffers


class _NotUnrollable(Exception):
    """The trace does not have the shape unrolling assumes (module docstring)."""


@dataclass
class _Blocks:
    """Where the blocks are in a trace: per event the block of its segment, per buffer
    the block it belongs to (-1: none), blocks numbered 0..count-1 in model order."""

    segment: np.ndarray
    owner: np.ndarray
    count: int
    paths: np.ndarray  # per module: its path with the block number left out, as an index
    module_block: np.ndarray  # per module: the block it is in (-1: none)
    first_number: int  # the number of block 0 in module paths
    number_spans: list[tuple[int, int]]  # per module: where its block number sits in its path


def block_numbers(modules: list[str], blocks_path: str) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int]]]:
    """Per module path: the number of the block it is in (-1: none), the index of its
    path with that number left out (modules of the same place in every block share it),
    and where the number sits in the path ((0, 0): nowhere)."""
    tail = re.escape(blocks_path.split(".")[-1]) if blocks_path else None
    pattern = re.compile(rf"(^|\.){tail}\.(\d+)(?=\.|$)") if tail else None
    numbers = np.full(len(modules), -1, np.int64)
    generic: dict[str, int] = {}
    paths = np.zeros(len(modules), np.int64)
    spans = []
    for i, name in enumerate(modules):
        match = pattern.search(name) if pattern is not None else None
        spans.append((match.start(2), match.end(2)) if match is not None else (0, 0))
        if match is not None:
            numbers[i] = int(match.group(2))
            name = name[: match.start(2)] + "*" + name[match.end(2):]
        paths[i] = generic.setdefault(name, len(generic))
    return numbers, paths, spans


def locate_blocks(trace: Trace, blocks_path: str, count: int) -> _Blocks:
    """The blocks of `trace` (module docstring); `_NotUnrollable` unless it has `count`."""
    numbers, paths, spans = block_numbers(trace.modules, blocks_path)
    used = np.unique(numbers[numbers >= 0])
    if used.shape[0] != count:
        raise _NotUnrollable(f"{used.shape[0]} blocks found, {count} expected")
    rank = np.full(int(numbers.max()) + 2 if numbers.shape[0] else 1, -1, np.int64)
    rank[used] = np.arange(count)
    module_block = rank[numbers]  # -1 stays -1 (the last entry)
    segment = _segments(trace, module_block)
    owner = module_block[trace.buffers["module"]] if trace.num_buffers else np.zeros(0, np.int64)
    at_alloc = segment[trace.buffers["alloc_event"]] if trace.num_buffers else owner
    owner = np.where(owner >= 0, owner, at_alloc)
    _owners_from_inputs(trace, owner)
    free = trace.buffers["free_event"] if trace.num_buffers else owner
    at_free = np.where(free >= 0, segment[np.maximum(free, 0)], -1) if trace.num_buffers else owner
    owner = np.where(owner >= 0, owner, at_free)
    return _Blocks(segment, owner, count, paths, module_block, int(used[0]), spans)


def _segments(trace: Trace, module_block: np.ndarray) -> np.ndarray:
    """Per event: the block whose segment it is in (module docstring)."""
    op = trace.events["op"]
    has_op = op >= 0
    safe = np.maximum(op, 0)
    module = np.where(has_op, trace.ops["module"][safe], 0) if trace.num_ops else np.zeros_like(op)
    phase = np.where(has_op, trace.ops["phase"][safe], -1) if trace.num_ops else np.full_like(op, -1)
    block = module_block[module]
    no_module = ~has_op | (module == 0)
    optimizer = has_op & (module == 0) & (phase == PHASE["optimizer"])
    inherits = no_module & ~optimizer
    source = np.where(inherits, -1, np.arange(op.shape[0]))
    np.maximum.accumulate(source, out=source)
    segment = np.where(source >= 0, block[np.maximum(source, 0)], -1)
    return np.where(optimizer, -1, segment)


def _owners_from_inputs(trace: Trace, owner: np.ndarray) -> None:
    """Buffers of no block allocated by an optimizer op of no module: the block of the
    op's input at the same position (`_foreach_*`), else of its inputs when they share
    one (in place)."""
    alloc_op = trace.buffers["alloc_op"]
    safe = np.maximum(alloc_op, 0)
    optimizer = (alloc_op >= 0) & (trace.ops["module"][safe] == 0) & (trace.ops["phase"][safe] == PHASE["optimizer"]) \
        if trace.num_ops else np.zeros_like(owner, bool)
    untagged = np.flatnonzero((owner < 0) & optimizer)
    if not untagged.shape[0]:
        return
    for op in np.unique(alloc_op[untagged]).tolist():
        inputs = trace.op_inputs(op)
        outputs = trace.op_outputs(op)
        input_owners = owner[inputs] if inputs.shape[0] else inputs
        shared = np.unique(input_owners[input_owners >= 0])
        for i, buffer in enumerate(outputs.tolist()):
            if owner[buffer] >= 0:
                continue
            if inputs.shape[0] >= outputs.shape[0] and input_owners[i] >= 0:
                owner[buffer] = input_owners[i]
            elif shared.shape[0] == 1:
                owner[buffer] = shared[0]


def counterparts(trace: Trace, blocks: _Blocks) -> np.ndarray:
    """`table[u, b]`: the buffer of block u that plays buffer b's part (-1: none; module
    docstring), for the buffers of a block."""
    b = trace.buffers
    nb = trace.num_buffers
    table = np.full((blocks.count, nb), -1, np.int64)
    tagged = np.flatnonzero(blocks.owner >= 0)
    if not tagged.shape[0]:
        return table
    owner = blocks.owner[tagged]
    alloc_seg = blocks.segment[b["alloc_event"][tagged]]
    free_event = b["free_event"][tagged]
    free_seg = np.where(free_event >= 0, blocks.segment[np.maximum(free_event, 0)], -1)
    alloc_off = np.where(alloc_seg >= 0, alloc_seg - owner, _OUT)
    free_off = np.where(free_event < 0, _LIVE, np.where(free_seg >= 0, free_seg - owner, _OUT))
    alloc_op = b["alloc_op"][tagged]
    op_name = np.where(alloc_op >= 0, trace.ops["name"][np.maximum(alloc_op, 0)], -1) if trace.num_ops else alloc_op
    columns = np.stack([blocks.paths[b["module"][tagged]], b["category"][tagged], b["nbytes"][tagged],
                        b["device"][tagged], b["stream"][tagged], b["microbatch"][tagged], op_name, alloc_off,
                        free_off], axis=1)
    _, key = np.unique(columns, axis=0, return_inverse=True)
    key = key.reshape(-1)
    order = np.lexsort((b["alloc_event"][tagged], owner, key))
    group = key[order] * blocks.count + owner[order]
    starts = np.flatnonzero(np.r_[True, group[1:] != group[:-1]])
    sizes = np.diff(np.r_[starts, group.shape[0]])
    rank = np.empty(order.shape[0], np.int64)
    rank[order] = np.arange(order.shape[0]) - np.repeat(starts, sizes)
    code = (key * (int(rank.max()) + 1) + rank) * blocks.count
    sorted_codes = np.sort(code + owner)
    where_sorted = np.argsort(code + owner, kind="stable")
    for u in range(blocks.count):
        query = code + u
        pos = np.minimum(np.searchsorted(sorted_codes, query), sorted_codes.shape[0] - 1)
        found = sorted_codes[pos] == query
        table[u, tagged] = np.where(found, tagged[where_sorted[pos]], -1)
    return table


@dataclass
class _Plan:
    """What the unrolled trace is made of: the copied block m, n copies, the counterpart
    table and where block m's buffers sit among the copies' new buffers."""

    blocks: _Blocks
    table: np.ndarray
    m: int
    copies: int
    block_buffers: np.ndarray  # the buffers of block m
    position: np.ndarray  # per buffer: its index among block_buffers (-1: not block m's)
    buffers: int  # buffers of the traced step


def _instances(plan: _Plan, buffers: np.ndarray, virtual: np.ndarray, source: np.ndarray | int, *,
               strict: bool = True) -> np.ndarray:
    """The unrolled buffers that references to `buffers` from traced block `source` mean
    when that block runs as virtual block(s) `virtual` (module docstring), in the shape
    of `virtual`. `strict`: a reference with no counterpart raises `_NotUnrollable`
    (else it keeps the traced buffer: an op's read of it, which no event depends on)."""
    owner = np.broadcast_to(plan.blocks.owner[buffers], virtual.shape)
    buffers = np.broadcast_to(buffers, virtual.shape)
    target = virtual + (owner - source)
    m, n = plan.m, plan.copies
    copy = (target > m) & (target <= m + n)
    block = np.where(target > m + n, target - n, np.where(copy, m, target))
    outside = (block < 0) | (block >= plan.blocks.count)
    part = plan.table[np.clip(block, 0, plan.blocks.count - 1), buffers]
    part = np.where(outside, -1, part)
    missing = (owner >= 0) & (part < 0)
    if strict and missing.any():
        raise _NotUnrollable("a buffer has no counterpart in the block its copy refers to")
    made = plan.buffers + (target - m - 1) * plan.block_buffers.shape[0] + plan.position[np.maximum(part, 0)]
    return np.where((owner < 0) | missing, buffers, np.where(copy, made, part))


def _units(trace: Trace, blocks: _Blocks, m: int) -> list[tuple[int, int, int]]:
    """Runs of events (start, end, label): a block's segment (label: the block), a run
    outside the blocks on block m's buffers (`_OUTSIDE_RUN`), or another run outside (-1)."""
    on_m = blocks.owner[trace.events["buffer"]] == m
    label = np.where(blocks.segment >= 0, blocks.segment, np.where(on_m, _OUTSIDE_RUN, -1))
    n = label.shape[0]
    starts = np.flatnonzero(np.r_[True, label[1:] != label[:-1]]) if n else np.zeros(0, np.int64)
    ends = np.r_[starts[1:], n].astype(np.int64)
    return [(int(s), int(e), int(label[s])) for s, e in zip(starts.tolist(), ends.tolist())]


def _backward_like(trace: Trace, start: int, end: int) -> bool:
    """Whether a segment runs in backward (or recompute), where blocks run last to first."""
    ops = trace.events["op"][start:end]
    ops = ops[ops >= 0]
    if not ops.shape[0]:
        return False
    return int(trace.ops["phase"][ops[0]]) in (PHASE["backward"], PHASE["recompute"])


def _emit(trace: Trace, plan: _Plan) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """The unrolled events as chunks: kinds, buffers, and op keys (op x (copies+1) + copy)."""
    kinds, buffers, op_keys = [], [], []
    ev_kind, ev_buffer, ev_op = trace.events["kind"], trace.events["buffer"], trace.events["op"]
    m, n, stride = plan.m, plan.copies, plan.copies + 1
    for start, end, label in _units(trace, plan.blocks, m):
        kind, buf, op = ev_kind[start:end], ev_buffer[start:end], ev_op[start:end]
        if label == -1:
            copies = [(np.asarray(buf), 0)]
        elif label == _OUTSIDE_RUN:
            made = plan.buffers + np.arange(n)[:, None] * plan.block_buffers.shape[0] + plan.position[buf][None, :]
            copies = [(np.asarray(buf), 0)] + [(made[c], 0) for c in range(n)]
        elif label != m:
            virtual = label if label < m else label + n
            copies = [(_instances(plan, buf, np.full(buf.shape, virtual), label), 0)]
        else:
            made = _instances(plan, buf, m + np.arange(n + 1)[:, None] + np.zeros(buf.shape, np.int64), m)
            order = list(range(n, -1, -1)) if _backward_like(trace, start, end) else list(range(n + 1))
            copies = [(made[c], c) for c in order]
        for instance, copy in copies:
            kinds.append(kind)
            buffers.append(instance)
            op_keys.append(np.where(op >= 0, op * stride + copy, -1))
    return kinds, buffers, op_keys


def unroll(trace: Trace, blocks_path: str, traced_blocks: int, layers: int) -> Trace | None:
    """`trace` (a step at `traced_blocks` identical blocks, >= 3) unrolled to `layers`
    blocks (module docstring); None where it does not have that shape."""
    if layers < traced_blocks or traced_blocks < 3:
        return None
    if layers == traced_blocks:
        return trace
    try:
        blocks = locate_blocks(trace, blocks_path, traced_blocks)
        m = traced_blocks - 2
        block_buffers = np.flatnonzero(blocks.owner == m)
        position = np.full(trace.num_buffers, -1, np.int64)
        position[block_buffers] = np.arange(block_buffers.shape[0])
        plan = _Plan(blocks, counterparts(trace, blocks), m, layers - traced_blocks, block_buffers, position,
                     trace.num_buffers)
        kinds, buffers, op_keys = _emit(trace, plan)
        return _assemble(trace, plan, np.concatenate(kinds), np.concatenate(buffers), np.concatenate(op_keys))
    except (_NotUnrollable, TraceError):
        return None


def _modules(trace: Trace, plan: _Plan) -> tuple[list[str], np.ndarray]:
    """The unrolled module table: the traced blocks after m renumbered past the copies,
    then block m's modules once per copy; and `copy_module[c, i]`, the module of copy
    c + 1 that module i of block m becomes (i itself for other modules)."""
    blocks, m, n = plan.blocks, plan.m, plan.copies
    names = list(trace.modules)

    def numbered(i: int, virtual: int) -> str:
        start, end = blocks.number_spans[i]
        return names[i][:start] + str(blocks.first_number + virtual) + names[i][end:]

    later = np.flatnonzero(blocks.module_block > m).tolist()
    renamed = {i: numbered(i, int(blocks.module_block[i]) + n) for i in later}
    mine = np.flatnonzero(blocks.module_block == m)
    copy_module = np.tile(np.arange(len(names), dtype=np.int64), (n, 1))
    table = [renamed.get(i, name) for i, name in enumerate(names)]
    for c in range(n):
        copy_module[c, mine] = len(table) + np.arange(mine.shape[0])
        table += [numbered(int(i), m + 1 + c) for i in mine.tolist()]
    return table, copy_module


def _csr(trace: Trace, plan: _Plan, source_ops: np.ndarray, copy: np.ndarray) -> dict[str, np.ndarray]:
    """The unrolled ops' reads and writes: each op's traced ones, seen from its virtual block."""
    m, n = plan.m, plan.copies
    first = trace.ops["first_event"][source_ops]
    segment = plan.blocks.segment[np.minimum(first, max(trace.num_events - 1, 0))]
    virtual = np.where(segment == m, m + copy, np.where(segment > m, segment + n, segment))
    out = {}
    for side in ("inputs", "outputs"):
        ptr, idx = trace.csr[f"op_{side}_ptr"], trace.csr[f"op_{side}"]
        counts = np.diff(ptr)[source_ops]
        starts = np.repeat(ptr[source_ops], counts)
        offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        entries = idx[starts + offsets]
        seg, virt = np.repeat(segment, counts), np.repeat(virtual, counts)
        mapped = _instances(plan, entries, virt, seg, strict=False)
        out[f"op_{side}"] = np.where(seg >= 0, mapped, entries).astype(np.int64)
        out[f"op_{side}_ptr"] = np.r_[0, np.cumsum(counts)].astype(np.int64)
    return out


def _assemble(trace: Trace, plan: _Plan, kind: np.ndarray, buffer: np.ndarray, op_key: np.ndarray) -> Trace:
    """The unrolled `Trace`: the traced buffers, then block m's buffers once per copy; ops
    in the order they first run (an op with no event is left out); the copies' modules
    numbered as the blocks they stand for."""
    stride = plan.copies + 1
    has_op = op_key >= 0
    keys, first = np.unique(op_key[has_op], return_index=True)
    order = np.argsort(first, kind="stable")
    new_id = np.empty(keys.shape[0], np.int64)
    new_id[order] = np.arange(keys.shape[0])
    event_op = np.full(kind.shape[0], -1, np.int64)
    event_op[has_op] = new_id[np.searchsorted(keys, op_key[has_op])]
    source_ops, copy = (keys // stride)[order], (keys % stride)[order]
    modules, copy_module = _modules(trace, plan)
    ops = {name: col[source_ops] for name, col in trace.ops.items()}
    ops["first_event"] = np.flatnonzero(has_op)[first[order]].astype(np.int64)
    copied = copy > 0
    ops["module"] = np.where(copied, copy_module[np.maximum(copy - 1, 0), ops["module"]], ops["module"])
    csr = _csr(trace, plan, source_ops, copy)
    copied_buffers = np.tile(plan.block_buffers, plan.copies)
    buffers = {name: np.concatenate([col, col[copied_buffers]]) for name, col in trace.buffers.items()}
    which_copy = np.repeat(np.arange(plan.copies), plan.block_buffers.shape[0])
    buffers["module"][trace.num_buffers:] = copy_module[which_copy, trace.buffers["module"][copied_buffers]]
    total = buffers["nbytes"].shape[0]
    events = np.arange(kind.shape[0], dtype=np.int64)
    alloc = kind == ALLOC
    buffers["alloc_event"] = np.full(total, -1, np.int64)
    buffers["alloc_event"][buffer[alloc]] = events[alloc]
    buffers["free_event"] = np.full(total, -1, np.int64)
    buffers["free_event"][buffer[~alloc]] = events[~alloc]
    buffers["alloc_op"] = np.where(buffers["alloc_event"] >= 0, event_op[np.maximum(buffers["alloc_event"], 0)], -1)
    out = Trace(buffers=buffers, events={"kind": kind.astype(np.int8), "buffer": buffer.astype(np.int64),
                                         "op": event_op}, ops=ops, csr=csr, op_names=trace.op_names,
                modules=modules, devices=trace.devices, meta=_meta(trace, plan))
    return validate(out)


def _meta(trace: Trace, plan: _Plan) -> dict:
    """The traced step's metadata, with the bytes of the parameters the optimizers step
    (`trainable_bytes`, what gradient buckets hold) as at the full depth: block m's, the
    size of its gradients of one micro-batch, once more per copy."""
    meta = dict(trace.meta)
    if "trainable_bytes" in meta:
        b = trace.buffers
        grads = (plan.blocks.owner == plan.m) & (b["category"] == CATEGORY["gradient"])
        if grads.any():
            grads &= b["microbatch"] == b["microbatch"][grads].min()
        meta["trainable_bytes"] = int(meta["trainable_bytes"]) + plan.copies * int(b["nbytes"][grads].sum())
    return meta


def ops_at_depth(trace: Trace, blocks_path: str, traced_blocks: int, layers: int) -> dict[str, np.ndarray] | None:
    """`trace`'s op table with each op's FLOPs and bytes moved as at `layers` blocks: an op
    of block m's modules runs once more per copy; an op of no block (an optimizer's
    `_foreach_*` over every parameter) grows by the share of its tensors that are block
    m's, once per copy (module docstring); None where `trace` does not have the shape."""
    try:
        blocks = locate_blocks(trace, blocks_path, traced_blocks)
    except _NotUnrollable:
        return None
    copies = layers - traced_blocks
    m = traced_blocks - 2
    nbytes = trace.buffers["nbytes"].astype(np.float64)
    mine = np.where(blocks.owner == m, nbytes, 0.0)
    owned, total = np.zeros(trace.num_ops), np.zeros(trace.num_ops)
    for side in ("inputs", "outputs"):
        ptr, idx = trace.csr[f"op_{side}_ptr"], trace.csr[f"op_{side}"]
        op_of = np.repeat(np.arange(trace.num_ops), np.diff(ptr))
        np.add.at(owned, op_of, mine[idx])
        np.add.at(total, op_of, nbytes[idx])
    block = blocks.module_block[trace.ops["module"]]
    outside_share = np.where(total > 0, owned / np.maximum(total, 1.0), 0.0)
    share = np.where(block == m, 1.0, np.where(block < 0, outside_share, 0.0))
    scale = 1.0 + copies * share
    return {**trace.ops, "flops": trace.ops["flops"] * scale, "bytes_moved": trace.ops["bytes_moved"] * scale}
