"""`what_fits(model, gpu, setup, layout)`: for a job that does not fit, the smallest sets of
changes to the user's own setup and layout that make it fit, fastest first.

A change is a delta on (`TrainingSetup`, `Layout`): activation checkpointing (full,
attention-only selective, torchtitan's op-level selective), the micro-batch halved (or
quartered ...) with gradient accumulation multiplied to keep the global batch, ZeRO stage
1/2/3, a TP or PP degree (PP takes the step's micro-batches from gradient accumulation),
more GPUs (gradient accumulation divided where it divides, so the global batch stays), and
the memory techniques of `TrainingSetup`: a chunked loss, bitsandbytes' 8-bit AdamW, the
optimizer step in backward, the optimizer on the host, activation offloading, and, only
with `allow_quant` (it changes the model), a 4- or 8-bit base under LoRA. Changes of one
group exclude each other. Every candidate is estimated only by `memplan.estimation.estimate`
(through `memplan.estimation.search`: screened, then traced before it is shown); one that
`estimate` would refuse (a layout the model cannot take) is skipped and counted by reason.

The search is breadth-first over the number of changes: every single change, then pairs of
changes that did not fit alone, then triples, ... A set is kept only if no smaller set
inside it fits (the answer is the smallest change, not the largest). Within a level, sets
are estimated cheapest first: a set that changes the setup at most once replays a trace
already captured for a single change, a set changing the setup twice needs a new trace,
and among those the ones whose single changes saved the most memory together come first.
The search stops after the first level where a set fits (at most `top` of its sets
are traced and shown), or after `max_nodes` candidates were estimated; rows are ordered by the number of
changes, then by the traced seconds per token (the roofline step time of
`memplan.estimation.steptime` for the user's own global batch, per token).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from itertools import combinations
from typing import Any

from memplan.errors import UserError
from memplan.estimation.fit import DEFAULT_TOP, MAX_TP, FitResult, model_name
from memplan.estimation.search import Candidate, Evaluator, FitJob, Row, Task, refusal
from memplan.models.depth import num_layers
from memplan.models.registry import load_config
from memplan.models.setup import TrainingSetup
from memplan.parallel.layout import Layout

DEFAULT_MAX_NODES = 96
MAX_GPU_FACTOR = 8
MAX_CHANGES = 3
Delta = Callable[[TrainingSetup, Layout], "tuple[TrainingSetup, Layout] | None"]


@dataclass(frozen=True)
class Change:
    """One change: `name` as shown, its `group` (one change per group), whether it
    changes the training setup (a new trace) or only the layout, and the delta itself."""

    group: str
    name: str
    setup: bool
    delta: Delta = field(compare=False, repr=False)


def _setup_change(group: str, name: str, **fields: Any) -> Change:
    return Change(group, name, True, lambda s, lay: (replace(s, **fields), lay))


def setup_changes(setup: TrainingSetup, allow_quant: bool) -> list[Change]:
    """The setup deltas (module docstring) that change something, the ones users reach for
    first and that cost the least step time first: with `max_nodes` they are estimated first."""
    out = [_setup_change("checkpointing", f"checkpointing {c}", checkpointing=c)
           for c in ("full", "selective", "selective-op") if c != setup.checkpointing and setup.checkpointing != "full"]
    factor = 2
    while setup.batch % factor == 0:
        out.append(_setup_change("micro-batch", f"micro-batch {setup.batch // factor} x {setup.grad_accum * factor} "
                                 "accumulation", batch=setup.batch // factor, grad_accum=setup.grad_accum * factor))
        factor *= 2
    if setup.loss == "full" and setup.head == "lm":
        out.append(_setup_change("loss", "chunked loss", loss="chunked"))
    if setup.optimizer in ("adamw", "adam"):
        out.append(_setup_change("optimizer", "optimizer adamw8bit", optimizer="adamw8bit", optimizer_impl=None))
    if not setup.optimizer_in_backward:
        out.append(_setup_change("optimizer-in-backward", "optimizer in backward", optimizer_in_backward=True))
    if setup.activation_offload == "none":
        out.append(_setup_change("activation-offload", "activation offload", activation_offload="torchtune"))
    if setup.cpu_offload == "none":
        out.append(_setup_change("cpu-offload", "optimizer on the host", cpu_offload="optimizer"))
    if allow_quant and setup.lora_rank > 0 and setup.quant == "none":
        out += [_setup_change("quant", f"quant {q}", quant=q) for q in ("nf4", "int8")]
    return out


def layout_changes(config: Any, layout: Layout) -> list[Change]:
    """The layout deltas, applied after the setup's: more GPUs, then ZeRO, TP, PP."""
    out = [Change("gpus", f"{layout.world_size * k} GPUs", False, _more_gpus(k))
           for k in (2, 4, 8) if k <= MAX_GPU_FACTOR]
    out += [Change("zero", f"ZeRO-{z}", False, _layout_field(zero=z)) for z in (1, 2, 3) if z > layout.zero]
    heads = getattr(config, "num_attention_heads", 1) or 1
    kv = getattr(config, "num_key_value_heads", None) or heads
    out += [Change("tp", f"TP {t}", False, _layout_field(tp=t)) for t in (2, 4, 8)
            if t != layout.tp and t <= MAX_TP and not heads % t and not kv % t]
    blocks = num_layers(config) or 1
    out += [Change("pp", f"PP {p}", False, _pipeline(p)) for p in (2, 4, 8) if p != layout.pp and not blocks % p]
    return out


def _more_gpus(k: int) -> Delta:
    def delta(s: TrainingSetup, lay: Layout) -> tuple[TrainingSetup, Layout]:
        accum = s.grad_accum // k if s.grad_accum % k == 0 else s.grad_accum
        return replace(s, grad_accum=accum), replace(lay, world_size=lay.world_size * k)
    return delta


def _layout_field(**fields: int) -> Delta:
    def delta(s: TrainingSetup, lay: Layout) -> tuple[TrainingSetup, Layout] | None:
        new = replace(lay, **fields)
        if new.world_size % (new.tp * new.pp) or (new.zero and new.dp == 1):
            return None  # degrees that do not divide the GPUs, or ZeRO with one data-parallel rank
        return s, new
    return delta


def _pipeline(p: int) -> Delta:
    def delta(s: TrainingSetup, lay: Layout) -> tuple[TrainingSetup, Layout] | None:
        if lay.world_size % (lay.tp * p):
            return None
        return replace(s, grad_accum=1), replace(lay, pp=p, microbatches=max(lay.microbatches, s.grad_accum))
    return delta


def apply(changes: tuple[Change, ...], setup: TrainingSetup, layout: Layout, order: list[Change]) -> Candidate | None:
    """The candidate `changes` make of the user's setup and layout (None: they do not go
    together, as `TrainingSetup` and `Layout` check)."""
    s, lay = setup, layout
    try:
        for change in sorted(changes, key=order.index):
            out = change.delta(s, lay)
            if out is None:
                return None
            s, lay = out
    except UserError:
        return None
    return Candidate(s, lay, tuple(c.name for c in sorted(changes, key=order.index)))


@dataclass
class WhatFitsResult(FitResult):
    """`FitResult` plus whether the job fits as it is."""

    base: Row | None = None

    def to_json(self) -> dict[str, Any]:
        return {**super().to_json(), "base": self.base.to_json() if self.base is not None else None}


class _Search:
    """The breadth-first search of `what_fits` (module docstring)."""

    def __init__(self, ev: Evaluator, config: Any, setup: TrainingSetup, layout: Layout, allow_quant: bool,
                 max_nodes: int):
        self.ev, self.config, self.setup, self.layout = ev, config, setup, layout
        self.order = setup_changes(setup, allow_quant) + layout_changes(config, layout)
        self.max_nodes = max_nodes
        self.rows: dict[tuple[Change, ...], Row] = {}  # screened or traced, per set
        self.found: list[tuple[int, Row]] = []
        self.refused: dict[str, int] = {}

    def candidates(self, level: int, base: Row) -> list[tuple[tuple[Change, ...], Candidate]]:
        """The sets of `level` changes worth estimating, cheapest and most promising first."""
        fitting = [set(s) for s, r in self.rows.items() if r.fits]
        todo = []
        for changes in combinations(self.order, level):
            if len({c.group for c in changes}) < level or any(f <= set(changes) for f in fitting):
                continue
            cand = apply(changes, self.setup, self.layout, self.order)
            if cand is None or not self._admit(changes, cand):
                continue
            todo.append((changes, cand))
        # what each single change saved; one that cannot be estimated alone (ZeRO on one
        # data-parallel rank) may save everything
        saved = {s[0]: base.device_used_bytes - r.device_used_bytes for s, r in self.rows.items() if len(s) == 1}
        todo.sort(key=lambda t: (sum(c.setup for c in t[0]) > 1,
                                 -sum(saved.get(c, base.device_used_bytes) for c in t[0])))
        return todo

    def _admit(self, changes: tuple[Change, ...], cand: Candidate) -> bool:
        why = refusal(self.config, cand)
        if why is not None:
            self.refused[why] = self.refused.get(why, 0) + 1
            return False
        return True

    def level(self, level: int, base: Row, top: int) -> None:
        """Screen, then confirm, the sets of `level` changes, within the node budget."""
        todo = self.candidates(level, base)[: max(0, self.max_nodes - self.ev.estimates)]
        groups: dict[str, list[tuple[tuple[Change, ...], Candidate]]] = {}
        for changes, cand in todo:
            groups.setdefault(cand.setup_key(), []).append((changes, cand))
        tasks = [Task([c for _, c in g], [False] * len(g)) for g in groups.values()]
        for group, rows in zip(groups.values(), self.ev.run(tasks)):
            for (changes, _), row in zip(group, rows):
                self.rows[changes] = row
        passing = sorted(((s, r) for s, r in self.rows.items() if len(s) == level and r.passes_screen()),
                         key=lambda t: t[1].s_per_token)
        for changes, row in passing:
            if sum(1 for lv, _ in self.found if lv == level) >= top:
                break
            if not row.traced:
                row = self.ev.run([Task([row.candidate], [True])])[0][0]
                self.rows[changes] = row
            if row.fits:
                self.found.append((level, row))


def what_fits(model: str | Any, gpu: str, setup: TrainingSetup | None = None, layout: Layout | None = None, *,
              top: int = DEFAULT_TOP, margin: float = 0.05, capacity: int | None = None, allow_quant: bool = False,
              max_nodes: int = DEFAULT_MAX_NODES, workers: int | None = None, progress: bool = True) -> WhatFitsResult:
    """The smallest sets of changes that make the job fit, fastest first (module docstring)."""
    if isinstance(max_nodes, bool) or not isinstance(max_nodes, int) or max_nodes < 1:
        raise UserError(f"--max-nodes must be a whole number >= 1, not {max_nodes!r}")
    setup = setup if setup is not None else TrainingSetup()
    layout = layout if layout is not None else Layout()
    config = load_config(model) if isinstance(model, str) else model
    why = refusal(config, Candidate(setup, layout))
    if why is not None:
        raise UserError(why)
    job = FitJob(model, gpu, capacity, margin)
    with Evaluator(job, workers, progress, "searching changes") as ev:
        base = ev.run([Task([Candidate(setup, layout)], [True])])[0][0]
        if base.refused is not None:
            raise UserError(base.refused)
        search = _Search(ev, config, setup, layout, allow_quant, max_nodes)
        if not base.fits:
            for level in range(1, MAX_CHANGES + 1):
                search.level(level, base, top)
                if search.found or ev.estimates >= max_nodes:
                    break
        estimates, spent = ev.estimates, ev.spent()
    rows = [r for _, r in sorted(search.found, key=lambda t: (t[0], t[1].s_per_token))][:top]
    return WhatFitsResult(model_name(model), gpu, layout.world_size, rows if not base.fits else [base],
                          estimates=estimates, spent=spent, refused=search.refused, base=base)
