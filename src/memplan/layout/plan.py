"""The plan file: planned offsets of a training step's allocations, periodic across iterations.

A plan is what STWeaver/STAlloc's runtime allocator consumes (arXiv 2507.16274; public
code infinigence/STAlloc): the n-th allocation request of an iteration is matched to
the n-th entry of that iteration's plan (its size checked) and served at the planned
offset inside one arena of `arena_bytes`; a request that does not match goes to the
dynamic reusable space, then to a fallback caching allocator.

Format (JSON, `format: "memplan-plan"`, `version: 1`):
- `trace_fingerprint`: sha256 of the request sizes, in order, of each planned group
  of the trace the plan was made from (`trace_fingerprint(trace, groups)`); a plan is
  only replayed against a trace with the same fingerprint.
- `arena_bytes` (the plan's height), `alignment_bytes`, `lower_bound_bytes` (most bytes
  live at once in the planned window).
- `iterations`: one entry per planned group, in order: `iteration` -1 is the prologue
  (buffers that exist before iteration 0, such as weights), then 0, 1, ...;
  `nbytes[i]` and `offset[i]` describe the i-th request of that group (requests are
  numbered in allocation order within their group). `offset` -1 means "not planned"
  (a dynamic request, placed in the dynamic space when it fits); -2 means "outlives its
  iteration" (a request the recording never saw freed: a kept loss, a logged metric),
  served by the fallback allocator directly, since placing it in the dynamic space
  would hold arena bytes that later iterations' planned requests need. **Periodic**: an iteration beyond the last planned one replays
  the last planned iteration's entries (`periodic_iteration`).
- `dynamic_space`: windows `[begin_request, end_request)` of request indices of an
  iteration, each with the address ranges `[lo, hi)` of the arena that no planned
  buffer uses during the whole window: where unplanned requests are placed best-fit.
- `stats`: how the plan was made (method, timings), for reports only.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from memplan.errors import UserError
from memplan.trace.io import atomic_write
from memplan.trace.model import Trace

PLAN_FORMAT = "memplan-plan"
PLAN_VERSION = 1
PROLOGUE = -1
NOT_PLANNED = -1  # offset of a dynamic request
LONG_LIVED = -2  # offset of a request that outlives its iteration: the fallback serves it


@dataclass
class IterationPlan:
    """Planned offsets of the requests of one group (prologue or one iteration)."""

    iteration: int
    nbytes: np.ndarray  # requested bytes of the i-th request
    offset: np.ndarray  # planned offset; NOT_PLANNED (-1): dynamic; LONG_LIVED (-2): fallback

    @property
    def num_requests(self) -> int:
        return int(self.nbytes.shape[0])


@dataclass
class DynamicWindow:
    """Arena ranges free of planned buffers during requests [begin_request, end_request)."""

    iteration: int
    begin_request: int
    end_request: int
    ranges: list[tuple[int, int]]


@dataclass
class AddressPlan:
    """Planned addresses (arena offsets) of a trace's requests, periodic across
    iterations: the contents of a plan file (see the module docstring)."""

    trace_fingerprint: str
    arena_bytes: int
    alignment_bytes: int
    iterations: list[IterationPlan]
    lower_bound_bytes: int = 0
    dynamic_space: list[DynamicWindow] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def groups(self) -> list[int]:
        return [it.iteration for it in self.iterations]

    @property
    def periodic_iteration(self) -> int:
        return self.iterations[-1].iteration if self.iterations else PROLOGUE

    def for_iteration(self, iteration: int) -> IterationPlan | None:
        """The entries that serve `iteration`: its own, or the periodic ones beyond the last."""
        for it in self.iterations:
            if it.iteration == iteration:
                return it
        if iteration >= 0 and self.iterations and iteration > self.periodic_iteration >= 0:
            return self.iterations[-1]
        return None

    def windows_for(self, iteration: int) -> list[DynamicWindow]:
        entry = self.for_iteration(iteration)
        if entry is None:
            return []
        return [w for w in self.dynamic_space if w.iteration == entry.iteration]

    def check_belongs_to(self, trace: Trace) -> None:
        """Raise UserError unless `trace` has the request sequence this plan was made for."""
        got = trace_fingerprint(trace, self.groups)
        if got != self.trace_fingerprint:
            raise UserError(
                f"this plan was made for another trace (fingerprint {self.trace_fingerprint[:12]}, "
                f"this trace's is {got[:12]}): make a plan for it with 'memplan plan TRACE -o plan.json'"
            )

    # -- files ------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {
            "format": PLAN_FORMAT,
            "version": PLAN_VERSION,
            "trace_fingerprint": self.trace_fingerprint,
            "arena_bytes": int(self.arena_bytes),
            "alignment_bytes": int(self.alignment_bytes),
            "lower_bound_bytes": int(self.lower_bound_bytes),
            "periodic_iteration": self.periodic_iteration,
            "iterations": [
                {"iteration": it.iteration, "nbytes": it.nbytes.tolist(), "offset": it.offset.tolist()}
                for it in self.iterations
            ],
            "dynamic_space": [
                {
                    "iteration": w.iteration,
                    "begin_request": w.begin_request,
                    "end_request": w.end_request,
                    "ranges": [list(r) for r in w.ranges],
                }
                for w in self.dynamic_space
            ],
            "stats": self.stats,
        }

    @classmethod
    def from_json(cls, doc: Any, source: str = "plan") -> AddressPlan:
        if not isinstance(doc, dict) or doc.get("format") != PLAN_FORMAT:
            raise UserError(f"{source} is not a memplan plan (no format {PLAN_FORMAT!r}); make one with 'memplan plan'")
        if doc.get("version") != PLAN_VERSION:
            raise UserError(f"{source} is plan version {doc.get('version')}; this memplan reads version {PLAN_VERSION}")
        try:
            iterations = []
            for entry in doc["iterations"]:
                nbytes = np.asarray(entry["nbytes"], dtype=np.int64)
                offset = np.asarray(entry["offset"], dtype=np.int64)
                if nbytes.shape != offset.shape or nbytes.ndim != 1:
                    raise ValueError(f"iteration {entry['iteration']}: nbytes and offset differ in length")
                iterations.append(IterationPlan(int(entry["iteration"]), nbytes, offset))
            windows = [
                DynamicWindow(
                    int(w["iteration"]),
                    int(w["begin_request"]),
                    int(w["end_request"]),
                    [(int(lo), int(hi)) for lo, hi in w["ranges"]],
                )
                for w in doc.get("dynamic_space", [])
            ]
            plan = cls(
                trace_fingerprint=str(doc["trace_fingerprint"]),
                arena_bytes=int(doc["arena_bytes"]),
                alignment_bytes=int(doc["alignment_bytes"]),
                iterations=iterations,
                lower_bound_bytes=int(doc.get("lower_bound_bytes", 0)),
                dynamic_space=windows,
                stats=dict(doc.get("stats", {})),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise UserError(f"{source} is a damaged plan: {exc}") from None
        for it in plan.iterations:
            bad = np.flatnonzero((it.offset >= 0) & (it.offset + it.nbytes > plan.arena_bytes))
            if bad.size:
                raise UserError(
                    f"{source} is a damaged plan: iteration {it.iteration} request {int(bad[0])} "
                    f"lies outside the {plan.arena_bytes}-byte arena"
                )
        return plan


def save_address_plan(plan: AddressPlan, path: str | os.PathLike) -> None:
    """Write `plan` as JSON, atomically."""
    text = json.dumps(plan.to_json(), separators=(",", ":"))
    atomic_write(path, lambda fh: fh.write(text), mode="w")


def load_address_plan(path: str | os.PathLike) -> AddressPlan:
    """Read a plan file; UserError if it is missing or not a plan."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"plan file {path} does not exist; make one with 'memplan plan TRACE -o {path}'")
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"cannot read plan {path}: {exc}") from None
    return AddressPlan.from_json(doc, source=str(path))


# -- which requests a plan covers ------------------------------------------------------
def requests_by_group(trace: Trace) -> dict[int, np.ndarray]:
    """Buffer ids of each group's requests in allocation order; group -1 is the prologue."""
    iteration = trace.buffers["iteration"].astype(np.int64)
    group = np.where(iteration < 0, PROLOGUE, iteration)
    order = np.lexsort((trace.buffers["alloc_event"], group))
    groups = group[order]
    out: dict[int, np.ndarray] = {}
    bounds = np.flatnonzero(np.diff(groups)) + 1
    for chunk in np.split(order, bounds):
        if chunk.shape[0]:
            out[int(group[chunk[0]])] = chunk
    return out


def trace_fingerprint(trace: Trace, groups: list[int]) -> str:
    """sha256 over each listed group's request sizes in allocation order."""
    by_group = requests_by_group(trace)
    digest = hashlib.sha256()
    for g in groups:
        ids = by_group.get(g, np.zeros(0, np.int64))
        digest.update(f"group {g} n {ids.shape[0]};".encode())
        digest.update(np.ascontiguousarray(trace.buffers["nbytes"][ids], dtype="<i8").tobytes())
    return digest.hexdigest()
