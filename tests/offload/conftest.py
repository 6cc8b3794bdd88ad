"""Hand-built traces for the offload tests: a few buffers, a few ops, every use spelled out."""

from __future__ import annotations

import numpy as np
import pytest

from memplan.trace.model import ALLOC, BUFFER_COLUMNS, CATEGORY, FREE, OP_COLUMNS, PHASE, Trace


def build_trace(nbytes, categories, ops, persistent=(), durations=None):
    """`ops[i]` is a dict with optional keys alloc, free, reads, writes (buffer lists), and
    events: ("alloc" | "free", buffer) pairs in order, after the op's alloc and free lists.

    Buffers in `persistent` are allocated before the first op and never freed.
    Every op gets `bytes_moved` = 1 and no FLOPs, so roofline times are equal.
    """
    kinds, ev_buf, ev_op = [], [], []
    for b in persistent:
        kinds.append(ALLOC)
        ev_buf.append(b)
        ev_op.append(-1)
    first_event = []
    for i, op in enumerate(ops):
        first_event.append(len(kinds))
        for b in op.get("alloc", []):
            kinds.append(ALLOC)
            ev_buf.append(b)
            ev_op.append(i)
        for b in op.get("free", []):
            kinds.append(FREE)
            ev_buf.append(b)
            ev_op.append(i)
        for what, b in op.get("events", []):  # explicit order, after alloc and free
            kinds.append(ALLOC if what == "alloc" else FREE)
            ev_buf.append(b)
            ev_op.append(i)
    nb = len(nbytes)
    buffers = {name: np.zeros(nb, dtype=dtype) for name, dtype in BUFFER_COLUMNS.items()}
    buffers["nbytes"] = np.asarray(nbytes, np.int64)
    buffers["alloc_event"][:] = -1
    buffers["free_event"][:] = -1
    buffers["alloc_op"][:] = -1
    for e, (k, b) in enumerate(zip(kinds, ev_buf)):
        if k == ALLOC:
            buffers["alloc_event"][b] = e
            buffers["alloc_op"][b] = ev_op[e]
        else:
            buffers["free_event"][b] = e
    buffers["category"] = np.asarray([CATEGORY[c] for c in categories], np.int8)
    n = len(ops)
    opcols = {name: np.zeros(n, dtype=dtype) for name, dtype in OP_COLUMNS.items()}
    opcols["first_event"] = np.asarray(first_event, np.int64)
    opcols["flops"][:] = np.nan
    opcols["bytes_moved"][:] = 1.0
    opcols["phase"][:] = PHASE["forward"]
    ins = [list(op.get("reads", [])) for op in ops]
    outs = [list(op.get("writes", [])) + list(op.get("alloc", []))
            + [b for what, b in op.get("events", []) if what == "alloc"] for op in ops]
    csr = {
        "op_inputs_ptr": np.concatenate([[0], np.cumsum([len(x) for x in ins])]).astype(np.int64),
        "op_inputs": np.asarray([b for x in ins for b in x], np.int64),
        "op_outputs_ptr": np.concatenate([[0], np.cumsum([len(x) for x in outs])]).astype(np.int64),
        "op_outputs": np.asarray([b for x in outs for b in x], np.int64),
    }
    return Trace(
        buffers=buffers,
        events={"kind": np.asarray(kinds, np.int8), "buffer": np.asarray(ev_buf, np.int64),
                "op": np.asarray(ev_op, np.int64)},
        ops=opcols,
        csr=csr,
        op_names=["op"],
        meta={"setup": {"precision": "32-true"}},
    )


@pytest.fixture(scope="session")
def make_trace():
    return build_trace
