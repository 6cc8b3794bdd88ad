"""Reading a trace from whichever file holds it: a `.memtrace` or a PyTorch snapshot pickle."""

from __future__ import annotations

import os
from pathlib import Path

from memplan.errors import UserError
from memplan.trace.memtrace import atomic_write, load_memtrace, save, save_json, to_json
from memplan.trace.model import Trace
from memplan.trace.snapshot import load_snapshot

__all__ = ["atomic_write", "load", "load_memtrace", "save", "save_json", "to_json"]


def load(path: str | os.PathLike) -> Trace:
    """A trace from `path`: a `.memtrace` file (a zip archive), or a PyTorch CUDA memory
    snapshot pickle (what `torch.cuda.memory._dump_snapshot` writes)."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"trace file {p} does not exist")
    with open(p, "rb") as fh:
        head = fh.read(2)
    if head == b"PK":  # .memtrace files are numpy .npz archives, i.e. zip files
        return load_memtrace(p)
    if head[:1] == b"\x80":  # a pickle of protocol 2 or later, as snapshots are written
        return load_snapshot(p)
    try:
        return load_snapshot(p)
    except UserError as exc:
        raise UserError(
            f"cannot read trace {p}: it is neither a .memtrace file (a zip archive) nor a "
            f"PyTorch memory snapshot ({exc})"
        ) from None
