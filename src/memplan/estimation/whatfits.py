"""`what_fits(model, gpu, setup, layout)`: for a job that does not fit, the smallest sets of
changes to the user's own setup and layout that make it fit on the user's own GPUs, fastest
first.

A change is a delta on (`TrainingSetup`, `Layout`) or the allocator. The ones a user reaches
for on the GPUs they have come first: activation checkpointing (full, attention-only
selective, torchtitan's op-level selective), the micro-batch halved (or quartered ...) with
gradient accumulation multiplied to keep the global batch, a chunked loss, bitsandbytes'
8-bit or paged 8-bit AdamW, the optimizer step in backward, activation offloading, the
optimizer on the host, PyTorch's expandable segments, and, only with `allow_quant` (it
changes the model), a 4- or 8-bit base under LoRA. Then, on more than one GPU, ZeRO stage
1/2/3, PP 2/4/8 (its micro-batches taken from gradient accumulation), and TP 2/4/8 only
within one NVLink domain of the GPU (`DeviceProfile.nvlink_gpus`: TP all-reduces every
layer's activations, which PCIe, without peer-to-peer on consumer cards, cannot keep up
with). More GPUs (2/4/8 x, gradient accumulation divided where it divides) only with
`allow_more_gpus`: the question is what fits on the GPUs the user has. Changes of one group
exclude each other. Every candidate is estimated only by `memplan.estimation.estimate`
(through `memplan.estimation.search`; a layout with a part traced on a fake process group is
screened with the modelled rules first, then traced before it is shown); one that `estimate`
would refuse is skipped and counted by reason.

The search is breadth-first over the number of changes: every single change, then pairs,
then triples. A set is kept only if no smaller set inside it fits (the answer is the
smallest change, not the largest). Sets of two or more changes are not all estimated: each
single change's estimate says what it does to the peak of each phase of the step (forward,
backward, optimizer step: `RankEstimate.phase_peaks`), and a set is predicted to peak,
phase by phase, at the base's peak plus its changes' effects; the sets predicted to fit
(within `PREDICTION_SLACK`, 50%: a change moves the peak within a phase, which its estimate
alone does not show) are estimated, fastest predicted first, until `top` fit or
`max_nodes` candidates were estimated (bounded by work, not by the clock). A set predicted
not to fit is not estimated: a limit of the search, not a figure. Rows are ordered by the
number of changes, then by the traced seconds per token (the roofline step time of
`memplan.estimation.steptime` for the user's own global batch, per token).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from itertools import combinations
from typing import Any

from memplan.errors import UserError
from memplan.estimation.figures import DEFAULT_MARGIN
from memplan.estimation.fit import DEFAULT_TOP, MAX_TP, FitResult, model_name
from memplan.estimation.search import Candidate, Evaluator, FitJob, Row, Task, refusal
from memplan.hardware.devices import device_profile
from memplan.models.depth import num_layers
from memplan.models.registry import load_config
from memplan.models.setup import TrainingSetup
from memplan.parallel.apply import traced_part
from memplan.parallel.layout import Layout

DEFAULT_MAX_NODES = 40
MAX_GPU_FACTOR = 8
MAX_CHANGES = 3
# a set predicted within this share above the usable memory is estimated: a change moves the
# peak within a phase (checkpointing does not lower a full fine-tune's backward peak, which
# the gradients and optimizer state set, until 8-bit states and the optimizer in backward
# take them away), which one change alone does not show
PREDICTION_SLACK = 0.5
Delta = Callable[[TrainingSetup, Layout], "tuple[TrainingSetup, Layout] | None"]


@dataclass(frozen=True)
class Change:
    """One change: `name` as shown, its `group` (one change per group), whether it
    changes the training setup (a new trace) or only the layout, the delta itself, and
    the allocator it asks for (None: the job's)."""

    group: str
    name: str
    setup: bool
    delta: Delta = field(compare=False, repr=False)
    allocator: str | None = None


def _setup_change(group: str, name: str, **fields: Any) -> Change:
    return Change(group, name, True, lambda s, lay: (replace(s, **fields), lay))


def setup_changes(setup: TrainingSetup, allow_quant: bool) -> list[Change]:
    """The setup deltas (module docstring) that change something, in the order users reach for them."""
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
        out += [_setup_change("optimizer", f"optimizer {name}", optimizer=name, optimizer_impl=None)
                for name in ("adamw8bit", "paged-adamw8bit")]
    if not setup.optimizer_in_backward:
        out.append(_setup_change("optimizer-in-backward", "optimizer in backward", optimizer_in_backward=True))
    if setup.activation_offload == "none":
        out.append(_setup_change("activation-offload", "activation offload", activation_offload="torchtune"))
    if setup.cpu_offload == "none":
        out.append(_setup_change("cpu-offload", "optimizer on the host", cpu_offload="optimizer"))
    if allow_quant and setup.lora_rank > 0 and setup.quant == "none":
        out += [_setup_change("quant", f"quant {q}", quant=q) for q in ("nf4", "int8")]
    return out


def allocator_changes(allocator: str) -> list[Change]:
    """PyTorch's expandable segments (`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`)
    where the job runs the caching allocator: less memory lost between blocks."""
    if allocator != "caching":
        return []
    return [Change("allocator", "expandable segments", False, lambda s, lay: (s, lay), allocator="expandable")]


def layout_changes(config: Any, layout: Layout, gpu: str, allow_more_gpus: bool) -> list[Change]:
    """The layout deltas on the user's GPUs (ZeRO, PP, then TP within one NVLink domain),
    then, with `allow_more_gpus`, more GPUs."""
    out = [Change("zero", f"ZeRO-{z}", False, _layout_field(zero=z)) for z in (1, 2, 3) if z > layout.zero]
    blocks = num_layers(config) or 1
    out += [Change("pp", f"PP {p}", False, _pipeline(p)) for p in (2, 4, 8) if p != layout.pp and not blocks % p]
    heads = getattr(config, "num_attention_heads", 1) or 1
    kv = getattr(config, "num_key_value_heads", None) or heads
    widest = min(MAX_TP, device_profile(gpu).nvlink_gpus)
    out += [Change("tp", f"TP {t}", False, _layout_field(tp=t)) for t in (2, 4, 8)
            if t != layout.tp and t <= widest and not heads % t and not kv % t]
    if allow_more_gpus:
        out += [Change("gpus", f"{layout.world_size * k} GPUs", False, _more_gpus(k))
                for k in (2, 4, 8) if k <= MAX_GPU_FACTOR]
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
    allocator = None
    try:
        for change in sorted(changes, key=order.index):
            out = change.delta(s, lay)
            if out is None:
                return None
            s, lay = out
            allocator = change.allocator or allocator
    except UserError:
        return None
    return Candidate(s, lay, tuple(c.name for c in sorted(changes, key=order.index)), allocator)


@dataclass
class WhatFitsResult(FitResult):
    """`FitResult` plus whether the job fits as it is."""

    base: Row | None = None

    def to_json(self) -> dict[str, Any]:
        return {**super().to_json(), "base": self.base.to_json() if self.base is not None else None}


def predicted_bytes(base: Row, singles: list[Row]) -> float:
    """The device memory a set of changes is predicted to use: phase by phase, the base's
    peak allocated plus each change's effect on it alone (module docstring), the largest
    phase; plus the allocator's slack in the base's proportion to its allocated peak, and
    what the device holds outside the allocator (context, NCCL)."""
    phases = set(base.phase_peaks)
    for row in singles:
        phases &= set(row.phase_peaks)
    if not phases:
        return float(base.device_used_bytes - sum(base.device_used_bytes - r.device_used_bytes for r in singles))
    peak = max(base.phase_peaks[p] + sum(r.phase_peaks[p] - base.phase_peaks[p] for r in singles) for p in phases)
    outside = base.device_used_bytes - base.peak_reserved_bytes
    slack = base.peak_reserved_bytes - base.peak_allocated_bytes
    return float(max(peak, 0) * (1 + slack / max(base.peak_allocated_bytes, 1)) + outside)


def predicted_s_per_token(base: Row, singles: list[Row]) -> float:
    """The step time per token a set is predicted to take: the base's plus each change's effect."""
    return base.s_per_token + sum(r.s_per_token - base.s_per_token for r in singles)


class _Search:
    """The breadth-first search of `what_fits` (module docstring)."""

    def __init__(self, ev: Evaluator, config: Any, setup: TrainingSetup, layout: Layout, order: list[Change],
                 max_nodes: int):
        self.ev, self.config, self.setup, self.layout = ev, config, setup, layout
        self.order = order
        self.max_nodes = max_nodes
        self.rows: dict[tuple[Change, ...], Row] = {}  # the final row of every set estimated
        self.found: list[tuple[int, Row]] = []
        self.refused: dict[str, int] = {}

    def candidates(self, level: int) -> list[tuple[tuple[Change, ...], Candidate]]:
        """The sets of `level` changes of distinct groups with no fitting set inside them."""
        fitting = [set(s) for s, r in self.rows.items() if r.fits]
        todo = []
        for changes in combinations(self.order, level):
            if len({c.group for c in changes}) < level or any(f <= set(changes) for f in fitting):
                continue
            cand = apply(changes, self.setup, self.layout, self.order)
            if cand is None:
                continue
            why = refusal(self.config, cand)
            if why is not None:
                self.refused[why] = self.refused.get(why, 0) + 1
                continue
            todo.append((changes, cand))
        return todo

    def promising(self, todo: list[tuple[tuple[Change, ...], Candidate]], base: Row,
                  level: int) -> list[tuple[tuple[Change, ...], Candidate]]:
        """Level 1: every set. Deeper: the sets predicted to fit, fastest predicted first."""
        if level == 1:
            return todo
        ranked = []
        for changes, cand in todo:
            singles = [self.rows.get((c,)) for c in changes]
            if any(r is None or r.refused is not None for r in singles):
                continue
            if predicted_bytes(base, singles) <= base.usable_bytes * (1 + PREDICTION_SLACK):
                ranked.append((predicted_s_per_token(base, singles), changes, cand))
        ranked.sort(key=lambda t: t[0])
        return [(changes, cand) for _, changes, cand in ranked]

    def level(self, level: int, base: Row, top: int) -> None:
        """Estimate the promising sets of `level` changes in waves, within the node budget,
        until `top` of them fit."""
        todo = self.promising(self.candidates(level), base, level)[: max(0, self.max_nodes - self.ev.estimates)]
        self.ev.stage(f"sets of {level} change{'s' if level > 1 else ''}", len(todo))
        while todo and sum(1 for lv, _ in self.found if lv == level) < top:
            wave = todo[: self.ev.workers] if level > 1 else todo
            todo = todo[len(wave):]
            self._estimate(wave, level)

    def _estimate(self, wave: list[tuple[tuple[Change, ...], Candidate]], level: int) -> None:
        """Each set's estimate: traced where the layout has no part traced on a fake process
        group, else screened and, if it passes, traced."""
        groups: dict[str, list[tuple[tuple[Change, ...], Candidate]]] = {}
        for changes, cand in wave:
            groups.setdefault(cand.setup_key(), []).append((changes, cand))
        tasks = [Task([c for _, c in g], [traced_part(c.layout, self.config, c.setup) is None for _, c in g])
                 for g in groups.values()]
        confirm = []
        for group, rows in zip(groups.values(), self.ev.run(tasks)):
            for (changes, _), row in zip(group, rows):
                self.rows[changes] = row
                if not row.traced and row.passes_screen():
                    confirm.append(changes)
        for changes, traced in zip(confirm, self.ev.run([Task([self.rows[c].candidate], [True]) for c in confirm])):
            self.rows[changes] = traced[0]
        self.found += [(level, self.rows[c]) for c, _ in wave if self.rows[c].traced and self.rows[c].fits]


def what_fits(model: str | Any, gpu: str, setup: TrainingSetup | None = None, layout: Layout | None = None, *,
              top: int = DEFAULT_TOP, margin: float = DEFAULT_MARGIN, capacity: int | None = None,
              allow_quant: bool = False, allow_more_gpus: bool = False, max_nodes: int = DEFAULT_MAX_NODES,
              workers: int | None = None, progress: bool = True, allocator: str = "caching",
              base: Row | None = None, cache: dict | None = None, label: str = "memplan fit") -> WhatFitsResult:
    """The smallest sets of changes that make the job fit on its own GPUs, fastest first
    (module docstring). `base`: the job's own row, when the caller estimated it already;
    `cache`: captured steps to reuse (`memplan.estimation.estimate`'s `cache`, in-process);
    `label`: what the progress lines on stderr start with."""
    if isinstance(max_nodes, bool) or not isinstance(max_nodes, int) or max_nodes < 1:
        raise UserError(f"--max-nodes must be a whole number >= 1, not {max_nodes!r}")
    setup = setup if setup is not None else TrainingSetup()
    layout = layout if layout is not None else Layout()
    config = load_config(model) if isinstance(model, str) else model
    why = refusal(config, Candidate(setup, layout))
    if why is not None:
        raise UserError(why)
    job = FitJob(model, gpu, capacity, margin, allocator)
    order = setup_changes(setup, allow_quant) + allocator_changes(allocator) + \
        layout_changes(config, layout, gpu, allow_more_gpus)
    with Evaluator(job, workers, progress, label, cache=cache) as ev:
        if base is None:
            ev.stage("the job as it is", 1)
            base = ev.run([Task([Candidate(setup, layout)], [True])])[0][0]
        if base.refused is not None:
            raise UserError(base.refused)
        search = _Search(ev, config, setup, layout, order, max_nodes)
        if not base.fits:
            for level in range(1, MAX_CHANGES + 1):
                search.level(level, base, top)
                if search.found or ev.estimates >= max_nodes:
                    break
        estimates, spent = ev.estimates, ev.spent()
    rows = [r for _, r in sorted(search.found, key=lambda t: (t[0], t[1].s_per_token))][:top]
    return WhatFitsResult(model_name(model), gpu, layout.world_size, rows if not base.fits else [base],
                          estimates=estimates, spent=spent, refused=search.refused, base=base)
