"""`compare(measured, estimated)`: a measured step beside an estimate of it.

Either side is read from a file memplan or PyTorch writes (`load_side`): a `.memtrace`, a
PyTorch memory snapshot pickle, or the JSON of an estimate (`memplan estimate --json`, or
the `estimate.json` `memplan.watch` writes). Each side is summarised as the estimate
reports a step (`Side`): peak allocated, peak reserved, device used, the breakdown by
category at the allocated peak and the phase of that peak, and the buffers live at the
peak where the side is a trace (or an estimate JSON that lists them).

How a trace's figures are read:
- a step `memplan.watch` measured on CUDA carries `torch.cuda.memory_stats()` (peak
  allocated and reserved) and device used (`torch.cuda.mem_get_info`) in its metadata:
  those are the figures; the breakdown and phase come from the trace's buffers;
- a CUDA trace without them (a plain PyTorch snapshot, or a memplan capture) is replayed
  through the caching allocator simulator for allocated and reserved; device used is not
  known (no context is assumed);
- a cpu trace: the live tensor bytes (no caching allocator on the host), allocated =
  reserved; device used is not defined.

The comparison gives each figure on both sides with the difference (estimate − measured,
in bytes and relative to the measured figure), the same per category at the peak, both
phases, and the largest buffers live at one side's peak that the other side's peak lacks
(matched by category and size where both sides have categories, by size alone otherwise,
sizes rounded to the caching allocator's 512-byte blocks where a side is a snapshot).
Refused in one line: sides of different models (their parameter counts or memplan's model
fingerprints differ), and sides made with different PyTorch versions where both say.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from memplan.alloc.conf import AllocConf
from memplan.errors import UserError
from memplan.estimation.pipeline import BREAKDOWN_KEYS, figures_full, replay_counters
from memplan.trace.io import file_kind, load
from memplan.trace.model import CATEGORIES, PHASES, Trace

COMPARE_FORMAT = "memplan-compare"
FIGURES = ("peak_allocated_bytes", "peak_reserved_bytes", "device_used_bytes")


@dataclass
class Side:
    """One side of a comparison, as the estimate reports a step."""

    label: str
    source: str  # memtrace, snapshot or estimate-json
    device: str
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    device_used_bytes: int | None
    breakdown: dict[str, int]
    peak_phase: str
    buffers: list[dict[str, Any]] | None = None  # live at the peak, largest first
    model: dict[str, Any] = field(default_factory=dict)
    torch_version: str | None = None
    notes: list[str] = field(default_factory=list)


def buffers_at_peak(trace: Trace, top: int = 50) -> list[dict[str, Any]]:
    """The largest buffers live at the trace's peak: size, category, phase, and a name (the
    capture's key for states and gradients where it has one, else module and op)."""
    _, event = trace.peak()
    if event < 0:
        return []
    live = np.flatnonzero(trace.live_at(event))
    live = live[np.argsort(-trace.buffers["nbytes"][live], kind="stable")][:top]
    names = trace.meta.get("tensor_names") or {}
    out = []
    for b in live.tolist():
        op = int(trace.buffers["alloc_op"][b])
        parts = (trace.module_of_buffer(b), trace.op_name(op) if op >= 0 else "")
        label = names.get(str(b)) or " ".join(x for x in parts if x)
        out.append({"nbytes": int(trace.buffers["nbytes"][b]),
                    "category": CATEGORIES[int(trace.buffers["category"][b])],
                    "phase": PHASES[int(trace.buffers["phase"][b])], "name": label or f"buffer {b}"})
    return out


def trace_device(trace: Trace) -> str:
    """"cuda" or "cpu": the device the trace's step ran on (or was captured for)."""
    device = trace.meta.get("device")
    if device in ("cuda", "cpu"):
        return device
    return "cuda" if any(d.startswith("cuda") for d in trace.devices) else "cpu"


def side_of_trace(trace: Trace, label: str, source: str) -> Side:
    """A trace's figures (module docstring)."""
    device = trace_device(trace)
    meta = trace.meta
    stats = meta.get("cuda_memory_stats") if device == "cuda" else None
    counters = replay_counters(trace, "caching" if device == "cuda" and stats is None else "none", None)
    fig = figures_full(trace, counters)
    allocated, reserved, used = fig.peak_allocated_bytes, fig.peak_reserved_bytes, None
    notes = []
    if stats is not None:
        allocated = int(stats["allocated_bytes.all.peak"])
        reserved = int(stats["reserved_bytes.all.peak"])
        used = meta.get("device_used_peak_bytes")
    elif device == "cuda":
        notes.append("reserved replayed through the caching allocator simulator; device used unknown")
    else:
        notes.append("cpu: no caching allocator, reserved = allocated; device used is not defined")
    return Side(label, source, device, allocated, reserved, used, fig.breakdown, fig.peak_phase,
                buffers_at_peak(trace), dict(meta.get("watched_model") or _model_of_meta(meta)),
                meta.get("torch_version"), notes)


def _model_of_meta(meta: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if meta.get("model"):
        out["name"] = str(meta["model"])
    if meta.get("parameters"):
        out["parameters"] = int(meta["parameters"])
    return out


def side_of_estimate(doc: dict[str, Any], label: str) -> Side:
    """An estimate JSON's figures (its rank 0; the watch's estimate has one rank)."""
    try:
        rank = doc["per_rank"][0]
        breakdown = {k: int(rank["breakdown"].get(k, 0)) for k in BREAKDOWN_KEYS}
        side = Side(label, "estimate-json", str(doc.get("device", "cuda")), int(rank["peak_allocated_bytes"]),
                    int(rank["peak_reserved_bytes"]), rank.get("device_used_bytes"), breakdown,
                    str(rank.get("peak_phase", "")), doc.get("buffers_at_peak"),
                    dict(doc.get("watched_model") or {"name": doc.get("model"), "parameters": doc.get("parameters")}),
                    doc.get("torch_version"))
    except (KeyError, IndexError, TypeError, AttributeError, ValueError) as exc:
        raise UserError(f"{label} is not the --json output of memplan estimate (missing {exc})") from None
    if side.device == "cpu":
        side.device_used_bytes = None
    if side.buffers is None:
        side.notes.append("an estimate JSON lists no buffers: compare with the estimate's trace to see them")
    return side


def load_side(path: str | os.PathLike) -> Side:
    """A side from a file: `.memtrace`, PyTorch snapshot pickle, or estimate JSON."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{p} does not exist")
    kind = file_kind(p)
    if kind is not None:
        return side_of_trace(load(p), p.name, kind)
    try:
        doc = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UserError(f"{p} is neither a trace (.memtrace, PyTorch snapshot pickle) nor estimate JSON") from None
    if not isinstance(doc, dict) or "per_rank" not in doc:
        raise UserError(f"{p} is JSON but not the --json output of memplan estimate")
    return side_of_estimate(doc, p.name)


def check_same_job(measured: Side, estimated: Side) -> None:
    """UserError when the two sides are of different models or PyTorch versions."""
    a, b = measured.model, estimated.model
    fa, fb = a.get("fingerprint"), b.get("fingerprint")
    pa, pb = a.get("parameters"), b.get("parameters")
    if (fa and fb and fa != fb) or (pa and pb and int(pa) != int(pb)):
        raise UserError(f"{measured.label} records {a.get('name', 'a model')} ({pa or '?'} parameters) and "
                        f"{estimated.label} estimates {b.get('name', 'another')} ({pb or '?'} parameters): "
                        "compare a step with an estimate of the same model")
    va, vb = _major_minor(measured.torch_version), _major_minor(estimated.torch_version)
    if va and vb and va != vb:
        raise UserError(f"{measured.label} was made with PyTorch {measured.torch_version} and {estimated.label} "
                        f"with {estimated.torch_version}: estimate again with the measured job's PyTorch")
    if measured.device != estimated.device:
        raise UserError(f"{measured.label} is a {measured.device} step and {estimated.label} a {estimated.device} "
                        "estimate: compare a step with an estimate for its own device")


def _major_minor(version: str | None) -> str | None:
    return ".".join(version.split("+")[0].split(".")[:2]) if version else None


def _difference(measured: int | None, estimated: int | None) -> dict[str, Any]:
    out: dict[str, Any] = {"measured": measured, "estimated": estimated, "difference_bytes": None,
                           "difference": None}
    if measured is not None and estimated is not None:
        out["difference_bytes"] = int(estimated) - int(measured)
        out["difference"] = (int(estimated) - int(measured)) / measured if measured else (0.0 if not estimated
                                                                                          else None)
    return out


def _unmatched(ours: list[dict], theirs: list[dict], by_category: bool, round_to: int | None,
               top: int) -> list[dict]:
    """`ours` minus `theirs` as multisets of (category, size) keys, largest first."""
    def key(b: dict) -> tuple:
        size = AllocConf.parse(None).round_size(b["nbytes"]) if round_to else b["nbytes"]
        return (b["category"], size) if by_category else (size,)

    left = Counter(key(b) for b in theirs)
    out = []
    for b in ours:
        k = key(b)
        if left[k]:
            left[k] -= 1
        else:
            out.append(b)
    return out[:top]


def compare(measured: Side, estimated: Side, top: int = 5) -> dict[str, Any]:
    """The comparison as one JSON-able dict (module docstring)."""
    check_same_job(measured, estimated)
    figures = {name: _difference(getattr(measured, name), getattr(estimated, name)) for name in FIGURES}
    breakdown = {k: _difference(measured.breakdown.get(k, 0), estimated.breakdown.get(k, 0)) for k in BREAKDOWN_KEYS}
    doc: dict[str, Any] = {
        "format": COMPARE_FORMAT,
        "measured": {k: v for k, v in asdict(measured).items() if k != "buffers"},
        "estimated": {k: v for k, v in asdict(estimated).items() if k != "buffers"},
        "figures": figures,
        "breakdown": breakdown,
        "peak_phase": {"measured": measured.peak_phase, "estimated": estimated.peak_phase},
        "only_measured": None,
        "only_estimated": None,
    }
    if measured.buffers is not None and estimated.buffers is not None:
        with_categories = all(b["category"] != "other" for b in measured.buffers + estimated.buffers) or (
            measured.source != "snapshot" and estimated.source != "snapshot")
        round_to = 512 if "snapshot" in (measured.source, estimated.source) else None
        doc["only_measured"] = _unmatched(measured.buffers, estimated.buffers, with_categories, round_to, top)
        doc["only_estimated"] = _unmatched(estimated.buffers, measured.buffers, with_categories, round_to, top)
    return doc


def compare_files(measured: str | os.PathLike, estimated: str | os.PathLike, top: int = 5) -> dict[str, Any]:
    """`compare` of two files (`load_side`); the measured side must be a trace."""
    side = load_side(measured)
    if side.source == "estimate-json":
        raise UserError(f"{Path(measured).name} is an estimate: the first file is the measured step "
                        "(a .memtrace or a PyTorch snapshot pickle)")
    return compare(side, load_side(estimated), top)
