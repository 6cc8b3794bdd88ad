"""The lifetime trace of a training step: the one object every engine works on.

A trace is columnar. The time axis is the **event**: event e is the e-th storage
allocation or free of the step, in the order they happened. Every buffer (one tensor
storage) is allocated at one event and freed at a later one, or stays live past the
end (`free_event == -1`). Ops sit on the same axis: op i ran while events
`op_first_event[i] .. op_first_event[i+1]-1` happened.

Columns are numpy arrays so that a million buffers load and scan in seconds.
Strings (op names, module paths, devices) are stored once in a table and referred
to by index. Which buffers an op read and wrote is kept in CSR form
(`op_inputs_ptr`/`op_inputs`, `op_outputs_ptr`/`op_outputs`).

Engines never mutate a trace: they read its columns and return new objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

CATEGORIES = (
    "parameter",
    "gradient",
    "optimizer_state",
    "activation",
    "temporary",
    "input",
    "other",
)
PHASES = ("forward", "backward", "recompute", "optimizer", "other")
EVENT_KINDS = ("alloc", "free")

# Host memory a GPU job keeps (memplan.models.tracing): the devices table names it
# `host:pinned` (page-locked, cudaHostAlloc), `host:pageable` (ordinary host memory) or
# `host:managed` (CUDA unified memory, cudaMallocManaged, backed by the host).
HOST_KINDS = ("pinned", "pageable", "managed")
HOST_DEVICES = tuple(f"host:{kind}" for kind in HOST_KINDS)

CATEGORY = {name: i for i, name in enumerate(CATEGORIES)}
PHASE = {name: i for i, name in enumerate(PHASES)}
ALLOC, FREE = 0, 1

# Column name -> numpy dtype, per table. The on-disk format stores exactly these.
BUFFER_COLUMNS: dict[str, Any] = {
    "nbytes": np.int64,
    "alloc_event": np.int64,
    "free_event": np.int64,  # -1: live at the end of the trace
    "category": np.int8,  # index into CATEGORIES
    "device": np.int16,  # index into devices
    "stream": np.int32,
    "alloc_op": np.int64,  # -1: allocated outside any op (pre-existing, or by the runner)
    "module": np.int32,  # index into modules; 0 is "" (no module)
    "phase": np.int8,  # phase of the allocation, index into PHASES
    "iteration": np.int32,
    "microbatch": np.int32,
}
OP_COLUMNS: dict[str, Any] = {
    "name": np.int32,  # index into op_names
    "module": np.int32,
    "phase": np.int8,
    "iteration": np.int32,
    "microbatch": np.int32,
    "first_event": np.int64,
    "flops": np.float64,  # NaN where unknown
    "bytes_moved": np.float64,  # NaN where unknown
}
EVENT_COLUMNS: dict[str, Any] = {
    "kind": np.int8,  # ALLOC or FREE
    "buffer": np.int64,
    "op": np.int64,  # the op running when it happened, -1 if none
}
CSR_COLUMNS: dict[str, Any] = {
    "op_inputs_ptr": np.int64,
    "op_inputs": np.int64,
    "op_outputs_ptr": np.int64,
    "op_outputs": np.int64,
}


def _empty(columns: dict[str, Any]) -> dict[str, np.ndarray]:
    return {name: np.zeros(0, dtype=dtype) for name, dtype in columns.items()}


@dataclass
class Trace:
    """Buffers, events and ops of one or more training iterations."""

    buffers: dict[str, np.ndarray] = field(default_factory=lambda: _empty(BUFFER_COLUMNS))
    events: dict[str, np.ndarray] = field(default_factory=lambda: _empty(EVENT_COLUMNS))
    ops: dict[str, np.ndarray] = field(default_factory=lambda: _empty(OP_COLUMNS))
    csr: dict[str, np.ndarray] = field(
        default_factory=lambda: {
            "op_inputs_ptr": np.zeros(1, np.int64),
            "op_inputs": np.zeros(0, np.int64),
            "op_outputs_ptr": np.zeros(1, np.int64),
            "op_outputs": np.zeros(0, np.int64),
        }
    )
    op_names: list[str] = field(default_factory=list)
    modules: list[str] = field(default_factory=lambda: [""])
    devices: list[str] = field(default_factory=lambda: ["cpu"])
    meta: dict[str, Any] = field(default_factory=dict)

    # --- sizes -------------------------------------------------------------------
    @property
    def num_buffers(self) -> int:
        return int(self.buffers["nbytes"].shape[0])

    @property
    def num_events(self) -> int:
        return int(self.events["kind"].shape[0])

    @property
    def num_ops(self) -> int:
        return int(self.ops["name"].shape[0])

    # --- derived views -------------------------------------------------------------
    def op_inputs(self, op: int) -> np.ndarray:
        ptr = self.csr["op_inputs_ptr"]
        return self.csr["op_inputs"][ptr[op] : ptr[op + 1]]

    def op_outputs(self, op: int) -> np.ndarray:
        ptr = self.csr["op_outputs_ptr"]
        return self.csr["op_outputs"][ptr[op] : ptr[op + 1]]

    def free_event_or_end(self) -> np.ndarray:
        """Free event per buffer, with buffers live at the end freed at `num_events`."""
        free = self.buffers["free_event"].copy()
        free[free < 0] = self.num_events
        return free

    def host_mask(self, kind: str | None = None) -> np.ndarray:
        """Per buffer: whether it lives in host memory (of `kind`, one of `HOST_KINDS`)."""
        names = HOST_DEVICES if kind is None else (f"host:{kind}",)
        host = np.array([name in names for name in self.devices], bool)
        return host[self.buffers["device"]] if self.num_buffers else np.zeros(0, bool)

    def main_device(self) -> int:
        """The device (index into `devices`) most buffers are on, host memory left out."""
        if not self.num_buffers:
            return 0
        counts = np.bincount(self.buffers["device"], minlength=len(self.devices))
        counts[[i for i, name in enumerate(self.devices) if name in HOST_DEVICES]] = -1
        return int(np.argmax(counts))

    def live_bytes(self, buffers: np.ndarray | None = None) -> np.ndarray:
        """Live bytes after each event (length num_events), of the buffers the boolean
        mask `buffers` selects (default: all)."""
        kind = self.events["kind"]
        sizes = self.buffers["nbytes"] if buffers is None else np.where(buffers, self.buffers["nbytes"], 0)
        nbytes = sizes[self.events["buffer"]]
        delta = np.where(kind == ALLOC, nbytes, -nbytes)
        return np.cumsum(delta, dtype=np.int64)

    def peak(self) -> tuple[int, int]:
        """(peak live bytes, the event after which it is first reached)."""
        if self.num_events == 0:
            return 0, -1
        live = self.live_bytes()
        event = int(np.argmax(live))
        return int(live[event]), event

    def live_at(self, event: int) -> np.ndarray:
        """Boolean mask of the buffers live just after `event`."""
        alloc = self.buffers["alloc_event"]
        return (alloc <= event) & (self.free_event_or_end() > event)

    def breakdown_at(self, event: int) -> dict[str, int]:
        """Live bytes per category just after `event`."""
        mask = self.live_at(event)
        sums = np.bincount(
            self.buffers["category"][mask],
            weights=self.buffers["nbytes"][mask],
            minlength=len(CATEGORIES),
        )
        return {name: int(sums[i]) for i, name in enumerate(CATEGORIES)}

    def phase_at(self, event: int) -> str:
        """Phase of the op running at `event` (or of the buffer event itself)."""
        if event < 0:
            return "other"
        op = int(self.events["op"][event])
        if op >= 0:
            return PHASES[int(self.ops["phase"][op])]
        buffer = int(self.events["buffer"][event])
        return PHASES[int(self.buffers["phase"][buffer])]

    def category_names(self) -> np.ndarray:
        return np.asarray(CATEGORIES)[self.buffers["category"]]

    def module_of_buffer(self, buffer: int) -> str:
        return self.modules[int(self.buffers["module"][buffer])]

    def op_name(self, op: int) -> str:
        return self.op_names[int(self.ops["name"][op])]

    def lifetimes(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(lower, upper, nbytes): half-open event lifetimes, as the offset solvers take them."""
        return (
            self.buffers["alloc_event"].copy(),
            self.free_event_or_end(),
            self.buffers["nbytes"].copy(),
        )

    def summary(self, top: int = 10) -> dict[str, Any]:
        """Peak, its phase and breakdown, and the largest buffers: what `memplan show` prints."""
        peak_bytes, peak_event = self.peak()
        breakdown = self.breakdown_at(peak_event) if peak_event >= 0 else dict.fromkeys(CATEGORIES, 0)
        order = np.argsort(-self.buffers["nbytes"], kind="stable")[:top]
        largest = []
        for b in order.tolist():
            op = int(self.buffers["alloc_op"][b])
            largest.append(
                {
                    "buffer": b,
                    "nbytes": int(self.buffers["nbytes"][b]),
                    "category": CATEGORIES[int(self.buffers["category"][b])],
                    "phase": PHASES[int(self.buffers["phase"][b])],
                    "module": self.module_of_buffer(b),
                    "op": self.op_name(op) if op >= 0 else None,
                    "alloc_event": int(self.buffers["alloc_event"][b]),
                    "free_event": int(self.buffers["free_event"][b]),
                }
            )
        return {
            "peak_bytes": peak_bytes,
            "peak_event": peak_event,
            "peak_phase": self.phase_at(peak_event),
            "breakdown": breakdown,
            "num_buffers": self.num_buffers,
            "num_ops": self.num_ops,
            "num_events": self.num_events,
            "largest_buffers": largest,
            "meta": self.meta,
        }


def from_events(
    kinds: np.ndarray,
    nbytes_per_buffer: np.ndarray,
    buffers_of_events: np.ndarray,
    *,
    streams: np.ndarray | None = None,
    categories: np.ndarray | None = None,
    meta: dict[str, Any] | None = None,
) -> Trace:
    """Build a trace with no ops from a bare alloc/free event list.

    `kinds[e]` is ALLOC or FREE and `buffers_of_events[e]` the buffer it concerns;
    buffer b's size is `nbytes_per_buffer[b]`. Used by importers (minimalloc CSV,
    snapshots) and by tests that hand-write event sequences.
    """
    kinds = np.asarray(kinds, dtype=np.int8)
    event_buffer = np.asarray(buffers_of_events, dtype=np.int64)
    nbytes = np.asarray(nbytes_per_buffer, dtype=np.int64)
    n = nbytes.shape[0]
    alloc_event = np.full(n, -1, np.int64)
    free_event = np.full(n, -1, np.int64)
    events = np.arange(kinds.shape[0], dtype=np.int64)
    alloc_mask = kinds == ALLOC
    alloc_event[event_buffer[alloc_mask]] = events[alloc_mask]
    free_event[event_buffer[~alloc_mask]] = events[~alloc_mask]
    buffers = {name: np.zeros(n, dtype=dtype) for name, dtype in BUFFER_COLUMNS.items()}
    buffers.update(nbytes=nbytes, alloc_event=alloc_event, free_event=free_event)
    buffers["alloc_op"][:] = -1
    buffers["phase"][:] = PHASE["other"]
    buffers["category"][:] = CATEGORY["other"]
    if streams is not None:
        buffers["stream"] = np.asarray(streams, dtype=np.int32)
    if categories is not None:
        buffers["category"] = np.asarray(categories, dtype=np.int8)
    return Trace(
        buffers=buffers,
        events={"kind": kinds, "buffer": event_buffer, "op": np.full(kinds.shape[0], -1, np.int64)},
        meta=dict(meta or {}),
    )
