"""`max_shape(model, gpu, setup, layout, target)`: the largest sequence length or micro-batch
that fits, by bisection over traced estimates.

A shape fits when its traced estimate (`memplan.estimation.search`, the figures `memplan
estimate` prints) uses at most capacity x (1 - margin) of device memory. The search keeps a
bracket: the largest shape known to fit and the smallest known not to. Each round proposes
the next probes from the estimates so far: device memory is close to linear in the
micro-batch (activations, logits and their gradients scale with it) and in the sequence
length with SDPA / flash attention, plus a quadratic term with eager attention (its
[B, H, S, S] scores), so a line through the two probes nearest the boundary (a parabola
through three with eager attention) predicts where the capacity is crossed. The round
probes the predicted shape and one step above it (on as many workers as there are; the pair
straddles the boundary when the prediction is right), and the bracket's midpoint when the
previous round did not halve it, so the search never takes more rounds than plain
bisection and usually one or two. The answer is always a shape whose own estimate fits,
next to a shape one step larger whose estimate does not (or the model's maximum
positions, or `MAX_BATCH`).

Each probe is one `estimate` at a new shape, under the search's one allocator: the step
traced at 4 blocks and unrolled (`memplan.estimation.unroll`), not at full depth; a shape
is estimated once (the probes are kept by value). The search stops after `MAX_PROBES`
estimates (bounded by work, not by the clock).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from memplan.errors import UserError
from memplan.estimation.figures import DEFAULT_MARGIN
from memplan.estimation.fit import model_name
from memplan.estimation.search import Candidate, Evaluator, FitJob, Row, Task, refusal
from memplan.models.build import max_positions, sequence_length
from memplan.models.registry import FactorySpec, load_config
from memplan.models.setup import TrainingSetup
from memplan.parallel.layout import Layout

TARGETS = ("seq", "batch")
DEFAULT_STEP = {"seq": 128, "batch": 1}
MAX_BATCH = 1 << 16
MAX_SEQ = 1 << 20  # for models without a position limit
MAX_PROBES = 32  # the search's bound, in estimates: bisection of 1 << 20 sequences takes 20 rounds


@dataclass
class MaxResult:
    """The largest `target` that fits, the estimates at it and one step above, and every probe."""

    model: str
    gpu: str
    target: str
    step: int
    value: int | None  # None: not even the smallest shape fits
    limit: str  # what stopped the search: memory, positions (the model's maximum), cap, or budget (MAX_PROBES)
    at: Row | None
    above: Row | None
    probes: list[Row] = field(default_factory=list)
    estimates: int = 0
    spent: dict[str, Any] = field(default_factory=dict)  # `Evaluator.spent`

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "gpu": self.gpu, "target": self.target, "step": self.step, "max": self.value,
                "limit": self.limit, "at": self.at.to_json() if self.at is not None else None,
                "above": self.above.to_json() if self.above is not None else None,
                "probes": [{"value": shape_of(r, self.target), "device_used_bytes": r.device_used_bytes,
                            "usable_bytes": r.usable_bytes, "fits": r.fits} for r in self.probes],
                "estimates": self.estimates, "search": self.spent}


def shape_of(row: Row, target: str) -> int:
    setup = row.candidate.setup
    return int(setup.seq) if target == "seq" else setup.batch


@dataclass
class _Bracket:
    """The probes so far, by value, and the bracket they make."""

    target: str
    step: int
    upper: int
    rows: dict[int, Row] = field(default_factory=dict)

    @property
    def lo(self) -> int | None:
        fit = [v for v, r in self.rows.items() if r.fits]
        return max(fit) if fit else None

    @property
    def hi(self) -> int | None:
        lo = self.lo
        fail = [v for v, r in self.rows.items() if not r.fits and (lo is None or v > lo)]
        return min(fail) if fail else None

    def done(self) -> bool:
        lo, hi = self.lo, self.hi
        if lo is not None and (lo >= self.upper or (hi is not None and self._next_up(lo) >= hi)):
            return True
        return lo is None and hi is not None and hi <= self.step

    def _next_up(self, value: int) -> int:
        return min(self.upper, (value // self.step + 1) * self.step)

    def snap(self, value: float) -> int:
        """`value` rounded down to a multiple of the step, within [step, upper]."""
        return int(min(self.upper, max(self.step, int(value) // self.step * self.step)))

    def proposal(self, usable_bytes: int, eager: bool) -> int | None:
        """Where the line (or parabola) through the probes nearest the boundary crosses the
        usable capacity (None: fewer than two probes)."""
        points = sorted((v, r.device_used_bytes) for v, r in self.rows.items() if r.refused is None)
        if len(points) < 2:
            return None
        lo, hi = self.lo, self.hi
        centre = lo if lo is not None else hi
        near = sorted(points, key=lambda p: abs(p[0] - centre))[: 3 if eager else 2]
        xs, ys = np.array([p[0] for p in near], float), np.array([p[1] for p in near], float)
        coeffs = np.polyfit(xs, ys, len(near) - 1)
        roots = [r.real for r in np.roots(coeffs - np.eye(1, len(coeffs), len(coeffs) - 1)[0] * usable_bytes)
                 if abs(r.imag) < 1e-9 and r.real > 0]
        return self.snap(min(roots, key=lambda r: abs(r - centre))) if roots else None

    def probes(self, usable_bytes: int, eager: bool, workers: int, halved: bool) -> list[int]:
        """The next round's values, strictly inside the bracket (module docstring)."""
        lo, hi = self.lo, self.hi
        low = lo if lo is not None else 0
        high = hi if hi is not None else self.upper + 1
        guess = self.proposal(usable_bytes, eager)
        if guess is None:
            guess = self.snap(2 * lo) if lo is not None else self.snap(hi / 2)
        picks = [guess, self._next_up(guess)]
        if not halved and lo is not None and hi is not None:
            picks.insert(1, self.snap((lo + hi) / 2))
        if hi is None and lo is not None:
            picks.append(self.snap(4 * lo))
        if lo is None:
            picks.insert(1, self.step)  # if the smallest shape does not fit either, that is the answer
        inside = [v for v in dict.fromkeys(picks) if low < v < high and v not in self.rows]
        if not inside:  # the guesses fell outside: bisect
            mid = self.snap((low + high) / 2) if hi is not None else self.upper
            inside = [v for v in (mid, self._next_up(low)) if low < v < high and v not in self.rows][:1]
        return inside[: max(1, workers)]


def max_shape(model: str | Any, gpu: str, setup: TrainingSetup | None = None, layout: Layout | None = None,
              target: str = "seq", *, step: int | None = None, margin: float = DEFAULT_MARGIN,
              capacity: int | None = None, workers: int | None = None, progress: bool = True,
              allocator: str = "caching") -> MaxResult:
    """The largest `target` ("seq" or "batch") of `setup` under `layout` that fits on `gpu`
    with `allocator` (module docstring)."""
    if target not in TARGETS:
        raise UserError(f"unknown --max target {target!r}: choose seq or batch")
    step = DEFAULT_STEP[target] if step is None else step
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise UserError(f"--step must be a whole number >= 1, not {step!r}")
    setup = setup if setup is not None else TrainingSetup()
    layout = layout if layout is not None else Layout()
    config = load_config(model) if isinstance(model, str) else model
    job = FitJob(model, gpu, capacity, margin, allocator)
    why = refusal(config, Candidate(setup, layout))
    if why is not None:
        raise UserError(why)
    upper = _upper(config, target)
    bracket = _Bracket(target, min(step, upper), upper)
    start = sequence_length(setup, config) if target == "seq" else setup.batch
    eager = target == "seq" and setup.attn == "eager"
    with Evaluator(job, workers, progress) as ev:
        ev.stage(f"the largest {target}", MAX_PROBES)
        values = [bracket.snap(start)]
        while True:
            width = _width(bracket)
            values = values[: max(0, MAX_PROBES - ev.estimates)]
            for row in ev.run([Task([_at(setup, layout, target, v)], [True]) for v in values]):
                bracket.rows[shape_of(row[0], target)] = row[0]
            if bracket.done() or ev.estimates >= MAX_PROBES:
                break
            usable = next(iter(bracket.rows.values())).usable_bytes
            values = bracket.probes(usable, eager, ev.workers, halved=_width(bracket) <= width / 2)
        estimates, spent = ev.estimates, ev.spent()
    result = _result(model_name(model), gpu, bracket, estimates)
    result.spent = spent
    return result


def _upper(config: Any, target: str) -> int:
    if target == "batch":
        return MAX_BATCH
    limit = max_positions(config) if not isinstance(config, FactorySpec) else None
    return int(limit) if limit is not None else MAX_SEQ


def _width(bracket: _Bracket) -> float:
    lo, hi = bracket.lo, bracket.hi
    return float((hi if hi is not None else bracket.upper + 1) - (lo if lo is not None else 0))


def _at(setup: TrainingSetup, layout: Layout, target: str, value: int) -> Candidate:
    changed = replace(setup, seq=value) if target == "seq" else replace(setup, batch=value)
    return Candidate(changed, layout, (f"{target} {value}",))


def _result(name: str, gpu: str, bracket: _Bracket, estimates: int) -> MaxResult:
    lo, hi = bracket.lo, bracket.hi
    probes = [bracket.rows[v] for v in sorted(bracket.rows)]
    refused = next((r.refused for r in probes if r.refused is not None), None)
    if refused is not None and lo is None:
        raise UserError(refused)
    if not bracket.done():
        limit = "budget"  # MAX_PROBES estimates made before the bracket closed
    else:
        limit = "memory" if lo is None or lo < bracket.upper else "positions" if bracket.target == "seq" else "cap"
    return MaxResult(name, gpu, bracket.target, bracket.step, lo, limit,
                     bracket.rows.get(lo) if lo is not None else None,
                     bracket.rows.get(hi) if hi is not None else None, probes, estimates)
