"""Reading a trace from whichever file holds it: a `.memtrace` or a PyTorch snapshot pickle."""

from __future__ import annotations

import os
from pathlib import Path

from memplan.errors import UserError
from memplan.trace.memtrace import atomic_write, load_memtrace, save, save_json, to_json
from memplan.trace.model import Trace
from memplan.trace.snapshot import load_snapshot

__all__ = ["atomic_write", "file_kind", "load", "load_memtrace", "save", "save_json", "to_json"]

MEMTRACE_MAGIC = b"PK"  # .memtrace files are numpy .npz archives, i.e. zip files
PICKLE_MAGIC = b"\x80"  # the PROTO opcode that starts every pickle of protocol 2 or later


def file_kind(path: Path) -> str | None:
    """"memtrace" or "snapshot" by the first bytes of the file at `path`, else None."""
    with open(path, "rb") as fh:
        head = fh.read(2)
    if head == MEMTRACE_MAGIC:
        return "memtrace"
    return "snapshot" if head[:1] == PICKLE_MAGIC else None


def load(path: str | os.PathLike) -> Trace:
    """A trace from `path`: a `.memtrace` file (a zip archive), or a PyTorch CUDA memory
    snapshot pickle (what `torch.cuda.memory._dump_snapshot` writes)."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"trace file {p} does not exist")
    kind = file_kind(p)
    if kind == "memtrace":
        return load_memtrace(p)
    if kind == "snapshot":
        return load_snapshot(p)
    try:
        return load_snapshot(p)
    except UserError as exc:
        raise UserError(
            f"cannot read trace {p}: it is neither a .memtrace file (a zip archive) nor a "
            f"PyTorch memory snapshot ({exc})"
        ) from None
