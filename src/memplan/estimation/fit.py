"""`fit(model, gpu, gpus, setup)`: the layouts that fit, fastest first; `gpus="auto"`: the
fewest GPUs that fit, and at what layout.

LLMem's method selection (arXiv 2404.10933: pick the fastest of DP / sharded DP / TP /
DP+TP that does not run out of memory), over the whole space: data-parallel degree,
ZeRO stage 0-3, TP (within one NVLink domain of the GPU, `DeviceProfile.nvlink_gpus`) and
PP degrees, micro-batch size and activation checkpointing (none, torchtitan's op-level
selective policy, full), under one allocator (the caller's, caching by default).

Every row `fit` returns is a traced estimate, the figures `memplan estimate` prints for the
same setup, layout, allocator and margin (`memplan.estimation.search`). The search gets
there in two steps:

1. **screen** the candidates of each training setup (one task per setup, so that its
   candidates share its single-device trace; the tensor bytes of the modelled layout). The
   setups go in waves from the ones that need the least memory (the smallest micro-batch,
   full checkpointing): a setup is screened only at the degrees that passed at the next
   smaller micro-batch and at the next more frugal checkpointing, so a setup none of whose
   layouts can fit is never traced; within a setup ZeRO-3 <= ZeRO-2 <= ZeRO-1 <= DDP at
   the same degrees (a stage is screened only if the one above it passed);
2. **confirm**: the candidates that passed are traced, fastest screened first, a wave of as
   many as there are workers at a time, while one of them could still enter the `top`
   fastest (its screened time beats the `top`-th row's) and at most
   `CONFIRMATIONS_PER_ROW` x `top` ranks were traced (a pipelined layout traces up to three
   stages). Each confirmation teaches the rest: a traced estimate that does not fit rules
   out every candidate that needs at least its memory (same degrees and setup, a lower
   ZeRO stage, a larger micro-batch, checkpointing that saves less); and the ratios of
   traced to screened memory seen for the same parallel degrees (else the same kind of
   traced layout: FSDP2, TP, pipeline stages; else TP or not) scale the screened figures:
   a candidate that does not fit at the largest ratio (over its degrees, its kind of
   layout and TP or not) is traced after those that do, fastest first within each, and not
   at all once `top` rows fit (a limit of the search, not a figure). The modelled rules are far from the traced steps where TP
   is involved: on llama-3.1-70b at seq 8192 (fp32, 64 GPUs) the traced FSDP2 step was 7%
   above the modelled ZeRO-3 rule, but FSDP2 x TP 2-8 were 1.1-5.7x the modelled TP rule
   (plain TP keeps the [B, S, H] activations whole; the rule assumes sequence parallel).
   Rows are ranked by their traced seconds per token.

Step time: `memplan.estimation.steptime`. `gpus="auto"`: the smallest count of the ladder
1, 2, 4, 8, 16, 24, 32, ... (whole 8-GPU nodes past 8) whose memory-minimal candidates
(full checkpointing, micro-batch 1, ZeRO-3 where there is more than one data-parallel
rank, every TP x PP) pass the screen, found by doubling then bisection (memory per GPU
falls as the count grows), then the full search at that count; a count whose search
confirms nothing moves the answer up the ladder. The count below the answer is reported
with its closest candidate, traced.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from memplan.errors import UserError
from memplan.estimation.figures import DEFAULT_MARGIN
from memplan.estimation.search import Candidate, Evaluator, FitJob, Row, Task, refusal
from memplan.hardware.devices import device_profile
from memplan.models.depth import num_layers
from memplan.models.registry import FactorySpec, load_config
from memplan.models.setup import TrainingSetup
from memplan.parallel.apply import traced_part
from memplan.parallel.layout import Layout

if TYPE_CHECKING:  # transformers takes a second to import; only its config class is named here
    from transformers import PretrainedConfig

MICRO_BATCHES = (1, 2, 4)
CHECKPOINTING = ("none", "selective-op", "full")
MAX_TP = 8  # TP beyond one NVLink domain is not worth searching
MAX_PP = 8
PP_MICROBATCHES_PER_STAGE = 2  # pipeline micro-batches >= 2 x stages: bubble (p - 1) / m under 1/2
DEFAULT_TOP = 3
CONFIRMATIONS_PER_ROW = 3
MAX_AUTO_GPUS = 4096
NODE_GPUS = 8
MAX_COUNTS_CONFIRMED = 3  # counts whose full search may confirm nothing before auto gives up


@dataclass(frozen=True)
class SearchSpace:
    """What the layout search varies besides the data-parallel degree and ZeRO stage."""

    micro_batches: tuple[int, ...] = MICRO_BATCHES  # the setup's own batch is searched too
    checkpointing: tuple[str, ...] = CHECKPOINTING
    max_tp: int = MAX_TP
    max_pp: int = MAX_PP


@dataclass
class FitResult:
    """What `fit` found: the rows that fit (traced, fastest first) and what the search spent."""

    model: str
    gpu: str
    gpus: int | None
    rows: list[Row]
    estimates: int = 0
    refused: dict[str, int] = field(default_factory=dict)  # reason -> candidates
    spent: dict[str, Any] = field(default_factory=dict)  # `Evaluator.spent`
    below: Row | None = None  # gpus="auto": the closest candidate one step below the answer
    probes: list[dict[str, Any]] = field(default_factory=list)  # gpus="auto": the counts screened

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "gpu": self.gpu, "gpus": self.gpus,
                "configurations": [r.to_json() for r in self.rows], "estimates": self.estimates,
                "search": self.spent,
                "refused": self.refused, "below": self.below.to_json() if self.below is not None else None,
                "gpu_counts_screened": self.probes}


def model_name(model: Any) -> str:
    return model if isinstance(model, str) else getattr(model, "spec", None) or type(model).__name__


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def parallel_degrees(config: PretrainedConfig | FactorySpec, gpus: int,
                     space: SearchSpace = SearchSpace()) -> list[tuple[int, int]]:
    """The (TP, PP) pairs searched on `gpus`: TP up to `space.max_tp` dividing the attention
    and key/value heads, PP up to `space.max_pp` dividing the blocks."""
    heads = getattr(config, "num_attention_heads", 1) or 1
    kv = getattr(config, "num_key_value_heads", None) or heads
    blocks = num_layers(config) or 1
    return [(tp, pp) for tp in _divisors(gpus) if tp <= space.max_tp and not heads % tp and not kv % tp
            for pp in _divisors(gpus // tp) if pp <= space.max_pp and not blocks % pp]


def micro_batches(setup: TrainingSetup, space: SearchSpace = SearchSpace()) -> list[int]:
    return sorted({*space.micro_batches, setup.batch})


def candidate(setup: TrainingSetup, gpus: int, tp: int, pp: int, zero: int) -> Candidate:
    """`setup` under one layout of `gpus` GPUs; with PP the step's micro-batches are the
    pipeline's (at least `PP_MICROBATCHES_PER_STAGE` per stage)."""
    if pp > 1:
        micro = max(setup.grad_accum, PP_MICROBATCHES_PER_STAGE * pp)
        return Candidate(replace(setup, grad_accum=1), Layout(world_size=gpus, zero=zero, tp=tp, pp=pp,
                                                              microbatches=micro))
    return Candidate(setup, Layout(world_size=gpus, zero=zero, tp=tp, pp=pp))


def layout_task(config: Any, setup: TrainingSetup, gpus: int, refused: dict[str, int], space: SearchSpace,
                keep: set[tuple[int, int, int]] | None = None, zeros: tuple[int, ...] = (3, 2, 1, 0)) -> Task:
    """The candidates of one setup on `gpus` (those in `keep`, if given), ZeRO stages in
    `zeros` order, each requiring the one before it at the same degrees to pass."""
    task = Task([], [], [])
    for tp, pp in parallel_degrees(config, gpus, space):
        previous = None
        for zero in zeros if gpus // (tp * pp) > 1 else (0,):
            if keep is not None and (tp, pp, zero) not in keep:
                continue
            cand = candidate(setup, gpus, tp, pp, zero)
            why = refusal(config, cand)
            if why is not None:
                refused[why] = refused.get(why, 0) + 1
                continue
            task.candidates.append(cand)
            task.traced.append(False)
            task.requires.append(previous)
            previous = len(task.candidates) - 1
    return task


def _degrees(row: Row) -> tuple[int, int, int]:
    lay = row.candidate.layout
    return lay.tp, lay.pp, lay.zero


def screen_layouts(ev: Evaluator, config: Any, setup: TrainingSetup, gpus: int, refused: dict[str, int],
                   space: SearchSpace) -> list[Row]:
    """Every candidate of the search on `gpus` that passes the screen (module docstring):
    the setups in waves, from the micro-batch and checkpointing that need the least
    memory; a setup is screened at the degrees that passed at the next smaller
    micro-batch and at the next more frugal checkpointing, and not traced at all when
    none did."""
    batches = micro_batches(setup, space)
    policies = sorted(space.checkpointing, key=CHECKPOINT_MEMORY.__getitem__)
    setups = {(i, j): replace(setup, batch=mb, checkpointing=c) for i, mb in enumerate(batches)
              for j, c in enumerate(policies)}
    sizes = {cell: len(layout_task(config, s, gpus, {}, space).candidates) for cell, s in setups.items()}
    ev.stage(f"screening layouts on {gpus} GPUs", sum(sizes.values()))
    passed: dict[tuple[int, int], set[tuple[int, int, int]]] = {}
    passing: list[Row] = []
    for wave in range(len(batches) + len(policies) - 1):
        cells, tasks = [], []
        for (i, j), one in setups.items():
            if i + j != wave:
                continue
            before = [passed[c] for c in ((i - 1, j), (i, j - 1)) if c in passed]
            keep = set.intersection(*before) if before else None
            task = layout_task(config, one, gpus, refused, space, keep)
            ev.skip(sizes[(i, j)] - len(task.candidates))
            if task.candidates:
                cells.append((i, j))
                tasks.append(task)
            else:
                passed[(i, j)] = set()
        for cell, rows in zip(cells, ev.run(tasks)):
            ok = [r for r in rows if r is not None and r.passes_screen()]
            passed[cell] = {_degrees(r) for r in ok}
            passing += ok
    return passing


def _traced_key(config: Any, cand: Candidate) -> str:
    """What a traced estimate of `cand` captures: its setup's single-device step, and the
    part of its layout traced on a fake process group, if any."""
    part = traced_part(cand.layout, config, cand.setup)
    return cand.setup_key() + ("" if part is None else repr(part))


CHECKPOINT_MEMORY = {"full": 0, "selective-op": 1, "selective": 1, "none": 2}  # more memory, larger


def _rest(setup: TrainingSetup) -> dict[str, Any]:
    fields = setup.to_dict()
    for name in ("batch", "checkpointing", "grad_accum"):
        fields.pop(name)
    return fields


def dominates(failed: Candidate, cand: Candidate) -> bool:
    """Whether `cand` needs at least the memory of `failed`: the same degrees and setup but a
    lower or equal ZeRO stage, a micro-batch as large and checkpointing that saves no more."""
    a, b = failed.layout, cand.layout
    return ((a.tp, a.pp, a.dp) == (b.tp, b.pp, b.dp) and b.zero <= a.zero
            and cand.setup.batch >= failed.setup.batch
            and CHECKPOINT_MEMORY[cand.setup.checkpointing] >= CHECKPOINT_MEMORY[failed.setup.checkpointing]
            and _rest(cand.setup) == _rest(failed.setup))


def _ratio_keys(layout: Layout) -> list[tuple[Any, ...]]:
    """From the most to the least specific: the layout's traced degrees, its kind of traced
    layout, whether it has TP (the modelled TP rule is the furthest from its traced step)."""
    fsdp = layout.zero == 3 and layout.dp > 1
    return [("degrees", fsdp, layout.tp, layout.pp), ("kind", fsdp, layout.tp > 1, layout.pp > 1),
            ("tp", layout.tp > 1)]


@dataclass
class _Learned:
    """What the confirmations so far say about the rest (module docstring, step 2): the
    smallest and the largest ratio of traced to screened memory per parallel degrees, per
    kind of traced layout and per TP or not, and the candidates whose traced estimate did
    not fit."""

    ratios: dict[tuple[Any, ...], tuple[float, float]] = field(default_factory=dict)
    failed: list[Candidate] = field(default_factory=list)

    def doubtful(self, row: Row) -> bool:
        """Whether the screened `row`, scaled by the largest ratio known for any of its keys,
        does not fit (it is then confirmed after the others, and not once `top` rows fit)."""
        known = [self.ratios[k][1] for k in _ratio_keys(row.candidate.layout) if k in self.ratios]
        return bool(known) and row.device_used_bytes * max(known) > row.usable_bytes

    def hopeless(self, row: Row) -> bool:
        """Whether a traced estimate that did not fit needs no more memory than `row`. (A
        ratio does not rule a candidate out: the traced TP step keeps the block inputs and
        logits whole where the modelled rule shards them, so its ratio grows with the
        activations: 1.65 at micro-batch 1 and 2.71 at 4 for llama-3.1-70b, FSDP2 x TP 2.)"""
        return any(dominates(f, row.candidate) for f in self.failed)

    def learn(self, screened: Row, traced: Row) -> None:
        if traced.refused is not None:
            return
        if not traced.fits:
            self.failed.append(traced.candidate)
        if screened.device_used_bytes:
            ratio = traced.device_used_bytes / screened.device_used_bytes
            for key in _ratio_keys(screened.candidate.layout):
                low, high = self.ratios.get(key, (ratio, ratio))
                self.ratios[key] = (min(low, ratio), max(high, ratio))


def confirmation_cost(layout: Layout) -> int:
    """The ranks a traced estimate of `layout` traces: one, or with PP one per distinct
    stage (first, a middle one, last; `memplan.parallel.plans.rank_plans`)."""
    return 1 if layout.pp == 1 else min(layout.pp, 3)


def confirm(ev: Evaluator, config: Any, screened: list[Row], top: int) -> list[Row]:
    """The `top` fastest rows that fit, traced (module docstring, step 2)."""
    final = [r for r in screened if r.traced and r.fits]
    pending = [r for r in screened if not r.traced and r.passes_screen()]
    budget = CONFIRMATIONS_PER_ROW * top
    ev.stage("tracing the fastest candidates", budget)
    learned = _Learned()
    while pending and budget > 0:
        times = sorted(r.s_per_token for r in final)
        bar = times[top - 1] if len(times) >= top else float("inf")  # what a new row must beat
        # once `top` rows are found, a candidate the calibrated screen says does not fit is not traced
        pending = [r for r in pending if r.s_per_token < bar and not learned.hopeless(r)
                   and not (len(times) >= top and learned.doubtful(r))]
        pending.sort(key=lambda r: (learned.doubtful(r), r.s_per_token))
        wave: dict[str, list[Row]] = {}
        for row in [r for r in pending if confirmation_cost(r.candidate.layout) <= budget][: ev.workers]:
            wave.setdefault(_traced_key(config, row.candidate), []).append(row)
            budget -= confirmation_cost(row.candidate.layout)
            pending.remove(row)
        if not wave:
            break
        groups = list(wave.items())
        tasks = [Task([r.candidate for r in g], [True] * len(g), key=key) for key, g in groups]
        for (_, group), rows in zip(groups, ev.run(tasks)):
            for was, row in zip(group, rows):
                if row is not None:
                    learned.learn(was, row)
                    final += [row] if row.fits else []
    return sorted(final, key=lambda r: (r.s_per_token, r.device_used_bytes))[:top]


def fit(model: str | PretrainedConfig | FactorySpec, gpu: str, gpus: int | str, setup: TrainingSetup | None = None,
        *, top: int = DEFAULT_TOP, margin: float = DEFAULT_MARGIN, capacity: int | None = None,
        workers: int | None = None, progress: bool = True, space: SearchSpace = SearchSpace(),
        allocator: str = "caching") -> FitResult:
    """The configurations that fit on `gpus` x `gpu` (or, `gpus="auto"`, on the fewest),
    fastest (seconds per token) first, each a traced estimate (module docstring) under
    `allocator`; tensor parallelism only within one NVLink domain of `gpu`."""
    if gpus != "auto" and (isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1):
        raise UserError(f"--gpus must be a whole number >= 1 or auto, not {gpus!r}")
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise UserError(f"--top must be a whole number >= 1, not {top!r}")
    setup = setup if setup is not None else TrainingSetup()
    if setup.cpu_offload == "params":
        raise UserError("memplan fit screens layouts with the modelled rules, and FSDP2's CPU offload is estimated "
                        "only where FSDP2 is traced: use memplan estimate --zero 3 --cpu-offload params")
    job = FitJob(model, gpu, capacity, margin, allocator)
    config = load_config(model) if isinstance(model, str) else model
    space = within_nvlink(space, gpu)
    refused: dict[str, int] = {}
    with Evaluator(job, workers, progress) as ev:
        if gpus == "auto":
            result = fewest_gpus(ev, config, setup, top, refused, space)
        else:
            rows = confirm(ev, config, screen_layouts(ev, config, setup, gpus, refused, space), top)
            result = FitResult(model_name(model), gpu, gpus, rows)
        result.estimates, result.refused, result.spent = ev.estimates, refused, ev.spent()
    return result


def within_nvlink(space: SearchSpace, gpu: str) -> SearchSpace:
    """`space` with TP no wider than one NVLink domain of `gpu` (`DeviceProfile.nvlink_gpus`):
    TP all-reduces every layer's activations in the step's critical path, and over PCIe
    (without peer-to-peer on consumer cards) they stall it."""
    return replace(space, max_tp=min(space.max_tp, device_profile(gpu).nvlink_gpus))


def gpu_ladder(limit: int = MAX_AUTO_GPUS) -> list[int]:
    """1, 2, 4, 8, then whole nodes of `NODE_GPUS`, up to `limit`."""
    return [n for n in (1, 2, 4) if n <= limit] + list(range(NODE_GPUS, limit + 1, NODE_GPUS))


def _minimal_screen(ev: Evaluator, config: Any, setup: TrainingSetup, gpus: int, refused: dict[str, int],
                    space: SearchSpace) -> list[Row]:
    """The memory-minimal candidates on `gpus` (module docstring), screened."""
    policy = min(space.checkpointing, key=CHECKPOINT_MEMORY.__getitem__)
    minimal = replace(setup, batch=min(micro_batches(setup, space)), checkpointing=policy)
    task = layout_task(config, minimal, gpus, refused, space, zeros=(3,))
    ev.stage(f"screening {gpus} GPUs", len(task.candidates))
    rows = ev.run([task])[0]
    return [r for r in rows if r is not None]


def fewest_gpus(ev: Evaluator, config: Any, setup: TrainingSetup, top: int, refused: dict[str, int],
                space: SearchSpace) -> FitResult:
    """`fit(..., gpus="auto")` (module docstring)."""
    ladder = gpu_ladder()
    probes: list[dict[str, Any]] = []
    screened: dict[int, list[Row]] = {}

    def passes(i: int) -> bool:
        if ladder[i] not in screened:
            screened[ladder[i]] = _minimal_screen(ev, config, setup, ladder[i], refused, space)
            probes.append({"gpus": ladder[i], "passes_screen": any(r.passes_screen() for r in screened[ladder[i]])})
        return any(r.passes_screen() for r in screened[ladder[i]])

    powers = [i for i, n in enumerate(ladder) if n & (n - 1) == 0]
    low, high = -1, None
    for i in powers:
        if passes(i):
            high = i
            break
        low = i
    name = model_name(ev.job.model)
    if high is None:
        return FitResult(name, ev.job.gpu, None, [], probes=probes, below=_confirm_closest(ev, screened, ladder[low]))
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if passes(mid) else (mid, high)
    return _answer(ev, config, setup, top, refused, space, ladder, high, passes, screened, probes)


def _answer(ev: Evaluator, config: Any, setup: TrainingSetup, top: int, refused: dict[str, int], space: SearchSpace,
            ladder: list[int], first: int, passes: Any, screened: dict[int, list[Row]],
            probes: list[dict[str, Any]]) -> FitResult:
    """The full search at the first count whose screen passes, moving up the ladder (at
    most `MAX_COUNTS_CONFIRMED` counts) while it confirms nothing, and down while the count
    below has a traced candidate that fits."""
    name = model_name(ev.job.model)
    for i in range(first, min(first + MAX_COUNTS_CONFIRMED, len(ladder))):
        rows = confirm(ev, config, screen_layouts(ev, config, setup, ladder[i], refused, space), top)
        if not rows:
            continue
        below = None
        while i > 0:
            passes(i - 1)  # the count below is screened
            below = _confirm_closest(ev, screened, ladder[i - 1])
            lower = confirm(ev, config, screen_layouts(ev, config, setup, ladder[i - 1], refused, space), top) \
                if below is not None and below.fits else []
            if not lower:
                break
            i, rows = i - 1, lower
        return FitResult(name, ev.job.gpu, ladder[i], rows, probes=probes, below=below)
    return FitResult(name, ev.job.gpu, None, [], probes=probes)


def _closest(screened: dict[int, list[Row]], gpus: int) -> Row | None:
    rows = [r for r in screened.get(gpus, []) if r.refused is None]
    return min(rows, key=lambda r: r.device_used_bytes) if rows else None


def _confirm_closest(ev: Evaluator, screened: dict[int, list[Row]], gpus: int) -> Row | None:
    """The candidate one count below the answer that came closest to fitting, traced."""
    row = _closest(screened, gpus)
    if row is None or row.traced:
        return row
    ev.stage(f"tracing the closest candidate on {gpus} GPUs", 1)
    return ev.run([Task([row.candidate], [True])])[0][0]
