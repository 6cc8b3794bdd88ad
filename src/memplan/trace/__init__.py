"""The lifetime trace: data model, validation, files, importers and exporters."""

from memplan.trace.io import load, load_memtrace, save, save_json, to_json
from memplan.trace.model import (
    ALLOC,
    CATEGORIES,
    CATEGORY,
    FREE,
    PHASE,
    PHASES,
    Trace,
    from_events,
)
from memplan.trace.snapshot import load_snapshot, save_snapshot, to_snapshot
from memplan.trace.validate import TraceError, validate

__all__ = [
    "ALLOC",
    "CATEGORIES",
    "CATEGORY",
    "FREE",
    "PHASE",
    "PHASES",
    "Trace",
    "TraceError",
    "from_events",
    "load",
    "load_memtrace",
    "load_snapshot",
    "save",
    "save_json",
    "save_snapshot",
    "to_json",
    "to_snapshot",
    "validate",
]
