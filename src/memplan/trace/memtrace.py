"""The `.memtrace` file format, and JSON export for small traces.

A `.memtrace` file is a numpy `.npz` archive (a zip): one array per column, under
`buffers/…`, `events/…`, `ops/…` and `csr/…`, plus `header`, a UTF-8 JSON document
with the format name, its version, the string tables and free-form metadata. Files
are written to a temporary name and renamed, so a failed write never leaves a
half-written trace behind.
"""

from __future__ import annotations

import json
import os
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from memplan.errors import UserError
from memplan.trace.model import (
    BUFFER_COLUMNS,
    CATEGORIES,
    CSR_COLUMNS,
    EVENT_COLUMNS,
    EVENT_KINDS,
    OP_COLUMNS,
    PHASES,
    Trace,
)
from memplan.trace.validate import validate

FORMAT_NAME = "memplan-trace"
FORMAT_VERSION = 1

_TABLES = {"buffers": BUFFER_COLUMNS, "events": EVENT_COLUMNS, "ops": OP_COLUMNS, "csr": CSR_COLUMNS}


def atomic_write(path: str | os.PathLike, write: Any, mode: str = "wb") -> None:
    """Call `write(fileobj)` on a temporary file next to `path`, then rename it into place."""
    path = Path(path)
    if path.parent and not path.parent.exists():
        raise UserError(f"cannot write {path}: directory {path.parent} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent or ".")
    try:
        with os.fdopen(fd, mode) as fh:
            write(fh)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def save(trace: Trace, path: str | os.PathLike) -> None:
    """Write `trace` to `path` in the versioned `.memtrace` format."""
    validate(trace)
    header = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "categories": list(CATEGORIES),
        "phases": list(PHASES),
        "op_names": trace.op_names,
        "modules": trace.modules,
        "devices": trace.devices,
        "meta": trace.meta,
    }
    arrays = {"header": np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)}
    for table, columns in _TABLES.items():
        source = getattr(trace, table)
        for name, dtype in columns.items():
            arrays[f"{table}/{name}"] = np.ascontiguousarray(source[name], dtype=dtype)
    atomic_write(path, lambda fh: np.savez_compressed(fh, **arrays))


def load_memtrace(path: str | os.PathLike) -> Trace:
    """Read a `.memtrace` file; raise UserError if it is missing, not a trace, or inconsistent."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"trace file {path} does not exist")
    try:
        with np.load(path, allow_pickle=False) as archive:
            if "header" not in archive.files:
                raise UserError(f"{path} is not a memplan trace (no header); make one with 'memplan trace'")
            header = json.loads(archive["header"].tobytes().decode())
            if header.get("format") != FORMAT_NAME:
                raise UserError(f"{path} is not a memplan trace (format {header.get('format')!r})")
            if header.get("version") != FORMAT_VERSION:
                raise UserError(
                    f"{path} is trace format version {header.get('version')}; this memplan reads "
                    f"version {FORMAT_VERSION}: re-capture it with this version"
                )
            tables: dict[str, dict[str, np.ndarray]] = {}
            for table, columns in _TABLES.items():
                tables[table] = {}
                for name, dtype in columns.items():
                    key = f"{table}/{name}"
                    if key not in archive.files:
                        raise UserError(f"{path} is damaged: column {key} is missing")
                    tables[table][name] = archive[key].astype(dtype, copy=False)
    except (zipfile.BadZipFile, ValueError, OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read trace {path}: {exc}") from None
    trace = Trace(
        buffers=tables["buffers"],
        events=tables["events"],
        ops=tables["ops"],
        csr=tables["csr"],
        op_names=list(header["op_names"]),
        modules=list(header["modules"]),
        devices=list(header["devices"]),
        meta=dict(header.get("meta", {})),
    )
    try:
        return validate(trace)
    except UserError as exc:
        raise UserError(f"invalid trace {path}: {exc}") from None


def to_json(trace: Trace) -> dict[str, Any]:
    """A readable JSON document of the whole trace (use for small traces only)."""
    b = trace.buffers
    buffers = []
    for i in range(trace.num_buffers):
        op = int(b["alloc_op"][i])
        buffers.append(
            {
                "id": i,
                "nbytes": int(b["nbytes"][i]),
                "alloc_event": int(b["alloc_event"][i]),
                "free_event": None if b["free_event"][i] < 0 else int(b["free_event"][i]),
                "category": CATEGORIES[int(b["category"][i])],
                "device": trace.devices[int(b["device"][i])],
                "stream": int(b["stream"][i]),
                "alloc_op": None if op < 0 else op,
                "module": trace.modules[int(b["module"][i])],
                "phase": PHASES[int(b["phase"][i])],
                "iteration": int(b["iteration"][i]),
                "microbatch": int(b["microbatch"][i]),
            }
        )
    ops = []
    for i in range(trace.num_ops):
        flops = float(trace.ops["flops"][i])
        moved = float(trace.ops["bytes_moved"][i])
        ops.append(
            {
                "index": i,
                "name": trace.op_name(i),
                "module": trace.modules[int(trace.ops["module"][i])],
                "phase": PHASES[int(trace.ops["phase"][i])],
                "iteration": int(trace.ops["iteration"][i]),
                "microbatch": int(trace.ops["microbatch"][i]),
                "first_event": int(trace.ops["first_event"][i]),
                "inputs": trace.op_inputs(i).tolist(),
                "outputs": trace.op_outputs(i).tolist(),
                "flops": None if np.isnan(flops) else flops,
                "bytes_moved": None if np.isnan(moved) else moved,
            }
        )
    events = [
        {"kind": EVENT_KINDS[int(k)], "buffer": int(buf), "op": None if op < 0 else int(op)}
        for k, buf, op in zip(trace.events["kind"], trace.events["buffer"], trace.events["op"])
    ]
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "meta": trace.meta,
        "buffers": buffers,
        "ops": ops,
        "events": events,
    }


def save_json(trace: Trace, path: str | os.PathLike) -> None:
    """Write `to_json(trace)` to `path`."""
    doc = json.dumps(to_json(validate(trace)), indent=1)
    atomic_write(path, lambda fh: fh.write(doc), mode="w")
