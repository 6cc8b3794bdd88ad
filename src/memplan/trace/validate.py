"""Consistency checks of a trace, independent of how it was built.

`validate(trace)` raises `TraceError` naming the first bad record (buffer, event or
op, by index) and what is wrong with it. Every importer and the capture run it before
handing a trace out; engines may assume a validated trace.
"""

from __future__ import annotations

import numpy as np

from memplan.errors import UserError
from memplan.trace.model import (
    ALLOC,
    BUFFER_COLUMNS,
    CATEGORIES,
    CSR_COLUMNS,
    EVENT_COLUMNS,
    FREE,
    OP_COLUMNS,
    PHASES,
    Trace,
)


class TraceError(UserError):
    """An inconsistent trace; the message names the bad record."""


def _first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def _check_columns(table: dict[str, np.ndarray], columns: dict, what: str) -> int:
    missing = [name for name in columns if name not in table]
    if missing:
        raise TraceError(f"{what} table lacks column(s) {', '.join(missing)}")
    lengths = {name: table[name].shape[0] for name in columns}
    if len(set(lengths.values())) > 1:
        raise TraceError(f"{what} columns have different lengths: {lengths}")
    for name in columns:
        if table[name].ndim != 1:
            raise TraceError(f"{what} column {name} is not one-dimensional")
    return next(iter(lengths.values()), 0)


def validate(trace: Trace) -> Trace:
    """Return `trace` unchanged if it is consistent; raise TraceError otherwise."""
    nb = _check_columns(trace.buffers, BUFFER_COLUMNS, "buffer")
    ne = _check_columns(trace.events, EVENT_COLUMNS, "event")
    no = _check_columns(trace.ops, OP_COLUMNS, "op")
    for name in CSR_COLUMNS:
        if name not in trace.csr:
            raise TraceError(f"op read/write table lacks {name}")
    _check_buffers(trace, nb, no)
    _check_events(trace, nb, ne, no)
    _check_ops(trace, nb, ne, no)
    return trace


def _check_buffers(trace: Trace, nb: int, no: int) -> None:
    """Codes and indices of the buffer table lie in their ranges; sizes are not negative."""
    b = trace.buffers
    if nb and (b["nbytes"] < 0).any():
        i = _first(b["nbytes"] < 0)
        raise TraceError(f"buffer {i}: negative size {int(b['nbytes'][i])}")
    for name, limit in (("category", len(CATEGORIES)), ("phase", len(PHASES))):
        bad = (b[name] < 0) | (b[name] >= limit)
        if bad.any():
            i = _first(bad)
            raise TraceError(f"buffer {i}: {name} code {int(b[name][i])} out of range")
    for name, table in (("module", trace.modules), ("device", trace.devices)):
        bad = (b[name] < 0) | (b[name] >= len(table))
        if bad.any():
            i = _first(bad)
            raise TraceError(f"buffer {i}: {name} index {int(b[name][i])} not in the {name} table")
    bad = (b["alloc_op"] < -1) | (b["alloc_op"] >= no)
    if bad.any():
        i = _first(bad)
        raise TraceError(f"buffer {i}: allocating op {int(b['alloc_op'][i])} does not exist")


def _check_events(trace: Trace, nb: int, ne: int, no: int) -> None:
    """Each buffer allocated exactly once, freed at most once, after its allocation."""
    b = trace.buffers
    e = trace.events
    if ne:
        bad = (e["kind"] != ALLOC) & (e["kind"] != FREE)
        if bad.any():
            i = _first(bad)
            raise TraceError(f"event {i}: kind {int(e['kind'][i])} is neither alloc nor free")
        bad = (e["buffer"] < 0) | (e["buffer"] >= nb)
        if bad.any():
            i = _first(bad)
            raise TraceError(f"event {i}: buffer {int(e['buffer'][i])} does not exist")
        bad = (e["op"] < -1) | (e["op"] >= no)
        if bad.any():
            i = _first(bad)
            raise TraceError(f"event {i}: op {int(e['op'][i])} does not exist")
    events = np.arange(ne, dtype=np.int64)
    allocs = e["kind"] == ALLOC
    alloc_count = np.bincount(e["buffer"][allocs], minlength=nb)
    free_count = np.bincount(e["buffer"][~allocs], minlength=nb)
    if nb and (alloc_count != 1).any():
        i = _first(alloc_count != 1)
        raise TraceError(f"buffer {i}: allocated {int(alloc_count[i])} times (must be once)")
    if nb and (free_count > 1).any():
        i = _first(free_count > 1)
        raise TraceError(f"buffer {i}: freed {int(free_count[i])} times")
    expect_alloc = np.full(nb, -1, np.int64)
    expect_alloc[e["buffer"][allocs]] = events[allocs]
    expect_free = np.full(nb, -1, np.int64)
    expect_free[e["buffer"][~allocs]] = events[~allocs]
    if nb and (expect_alloc != b["alloc_event"]).any():
        i = _first(expect_alloc != b["alloc_event"])
        raise TraceError(
            f"buffer {i}: alloc_event {int(b['alloc_event'][i])} but its alloc is event {int(expect_alloc[i])}"
        )
    if nb and (expect_free != b["free_event"]).any():
        i = _first(expect_free != b["free_event"])
        raise TraceError(
            f"buffer {i}: free_event {int(b['free_event'][i])} but its free is event {int(expect_free[i])}"
        )
    freed = b["free_event"] >= 0
    bad = freed & (b["free_event"] <= b["alloc_event"])
    if bad.any():
        i = _first(bad)
        raise TraceError(f"buffer {i}: freed at event {int(b['free_event'][i])} before it was allocated")


def _check_ops(trace: Trace, nb: int, ne: int, no: int) -> None:
    """Op names and modules resolve, event ranges ascend, the CSR references real buffers."""
    o = trace.ops
    for name, table in (("name", trace.op_names), ("module", trace.modules)):
        bad = (o[name] < 0) | (o[name] >= len(table))
        if bad.any():
            i = _first(bad)
            raise TraceError(f"op {i}: {name} index {int(o[name][i])} not in its table")
    bad = (o["phase"] < 0) | (o["phase"] >= len(PHASES))
    if bad.any():
        i = _first(bad)
        raise TraceError(f"op {i}: phase code {int(o['phase'][i])} out of range")
    if no:
        fe = o["first_event"]
        bad = (fe < 0) | (fe > ne)
        if bad.any():
            i = _first(bad)
            raise TraceError(f"op {i}: first_event {int(fe[i])} outside the trace")
        if (np.diff(fe) < 0).any():
            i = _first(np.diff(fe) < 0) + 1
            raise TraceError(f"op {i}: first_event {int(fe[i])} before the previous op's")
    for side in ("inputs", "outputs"):
        ptr = trace.csr[f"op_{side}_ptr"]
        idx = trace.csr[f"op_{side}"]
        if ptr.shape[0] != no + 1 or ptr[0] != 0 or ptr[-1] != idx.shape[0] or (np.diff(ptr) < 0).any():
            raise TraceError(f"op {side} index (op_{side}_ptr) is malformed")
        bad = (idx < 0) | (idx >= nb)
        if bad.any():
            j = _first(bad)
            op = int(np.searchsorted(ptr, j, "right") - 1)
            raise TraceError(f"op {op}: {side[:-1]} buffer {int(idx[j])} does not exist")
