"""PyTorch CUDA memory snapshots (`torch.cuda.memory._dump_snapshot`) in and out of traces.

A snapshot is the pickle PyTorch users already make on GPUs::

    torch.cuda.memory._record_memory_history()
    ...                                   # run the step
    torch.cuda.memory._dump_snapshot("x.pickle")

and pytorch.org/memory_viz draws. Its format is PyTorch's, not ours: the reference is
the `_snapshot()` docstring in `torch/cuda/memory.py` (TypedDicts Snapshot, Segment,
Block, Frame, TraceEntry) and the code that consumes snapshots, `torch/cuda/_memory_viz.py`
and `torch/utils/viz/MemoryViz.js` (the page behind memory_viz).

**Import** (`load_snapshot`). Every `device_traces` entry with action `alloc` opens a
buffer at its (device, address); it closes at the next `free_completed` at that
address, or at the `free_requested` if the completion was never recorded. Entries of
all devices are merged by `time_us` (device by device when any entry lacks it). A free
whose allocation was not recorded (history started late, or the ring buffer dropped it),
and every block that `segments` shows allocated at snapshot time with no open allocation
in the trace, becomes a buffer live from the start: their allocations are the first
events, in (device, address) order. Sizes are the entry's `size` (for blocks, `size`):
the allocator's rounded block size, which is what occupied the device. Segment actions,
`oom` and `snapshot` entries carry no tensor and are only counted in `meta`. Streams keep
their values when they fit an int32; otherwise (real `cudaStream_t` values are
pointers) the default stream stays 0, the others are numbered 1, 2, ... by first
appearance and the original values are kept in `meta["snapshot_streams"]`. Device i is
named `cuda:i`. The importer builds no ops. It fills a buffer's module from its frames
(innermost first): the innermost Python frame outside the `torch` package (the user's
model code), written as `file.py:line:function` like memory_viz writes it, else the
innermost Python frame, else "" (a Python frame: `filename` ends in .py, or, as
`profile_plot` writes frames, `name` reads `path.py(line): function`). The category
comes from the entry's `category` (written by `torch.cuda._memory_viz.profile_plot`
and by memplan), "other" otherwise.

**Export** (`to_snapshot`, `save_snapshot`). No allocator is simulated: each buffer is
laid out in a slot of its size rounded up to `BLOCK_ALIGN_BYTES` (512: the caching
allocator's `kMinBlockSize` in `c10/cuda/CUDACachingAllocator.cpp`), inside one segment per
(device, stream), by best fit with coalescing (the caching allocator's rule: the
smallest free range that fits, lowest address on ties; the arena grows at the top
when none fits). A segment is as large as its arena's high-water mark rounded up to
2 MiB, and is created by a `segment_alloc` entry at the start. Event e becomes an
`alloc` entry, or a `free_requested` + `free_completed` pair, with `time_us = e` and
`size` = the buffer's exact `nbytes`. Frames are readable: the first names the op and
its module (`name` = op, `filename` = module path, `line` = op index), the second
(`filename` = "memplan") the buffer, category, phase, iteration and micro-batch;
`category` is set on every entry so memory_viz colours by category (memplan's "other"
is written as memory_viz's "unknown"). The exact trace travels under the extra
top-level key `"memplan"` (every column as a list, string tables, meta), so
`load_snapshot(to_snapshot(t))` reproduces `t` exactly; without that key a snapshot
is read from its events as above. The pickle uses protocol 4 and plain containers
only: memory_viz's JavaScript unpickler reads nothing else.

**Security.** Unpickling an untrusted file runs code. The loader uses an Unpickler
that refuses every global except plain builtin containers and scalars (dict, list,
tuple, set, str, int, float, bool, bytes, None); real snapshots hold only those, so a
pickle that names any other class or function (`os.system`, ...) is rejected before
anything runs.
"""

from __future__ import annotations

import bisect
import builtins
import io
import json
import os
import pickle
import re
from pathlib import Path
from typing import Any

import numpy as np

from memplan.errors import UserError
from memplan.trace.memtrace import FORMAT_NAME, FORMAT_VERSION, atomic_write
from memplan.trace.model import (
    ALLOC,
    BUFFER_COLUMNS,
    CATEGORIES,
    CATEGORY,
    CSR_COLUMNS,
    EVENT_COLUMNS,
    FREE,
    OP_COLUMNS,
    PHASE,
    PHASES,
    Trace,
    from_events,
)
from memplan.trace.validate import validate

SNAPSHOT_KEY = "memplan"
PICKLE_PROTOCOL = 4  # MemoryViz.js unpickles protocols 2 to 4 only

# Export slots are rounded as the caching allocator rounds a request: to multiples of
# its kMinBlockSize (c10/cuda/CUDACachingAllocator.cpp, `round_size`; in memplan the
# rule's owner is memplan.alloc.conf, a layer above this one, so it is a constant here).
BLOCK_ALIGN_BYTES = 512
SEGMENT_ALIGN_BYTES = 2 * 1024 * 1024  # kRoundLarge
SEGMENT_BASE_ADDRESS = 0x7F00_0000_0000  # where synthetic segments start (looks like a device pointer)

ACTIVE_BLOCK_STATES = ("active_allocated", "active_awaiting_free", "active_pending_free")
TENSOR_ACTIONS = ("alloc", "free_requested", "free_completed")
OTHER_ACTIONS = ("segment_alloc", "segment_free", "segment_map", "segment_unmap", "oom", "snapshot")

_TABLES = {"buffers": BUFFER_COLUMNS, "events": EVENT_COLUMNS, "ops": OP_COLUMNS, "csr": CSR_COLUMNS}
_ALLOWED_GLOBALS = frozenset(
    {"dict", "list", "tuple", "set", "frozenset", "str", "int", "float", "bool", "bytes", "bytearray"}
)
_NO_MODULE = "<no module>"
_NO_OP = "<no op>"
_MEMPLAN_FRAME_FILE = "memplan"
_MEMPLAN_FRAME_NAME = re.compile(r"^buffer (\d+) (\w+) (\w+) iteration (-?\d+) microbatch (-?\d+)$")
_PROFILER_FRAME_NAME = re.compile(r"^(.+\.py)\((\d+)\): (.*)$")
_INT32_MAX = 2**31 - 1


# --- reading the pickle -----------------------------------------------------------------


class _PlainDataUnpickler(pickle.Unpickler):
    """Loads plain containers and scalars; refuses any other global, so nothing can run."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "builtins" and name in _ALLOWED_GLOBALS:
            return getattr(builtins, name)
        raise pickle.UnpicklingError(
            f"it names {module}.{name}; a memory snapshot holds only plain data, so it was not loaded"
        )


def read_snapshot_pickle(path: str | os.PathLike) -> Any:
    """Unpickle `path` with the plain-data Unpickler; raise UserError if it is not a readable pickle."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"snapshot file {path} does not exist")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise UserError(f"cannot read snapshot {path}: {exc}") from None
    try:
        return _PlainDataUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # a damaged pickle can fail in many ways; all mean "not readable"
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise UserError(f"cannot read snapshot {path}: not a valid pickle ({reason})") from None


def load_snapshot(path_or_obj: str | os.PathLike | dict | list) -> Trace:
    """A Trace from a PyTorch memory snapshot: a pickle path, or the already-loaded dict.

    Raises UserError (one line) for a file that is missing, not a pickle, a pickle that
    names any non-builtin class (it is never executed), or data that is not a snapshot.
    """
    if isinstance(path_or_obj, (dict, list)):
        where, snapshot = "snapshot", path_or_obj
    else:
        where, snapshot = str(path_or_obj), read_snapshot_pickle(path_or_obj)
    if isinstance(snapshot, list):  # segments only, as _memory_viz._read accepts
        snapshot = {"segments": snapshot, "device_traces": []}
    if not isinstance(snapshot, dict) or "segments" not in snapshot:
        got = type(snapshot).__name__
        if isinstance(snapshot, dict):
            got = f"a dict with keys {sorted(map(str, snapshot))[:6]}"
        raise UserError(
            f"{where} is not a PyTorch memory snapshot (expected a dict with 'segments' and "
            f"'device_traces', got {got}); make one with torch.cuda.memory._dump_snapshot"
        )
    if SNAPSHOT_KEY in snapshot:
        trace = _trace_from_columns(snapshot[SNAPSHOT_KEY], where)
    else:
        trace = _trace_from_events(snapshot, where)
    try:
        return validate(trace)
    except UserError as exc:
        raise UserError(f"invalid snapshot {where}: {exc}") from None


# --- import: the exact columns under the "memplan" key -------------------------------------


def _trace_from_columns(doc: Any, where: str) -> Trace:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise UserError(f"{where}: its '{SNAPSHOT_KEY}' entry is not a memplan trace")
    if doc.get("version") != FORMAT_VERSION:
        raise UserError(
            f"{where} holds memplan trace version {doc.get('version')}; this memplan reads "
            f"version {FORMAT_VERSION}: export it again with this version"
        )
    tables: dict[str, dict[str, np.ndarray]] = {}
    for table, columns in _TABLES.items():
        source = doc.get(table)
        if not isinstance(source, dict):
            raise UserError(f"{where} is damaged: memplan table {table} is missing")
        tables[table] = {}
        for name, dtype in columns.items():
            values = source.get(name)
            if not isinstance(values, list):
                raise UserError(f"{where} is damaged: memplan column {table}/{name} is missing")
            try:
                tables[table][name] = np.asarray(values, dtype=dtype).reshape(len(values))
            except (ValueError, TypeError, OverflowError) as exc:
                raise UserError(f"{where} is damaged: memplan column {table}/{name}: {exc}") from None
    strings = {}
    for name in ("op_names", "modules", "devices"):
        values = doc.get(name)
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            raise UserError(f"{where} is damaged: memplan string table {name} is missing")
        strings[name] = list(values)
    meta = doc.get("meta", {})
    if not isinstance(meta, dict):
        raise UserError(f"{where} is damaged: memplan meta is not a dict")
    return Trace(
        buffers=tables["buffers"],
        events=tables["events"],
        ops=tables["ops"],
        csr=tables["csr"],
        meta=dict(meta),
        **strings,
    )


# --- import: from device_traces and segments ----------------------------------------------


def _bad(where: str, what: str) -> UserError:
    return UserError(f"{where} is not a valid memory snapshot: {what}")


def _int_field(entry: dict, key: str, where: str, what: str, default: int | None = None) -> int:
    value = entry.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise _bad(where, f"{what} has no integer '{key}'")
    return value


def _frames_of(entry: dict) -> list:
    frames = entry.get("frames")
    if not isinstance(frames, list):
        return []
    return [f for f in frames if isinstance(f, dict)]


def _site_from_frames(frames: list) -> dict[str, Any]:
    """Module, and where memplan wrote them, category/phase/iteration/micro-batch, from frames."""
    if frames and frames[-1].get("filename") == _MEMPLAN_FRAME_FILE:
        match = _MEMPLAN_FRAME_NAME.match(str(frames[-1].get("name", "")))
        if match and match.group(2) in CATEGORY and match.group(3) in PHASE:
            module = str(frames[0].get("filename", "")) if len(frames) > 1 else ""
            return {
                "module": "" if module == _NO_MODULE else module,
                "category": match.group(2),
                "phase": match.group(3),
                "iteration": int(match.group(4)),
                "microbatch": int(match.group(5)),
            }
    python = [site for site in map(_python_site, frames) if site is not None]
    user = [site for site in python if not _in_torch(site[0])]
    chosen = (user or python or [None])[0]
    if chosen is None:
        return {"module": ""}
    path, line, function = chosen
    return {"module": f"{path.split('/')[-1]}:{line}:{function}"}


def _python_site(frame: dict) -> tuple[str, Any, str] | None:
    """(path, line, function) of a Python frame, in either spelling PyTorch writes frames."""
    filename = str(frame.get("filename", "")).replace("\\", "/")
    if filename.endswith(".py"):
        return filename, frame.get("line", 0), str(frame.get("name", ""))
    # torch.cuda._memory_viz.profile_plot writes {"filename": "none", "name": "path.py(130): forward"}
    match = _PROFILER_FRAME_NAME.match(str(frame.get("name", "")))
    if match:
        return match.group(1).replace("\\", "/"), int(match.group(2)), match.group(3)
    return None


def _in_torch(path: str) -> bool:
    return path.startswith("torch/") or "/torch/" in path


def _trace_from_events(snapshot: dict, where: str) -> Trace:
    segments = snapshot["segments"]
    device_traces = snapshot.get("device_traces", [])
    if not isinstance(segments, list):
        raise _bad(where, "'segments' is not a list")
    if not isinstance(device_traces, list) or not all(isinstance(t, list) for t in device_traces):
        raise _bad(where, "'device_traces' is not a list of lists (one per device)")
    reader = _EventReader(where)
    for device, position, entry in _merged_entries(device_traces, where):
        reader.read_entry(device, position, entry)
    reader.read_segments(segments)
    return reader.trace(snapshot, len(device_traces), segments)


def _merged_entries(device_traces: list, where: str) -> list[tuple[int, int, dict]]:
    """The devices' entries as (device, position, entry) on one time axis."""
    entries = []
    for device, device_trace in enumerate(device_traces):
        for position, entry in enumerate(device_trace):
            if not isinstance(entry, dict) or not isinstance(entry.get("action"), str):
                raise _bad(where, f"device {device} trace entry {position} has no 'action'")
            entries.append((device, position, entry))
    timed = all(isinstance(e.get("time_us"), (int, float)) for _, _, e in entries)
    if timed:
        entries.sort(key=lambda item: (item[2]["time_us"], item[0], item[1]))
    return entries


class _EventReader:
    """Buffers and their alloc/free timeline, read entry by entry from a snapshot."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.buffers: list[dict[str, Any]] = []
        self.timeline: list[list[int] | None] = []  # [kind, buffer]; None where a tentative free was superseded
        self.open_at: dict[tuple[int, int], int] = {}  # (device, addr) -> buffer not yet free_completed
        self.requested_at: dict[int, int] = {}  # buffer -> timeline index of its free_requested
        self.preexisting: list[int] = []
        self.ignored: dict[str, int] = {}
        self.implicit_frees = 0

    def new_buffer(self, device: int, addr: int, nbytes: int, stream: int, entry: dict) -> int:
        site = _site_from_frames(_frames_of(entry))
        category = site.get("category") or entry.get("category")
        self.buffers.append(
            {
                "device": device,
                "addr": addr,
                "nbytes": nbytes,
                "stream": stream,
                "category": category if category in CATEGORY else "other",
                "phase": site.get("phase", "other"),
                "module": site["module"],
                "iteration": site.get("iteration", 0),
                "microbatch": site.get("microbatch", 0),
            }
        )
        return len(self.buffers) - 1

    def read_entry(self, device: int, position: int, entry: dict) -> None:
        """One `device_traces` entry: an alloc opens a buffer, a free closes it."""
        where, timeline, open_at, requested_at = self.where, self.timeline, self.open_at, self.requested_at
        action = entry["action"]
        if action not in TENSOR_ACTIONS:
            self.ignored[action] = self.ignored.get(action, 0) + 1
            return
        what = f"device {device} trace entry {position} ({action})"
        addr = _int_field(entry, "addr", where, what)
        nbytes = _int_field(entry, "size", where, what)
        stream = _int_field(entry, "stream", where, what, default=0)
        if nbytes < 0:
            raise _bad(where, f"{what} has negative size {nbytes}")
        key = (device, addr)
        current = open_at.get(key)
        if action == "alloc":
            if current is not None:
                if current not in requested_at:
                    self.implicit_frees += 1  # no free recorded before the address was reused
                    timeline.append([FREE, current])
                del open_at[key]
            buffer = self.new_buffer(device, addr, nbytes, stream, entry)
            open_at[key] = buffer
            timeline.append([ALLOC, buffer])
            return
        if current is None:  # freed, but allocated before the recording started
            current = self.new_buffer(device, addr, nbytes, stream, entry)
            self.preexisting.append(current)
            open_at[key] = current
        if action == "free_requested":
            if current not in requested_at:
                requested_at[current] = len(timeline)
                timeline.append([FREE, current])
        else:  # free_completed
            if current in requested_at:
                timeline[requested_at[current]] = None
            requested_at[current] = len(timeline)
            timeline.append([FREE, current])
            del open_at[key]

    def read_segments(self, segments: list) -> None:
        """Blocks allocated at snapshot time that no open allocation of the trace explains."""
        where = self.where
        for s, segment in enumerate(segments):
            if not isinstance(segment, dict) or not isinstance(segment.get("blocks"), list):
                raise _bad(where, f"segment {s} has no 'blocks' list")
            device = _int_field(segment, "device", where, f"segment {s}", default=0)
            stream = _int_field(segment, "stream", where, f"segment {s}", default=0)
            addr = _int_field(segment, "address", where, f"segment {s}", default=0)
            for i, block in enumerate(segment["blocks"]):
                what = f"segment {s} block {i}"
                if not isinstance(block, dict):
                    raise _bad(where, f"{what} is not a dict")
                nbytes = _int_field(block, "size", where, what)
                block_addr = _int_field(block, "address", where, what, default=addr)
                addr = block_addr + nbytes
                if block.get("state") in ACTIVE_BLOCK_STATES and (device, block_addr) not in self.open_at:
                    buffer = self.new_buffer(device, block_addr, nbytes, stream, block)
                    self.preexisting.append(buffer)
                    self.open_at[(device, block_addr)] = buffer

    def trace(self, snapshot: dict, num_device_traces: int, segments: list) -> Trace:
        """The Trace of what was read: pre-existing buffers first, ids in allocation order."""
        buffers, preexisting = self.buffers, self.preexisting
        preexisting.sort(key=lambda b: (buffers[b]["device"], buffers[b]["addr"]))
        records = [[ALLOC, b] for b in preexisting] + [r for r in self.timeline if r is not None]
        new_id: dict[int, int] = {}
        for kind, buffer in records:
            if kind == ALLOC:
                new_id[buffer] = len(new_id)
        order = sorted(new_id, key=new_id.__getitem__)
        kinds = np.array([kind for kind, _ in records], dtype=np.int8)
        event_buffers = np.array([new_id[buffer] for _, buffer in records], dtype=np.int64)
        ordered = [buffers[b] for b in order]
        meta: dict[str, Any] = {"source": "pytorch_memory_snapshot"}
        streams = _int32_streams([b["stream"] for b in ordered], meta)
        categories = [CATEGORY[b["category"]] for b in ordered]
        trace = from_events(
            kinds, [b["nbytes"] for b in ordered], event_buffers, streams=streams, categories=categories
        )
        num_devices = max(
            [num_device_traces, 1] + [b["device"] + 1 for b in ordered]
            + [int(s.get("device", 0)) + 1 for s in segments]
        )
        _set_buffer_sites(trace, ordered, num_devices)
        meta["unrecorded_allocations"] = len(preexisting)
        if self.implicit_frees:
            meta["implicit_frees"] = self.implicit_frees
        if self.ignored:
            meta["ignored_actions"] = dict(sorted(self.ignored.items()))
        settings = snapshot.get("allocator_settings")
        if isinstance(settings, dict) and settings:
            meta["allocator_settings"] = json.loads(json.dumps(settings, default=str))
        trace.meta = meta
        return trace


def _int32_streams(raw_streams: list[int], meta: dict[str, Any]) -> list[int]:
    """Streams as int32: kept when they fit, else numbered by first appearance (0 stays 0),
    the original values going to `meta["snapshot_streams"]`."""
    if all(0 <= s <= _INT32_MAX for s in raw_streams):
        return raw_streams
    numbering: dict[int, int] = {0: 0}
    for s in raw_streams:
        numbering.setdefault(s, len(numbering))
    meta["snapshot_streams"] = {str(n): s for s, n in numbering.items() if n}
    return [numbering[s] for s in raw_streams]


def _set_buffer_sites(trace: Trace, ordered: list[dict[str, Any]], num_devices: int) -> None:
    """Fill the buffers' device, module, phase, iteration and micro-batch columns."""
    modules = [""]
    module_index = {"": 0}
    for b in ordered:
        module_index.setdefault(b["module"], len(modules))
        if len(modules) < len(module_index):
            modules.append(b["module"])
    trace.buffers["device"] = np.array([b["device"] for b in ordered], dtype=np.int16)
    trace.buffers["module"] = np.array([module_index[b["module"]] for b in ordered], dtype=np.int32)
    trace.buffers["phase"] = np.array([PHASE[b["phase"]] for b in ordered], dtype=np.int8)
    trace.buffers["iteration"] = np.array([b["iteration"] for b in ordered], dtype=np.int32)
    trace.buffers["microbatch"] = np.array([b["microbatch"] for b in ordered], dtype=np.int32)
    trace.modules = modules
    trace.devices = [f"cuda:{i}" for i in range(num_devices)]


# --- export ----------------------------------------------------------------------------------


class _BestFitArena:
    """Offsets for one segment: best fit (smallest, then lowest) with coalescing, growing at the top."""

    def __init__(self) -> None:
        self.free_by_size: list[tuple[int, int]] = []  # (nbytes, offset), sorted
        self.free_start: dict[int, int] = {}  # offset -> nbytes
        self.free_end: dict[int, int] = {}  # end offset -> offset
        self.top = 0
        self.high_water = 0

    def _take(self, offset: int, nbytes: int) -> None:
        self.free_by_size.pop(bisect.bisect_left(self.free_by_size, (nbytes, offset)))
        del self.free_start[offset]
        del self.free_end[offset + nbytes]

    def _put(self, offset: int, nbytes: int) -> None:
        bisect.insort(self.free_by_size, (nbytes, offset))
        self.free_start[offset] = nbytes
        self.free_end[offset + nbytes] = offset

    def alloc(self, nbytes: int) -> int:
        i = bisect.bisect_left(self.free_by_size, (nbytes, -1))
        if i < len(self.free_by_size):
            size, offset = self.free_by_size[i]
            self._take(offset, size)
            if size > nbytes:
                self._put(offset + nbytes, size - nbytes)
            return offset
        offset = self.top
        self.top += nbytes
        self.high_water = max(self.high_water, self.top)
        return offset

    def free(self, offset: int, nbytes: int) -> None:
        following = self.free_start.get(offset + nbytes)
        if following is not None:
            self._take(offset + nbytes, following)
            nbytes += following
        previous = self.free_end.get(offset)
        if previous is not None:
            self._take(previous, offset - previous)
            nbytes += offset - previous
            offset = previous
        if offset + nbytes == self.top:
            self.top = offset
        else:
            self._put(offset, nbytes)


def _round_up(nbytes: int, align: int) -> int:
    return -(-nbytes // align) * align


def _buffer_frame(trace: Trace, buffer: int) -> dict[str, Any]:
    b = trace.buffers
    return {
        "filename": _MEMPLAN_FRAME_FILE,
        "line": buffer,
        "name": (
            f"buffer {buffer} {CATEGORIES[int(b['category'][buffer])]} "
            f"{PHASES[int(b['phase'][buffer])]} iteration {int(b['iteration'][buffer])} "
            f"microbatch {int(b['microbatch'][buffer])}"
        ),
    }


def _op_frame(trace: Trace, op: int, module: int) -> dict[str, Any]:
    return {
        "filename": trace.modules[module] or _NO_MODULE,
        "line": op,
        "name": trace.op_name(op) if op >= 0 else _NO_OP,
    }


def _snapshot_category(category: int) -> str:
    name = CATEGORIES[category]
    return "unknown" if name == "other" else name


def to_snapshot(trace: Trace) -> dict[str, Any]:
    """A snapshot dict of `trace` that memory_viz opens and `load_snapshot` reads back exactly."""
    validate(trace)
    b = trace.buffers
    nbytes = b["nbytes"].tolist()
    devices = b["device"].tolist()
    streams = b["stream"].tolist()
    modules = b["module"].tolist()
    alloc_ops = b["alloc_op"].tolist()
    slots = [_round_up(max(n, 1), BLOCK_ALIGN_BYTES) for n in nbytes]
    groups = list(zip(devices, streams))
    arenas, offsets = _best_fit_offsets(trace, groups, slots)
    segments, base_of = _synthetic_segments(arenas)
    addrs = [base_of[groups[i]] + offsets[i] for i in range(trace.num_buffers)]

    buffer_frames = [_buffer_frame(trace, i) for i in range(trace.num_buffers)]
    alloc_frames = [
        [_op_frame(trace, alloc_ops[i], modules[i]), buffer_frames[i]] for i in range(trace.num_buffers)
    ]
    _fill_final_blocks(trace, segments, groups, addrs, slots, alloc_frames)
    return {
        "segments": segments,
        "device_traces": _device_traces(trace, segments, addrs, buffer_frames, alloc_frames),
        "allocator_settings": {},
        "external_annotations": [],
        SNAPSHOT_KEY: _columns_of(trace),
    }


def _best_fit_offsets(
    trace: Trace, groups: list[tuple[int, int]], slots: list[int]
) -> tuple[dict[tuple[int, int], _BestFitArena], list[int]]:
    """Each buffer's offset in the arena of its (device, stream), replaying the events."""
    arenas: dict[tuple[int, int], _BestFitArena] = {}
    offsets = [0] * trace.num_buffers
    for kind, buffer in zip(trace.events["kind"].tolist(), trace.events["buffer"].tolist()):
        arena = arenas.setdefault(groups[buffer], _BestFitArena())
        if kind == ALLOC:
            offsets[buffer] = arena.alloc(slots[buffer])
        else:
            arena.free(offsets[buffer], slots[buffer])
    return arenas, offsets


def _synthetic_segments(
    arenas: dict[tuple[int, int], _BestFitArena],
) -> tuple[list[dict[str, Any]], dict[tuple[int, int], int]]:
    """One segment per arena, side by side from SEGMENT_BASE_ADDRESS; and each one's base."""
    base_of: dict[tuple[int, int], int] = {}
    base = SEGMENT_BASE_ADDRESS
    segments = []
    for group in sorted(arenas):
        total = _round_up(max(arenas[group].high_water, 1), SEGMENT_ALIGN_BYTES)
        base_of[group] = base
        segments.append(
            {
                "device": group[0],
                "address": base,
                "total_size": total,
                "stream": group[1],
                "segment_type": "large",
                "segment_pool_id": (0, 0),
                "is_expandable": False,
                "frames": [],
                "blocks": [],
            }
        )
        base += total
    return segments, base_of


def _fill_final_blocks(
    trace: Trace,
    segments: list[dict[str, Any]],
    groups: list[tuple[int, int]],
    addrs: list[int],
    slots: list[int],
    alloc_frames: list[list[dict[str, Any]]],
) -> None:
    """The segments' blocks at the end: the buffers live then, tiled with inactive gaps."""
    nbytes = trace.buffers["nbytes"].tolist()
    live_at_end = np.flatnonzero(trace.buffers["free_event"] < 0).tolist()
    live_at_end.sort(key=lambda i: addrs[i])
    segment_of = {(s["device"], s["stream"]): s for s in segments}
    cursor = {id(s): s["address"] for s in segments}
    for i in live_at_end:
        segment = segment_of[groups[i]]
        _append_inactive(segment, cursor[id(segment)], addrs[i])
        segment["blocks"].append(
            {
                "address": addrs[i],
                "size": slots[i],
                "requested_size": nbytes[i],
                "state": "active_allocated",
                "frames": alloc_frames[i],
            }
        )
        cursor[id(segment)] = addrs[i] + slots[i]
    for segment in segments:
        _append_inactive(segment, cursor[id(segment)], segment["address"] + segment["total_size"])
        active = [blk for blk in segment["blocks"] if blk["state"] == "active_allocated"]
        segment["allocated_size"] = sum(blk["size"] for blk in active)
        segment["active_size"] = segment["allocated_size"]
        segment["requested_size"] = sum(blk["requested_size"] for blk in active)


def _device_traces(
    trace: Trace,
    segments: list[dict[str, Any]],
    addrs: list[int],
    buffer_frames: list[dict[str, Any]],
    alloc_frames: list[list[dict[str, Any]]],
) -> list[list[dict[str, Any]]]:
    """Per device: a `segment_alloc` per segment, then an entry (or two) per event."""
    b = trace.buffers
    nbytes = b["nbytes"].tolist()
    devices = b["device"].tolist()
    streams = b["stream"].tolist()
    categories = b["category"].tolist()
    op_modules = trace.ops["module"].tolist()
    device_traces: list[list[dict[str, Any]]] = [[] for _ in trace.devices]
    for segment in segments:
        device_traces[segment["device"]].append(
            {
                "action": "segment_alloc",
                "addr": segment["address"],
                "size": segment["total_size"],
                "stream": segment["stream"],
                "frames": [],
                "time_us": 0,
                # memory_viz's page fails when entries name categories but never "unknown"
                "category": "unknown",
            }
        )
    event_ops = trace.events["op"].tolist()
    kinds = trace.events["kind"].tolist()
    event_buffers = trace.events["buffer"].tolist()
    for event, (kind, i) in enumerate(zip(kinds, event_buffers)):
        common = {
            "addr": addrs[i],
            "size": nbytes[i],
            "stream": streams[i],
            "time_us": event,
            "category": _snapshot_category(categories[i]),
        }
        if kind == ALLOC:
            device_traces[devices[i]].append({"action": "alloc", "frames": alloc_frames[i], **common})
            continue
        op = event_ops[event]
        frames = [_op_frame(trace, op, op_modules[op] if op >= 0 else 0), buffer_frames[i]]
        for action in ("free_requested", "free_completed"):
            device_traces[devices[i]].append({"action": action, "frames": frames, **common})
    return device_traces


def _append_inactive(segment: dict[str, Any], start: int, end: int) -> None:
    if end > start:
        segment["blocks"].append(
            {"address": start, "size": end - start, "requested_size": 0, "state": "inactive", "frames": []}
        )


def _columns_of(trace: Trace) -> dict[str, Any]:
    doc: dict[str, Any] = {"format": FORMAT_NAME, "version": FORMAT_VERSION}
    for table, columns in _TABLES.items():
        source = getattr(trace, table)
        doc[table] = {name: np.asarray(source[name], dtype=dtype).tolist() for name, dtype in columns.items()}
    doc["op_names"] = list(trace.op_names)
    doc["modules"] = list(trace.modules)
    doc["devices"] = list(trace.devices)
    doc["meta"] = trace.meta
    return doc


def save_snapshot(trace: Trace, path: str | os.PathLike) -> None:
    """Write `to_snapshot(trace)` to `path` as a pickle memory_viz opens (written atomically)."""
    snapshot = to_snapshot(trace)
    atomic_write(path, lambda fh: pickle.dump(snapshot, fh, protocol=PICKLE_PROTOCOL))
