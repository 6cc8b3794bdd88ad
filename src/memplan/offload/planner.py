"""The offload planner: which idle buffers leave device memory, where to, and when they come back.

Follows TERAIO's greedy, iterative planner (arXiv 2506.06472, §3.3):

- candidates are the inactive intervals of parameters, gradients, optimizer states and
  activations (from `lifetimes.analyse_lifetimes`);
- each round takes the candidate with the best benefit / cost, where benefit is the
  memory above the budget it removes, integrated over time (byte-seconds), and cost is
  its offload time plus its prefetch time;
- one bandwidth timeline per link: transfers planned earlier occupy the link, so a
  later offload starts later and its prefetch must start earlier; memory counts as
  saved only from the end of the offload to the start of the prefetch;
- SSD first; host memory (up to its limit) when the SSD link leaves no window;
- when no overlapped transfer helps any more and memory still exceeds the budget,
  **urgent** transfers are planned: the offload must finish before the next op and
  the prefetch starts when the buffer is needed, so the GPU waits for them.

memplan adds one step to TERAIO's: **planned stalls**. Urgent transfers make the GPU
wait for a whole write and a whole read, one buffer at a time. Where the budget is
out of reach of overlapped transfers (typically the per-parameter optimizer phase,
which touches every parameter, gradient and optimizer state in a fraction of the
step, so that everything away at its start must come back during it), it is cheaper
to let the GPU wait *once* while the links stream. So the greedy runs in rounds, each
on an op timeline stretched by planned stalls: every round's plan is simulated with the
real op times (`simulate.simulate_offload_plan`), and the next round's planned stall before each
op is the mean of this round's and the stall the simulation measured there (the timeline
the plan actually produced, damped), plus, for each run of ops (split by phase) that the
overlapped greedy left over budget, the run's max excess / link bandwidth spread in
proportion to each op's excess. The rounds stop when the overlapped greedy fits the
budget and nothing waits, after `patience` rounds in a row that are no faster than the
fastest so far, or after `max_rounds`; the fastest plan in simulation is kept.

The plan is op-indexed (offload after op a, prefetch at the start of op p), so a
runtime can follow it whatever the real op times; the planned seconds are kept for
reports. Every plan passes `validate.validate_plan` before it is returned.

Assumptions: the step repeats (persistent buffers wrap around the step end); a
buffer written while on device is written out whole on every offload.
"""

from __future__ import annotations

import heapq
import math
import time
from bisect import bisect_left
from dataclasses import dataclass, field, replace

import numpy as np

from memplan.errors import UserError
from memplan.hardware.links import Hardware
from memplan.hardware.roofline import op_seconds
from memplan.offload.lifetimes import Lifetimes, analyse_lifetimes
from memplan.offload.plan_file import OffloadPlan, Transfer
from memplan.offload.schedule import tensor_schedule
from memplan.offload.simulate import simulate_offload_plan
from memplan.offload.validate import validate_plan
from memplan.trace.model import CATEGORY, Trace
from memplan.units import parse_size

CANDIDATE_CATEGORIES = ("parameter", "gradient", "optimizer_state", "activation")
TIERS = ("ssd", "host")


class LinkTimeline:
    """Busy intervals of one link over a periodic step of `period_s` seconds.

    Queries unroll the period so that transfers may cross the step end.
    """

    def __init__(self, period_s: float, bytes_per_s: float) -> None:
        self.period_s = period_s
        self.bytes_per_s = bytes_per_s
        self._starts: list[float] = []
        self._ends: list[float] = []
        self._unrolled: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None
        self.busy_s = 0.0

    def duration_s(self, nbytes: int) -> float:
        return nbytes / self.bytes_per_s if self.bytes_per_s > 0 else math.inf

    def _arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The busy intervals unrolled over five periods (starts, ends, sorted), and the free
        gap after and before each (inf past the last and before the first)."""
        if self._unrolled is None:
            s, e = np.asarray(self._starts), np.asarray(self._ends)
            shifts = [-1, 0, 1, 2, 3]
            starts = np.concatenate([s + k * self.period_s for k in shifts])
            ends = np.concatenate([e + k * self.period_s for k in shifts])
            between = starts[1:] - ends[:-1]
            self._unrolled = (starts, ends, np.append(between, math.inf), np.concatenate([[math.inf], between]))
        return self._unrolled

    def earliest_start(self, t0: float, duration_s: float) -> float:
        """Earliest start >= t0 of a free slot of `duration_s`."""
        starts, ends, gap_after, _ = self._arrays()
        k = int(ends.searchsorted(t0, side="right"))  # first interval ending after t0
        if k == starts.size:
            return t0
        if starts[k] > t0 and starts[k] - t0 >= duration_s:
            return t0  # the free time from t0 to the next interval is enough
        # the first gap long enough after interval k (the last gap is endless)
        return float(ends[k + int((gap_after[k:] >= duration_s).argmax())])

    def latest_start(self, deadline_s: float, duration_s: float) -> float:
        """Latest start of a free slot of `duration_s` that ends by `deadline_s`."""
        starts, ends, _, gap_before = self._arrays()
        k = int(starts.searchsorted(deadline_s, side="left")) - 1  # last interval starting before
        if k < 0:
            return deadline_s - duration_s
        if ends[k] <= deadline_s and deadline_s - ends[k] >= duration_s:
            return deadline_s - duration_s  # the free time from interval k to the deadline is enough
        # the last gap long enough before interval k (the first gap is endless)
        return float(starts[k - int((gap_before[k::-1] >= duration_s).argmax())] - duration_s)

    def reserve(self, start_s: float, end_s: float) -> None:
        """Mark [start_s, end_s) busy (taken modulo the period)."""
        length = end_s - start_s
        if length <= 0:
            return
        self.busy_s += length
        s = start_s % self.period_s
        pieces = [(s, s + length)] if s + length <= self.period_s else [(s, self.period_s), (0.0, s + length - self.period_s)]
        for a, b in pieces:
            i = bisect_left(self._starts, a)
            self._starts.insert(i, a)
            self._ends.insert(i, b)
        self._merge()
        self._unrolled = None

    def _merge(self) -> None:
        starts, ends = [], []
        for a, b in zip(self._starts, self._ends):
            if ends and a <= ends[-1]:
                ends[-1] = max(ends[-1], b)
            else:
                starts.append(a)
                ends.append(b)
        self._starts, self._ends = starts, ends


@dataclass
class _Option:
    tier: str
    done_op: int
    return_op: int
    offload_start_s: float
    prefetch_start_s: float | None
    benefit: float
    cost_s: float
    score: float = field(init=False)

    def __post_init__(self) -> None:
        self.score = _quantized(self.benefit / self.cost_s) if self.cost_s > 0 else math.inf


def _quantized(x: float) -> float:
    """`x` rounded to 32 significant bits. Identical layers give candidates whose scores are equal
    in exact arithmetic but differ in the last bits, depending on summation order (and so on the
    numerical library and its threads); rounded, they tie, and the heap breaks ties by interval
    order, so the plan does not depend on rounding noise."""
    mantissa, exponent = math.frexp(x)
    return math.ldexp(round(mantissa * (1 << 32)), exponent - 32)


class _PlannerState:
    """Memory above budget per op, link timelines and tier occupancy while the greedy runs."""

    _nbytes: np.ndarray  # each buffer's bytes and category name, given by `_plan_round`
    _category: list[str]

    def __init__(self, lt: Lifetimes, hardware: Hardware, budget_bytes: int) -> None:
        n = lt.num_ops
        self.lt = lt
        self.n = n
        self.budget = float(budget_bytes)
        self.usage = lt.op_bytes.astype(np.float64).copy()
        self.durations = lt.op_durations_s
        self._scratch = np.empty(n)
        self._refresh_excess()
        step = lt.step_s
        self.step_s = step
        # start times of ops in this and the next two iterations
        self.start_global = np.concatenate([lt.op_start_s[:-1] + k * step for k in range(3)] + [[3 * step]])
        bw = hardware.link_bytes_per_s()
        self.links = {name: LinkTimeline(step, bw[name]) for name in bw}
        self.capacity = {"ssd": float(hardware.nvme.capacity_bytes), "host": float(hardware.host_capacity_bytes)}
        self.tier_usage = {"ssd": np.zeros(n), "host": np.zeros(n)}
        self.tier_peak = {"ssd": 0.0, "host": 0.0}  # max of tier_usage: most candidates fit under it
        self.chosen: dict[int, Transfer] = {}  # inactive interval -> its transfer

    def ranges(self, a: int, b: int) -> list[tuple[int, int]]:
        """Global op range [a, b) as slices of one iteration."""
        if b <= a:
            return []
        if b - a >= self.n:
            return [(0, self.n)]
        a0, b0 = a % self.n, b - (a - a % self.n)
        return [(a0, b0)] if b0 <= self.n else [(a0, self.n), (0, b0 - self.n)]

    def _refresh_excess(self) -> None:
        self.excess = np.maximum(self.usage - self.budget, 0.0)
        # benefits only look at ops over budget: keep them compressed
        self.over_ops = np.flatnonzero(self.excess > 0)
        self.over_excess = self.excess[self.over_ops]
        self.over_durations = self.durations[self.over_ops]

    def benefit(self, a: int, b: int, nbytes: int) -> float:
        """Byte-seconds above budget removed by freeing `nbytes` over global ops [a, b)."""
        total = 0.0
        for lo, hi in self.ranges(a, b):
            i0, i1 = self.over_ops.searchsorted((lo, hi)).tolist()
            if i1 > i0:
                # Not `@`: OpenBLAS splits a long dot product over its threads, which is slow
                # when the cores are busy (docs/offload.md, planning time).
                scratch = self._scratch[: i1 - i0]
                np.minimum(self.over_excess[i0:i1], nbytes, out=scratch)
                scratch *= self.over_durations[i0:i1]
                total += float(scratch.sum())
        return total

    def tier_fits(self, tier: str, a: int, b: int, nbytes: int) -> bool:
        if self.tier_peak[tier] + nbytes <= self.capacity[tier]:
            return True
        return all(
            self.tier_usage[tier][lo:hi].max(initial=0.0) + nbytes <= self.capacity[tier]
            for lo, hi in self.ranges(a, b)
        )

    def option(self, k: int, tier: str, urgent: bool) -> _Option | None:
        lt = self.lt
        b = int(lt.inactive_buffer[k])
        after, before = int(lt.inactive_after_op[k]), int(lt.inactive_before_op[k])
        returns = bool(lt.inactive_returns[k])
        nbytes = int(self._nbytes[b])
        write, read = self.links[f"{tier}_write"], self.links[f"{tier}_read"]
        w_s = write.duration_s(nbytes)
        r_s = read.duration_s(nbytes) if returns else 0.0
        if math.isinf(w_s) or math.isinf(r_s):
            return None
        t_free = float(self.start_global[after + 1])  # end of the last active op
        t_need = float(self.start_global[before])
        if urgent:
            off_start, done_op = t_free, after + 1
            pre_start = t_need if returns else None
            return_op = before
        else:
            off_start = write.earliest_start(t_free, w_s)
            done_op = int(self.start_global.searchsorted(off_start + w_s, side="left"))
            if returns:
                pre_start = read.latest_start(t_need, r_s)
                if pre_start < off_start + w_s:
                    return None
                return_op = int(self.start_global.searchsorted(pre_start, side="right")) - 1
            else:
                pre_start, return_op = None, before
        if return_op <= done_op or done_op <= after or return_op > before:
            return None
        previous = self.chosen.get(k)
        if previous is not None:
            # widening an overlapped transfer: same tier, only the ops it did not cover count
            if tier != previous.tier:
                return None
            benefit = self.benefit(done_op, previous.done_op, nbytes) + self.benefit(
                previous.return_op, return_op, nbytes
            )
            if benefit <= 0:
                return None
            return _Option(tier, done_op, return_op, off_start, pre_start, benefit, w_s + r_s)
        if not self.tier_fits(tier, after + 1, before, nbytes):
            return None
        benefit = self.benefit(done_op, return_op, nbytes)
        if benefit <= 0:
            return None
        return _Option(tier, done_op, return_op, off_start, pre_start, benefit, w_s + r_s)

    def best_option(self, k: int, urgent: bool) -> _Option | None:
        """SSD first; host memory when the SSD link is saturated, i.e. its busy timeline leaves this
        interval a window that saves clearly less (under 90%) than the host link would."""
        ssd = self.option(k, "ssd", urgent)
        host = self.option(k, "host", urgent) if self.capacity["host"] > 0 else None
        if host is None or (ssd is not None and ssd.benefit >= 0.9 * host.benefit):
            return ssd
        return host

    def commit(self, k: int, opt: _Option, urgent: bool) -> Transfer:
        lt = self.lt
        b = int(lt.inactive_buffer[k])
        nbytes = int(self._nbytes[b])
        after, before = int(lt.inactive_after_op[k]), int(lt.inactive_before_op[k])
        returns = bool(lt.inactive_returns[k])
        write, read = self.links[f"{opt.tier}_write"], self.links[f"{opt.tier}_read"]
        w_s = write.duration_s(nbytes)
        r_s = read.duration_s(nbytes) if returns else 0.0
        write.reserve(opt.offload_start_s, opt.offload_start_s + w_s)
        if returns and opt.prefetch_start_s is not None:
            read.reserve(opt.prefetch_start_s, opt.prefetch_start_s + r_s)
        previous = self.chosen.get(k)
        if previous is None:
            spans = [(opt.done_op, opt.return_op)]
            for lo, hi in self.ranges(after + 1, before):
                self.tier_usage[opt.tier][lo:hi] += nbytes
            self.tier_peak[opt.tier] = float(self.tier_usage[opt.tier].max())
        else:
            spans = [(opt.done_op, previous.done_op), (previous.return_op, opt.return_op)]
        for a, z in spans:
            for lo, hi in self.ranges(a, z):
                self.usage[lo:hi] -= nbytes
        self._refresh_excess()
        return Transfer(
            buffer=b,
            nbytes=nbytes,
            category=self._category[b],
            tier=opt.tier,
            after_op=after,
            done_op=opt.done_op,
            return_op=opt.return_op,
            use_op=before if returns else None,
            urgent=urgent,
            offload_start_s=opt.offload_start_s,
            offload_end_s=opt.offload_start_s + w_s,
            prefetch_start_s=opt.prefetch_start_s,
            prefetch_end_s=None if opt.prefetch_start_s is None else opt.prefetch_start_s + r_s,
        )


def _greedy(state: _PlannerState, candidates: np.ndarray, urgent: bool) -> list[Transfer]:
    """Lazy greedy: benefits only shrink as memory is freed and links fill, so a stale score is an upper bound.

    In the urgent round an interval already taken may be widened to its whole idle
    window (the GPU then waits for its transfers); its benefit is the extra saving.
    """
    heap: list[tuple[float, int]] = []
    for k in candidates.tolist():
        opt = state.best_option(k, urgent)
        if opt is not None:
            heap.append((-opt.score, k))
    heapq.heapify(heap)
    done = set()
    while heap and state.over_ops.size:
        _, k = heapq.heappop(heap)
        if k in done:
            continue
        opt = state.best_option(k, urgent)
        if opt is None:
            continue
        if heap and opt.score < -heap[0][0] * (1 - 1e-9):
            heapq.heappush(heap, (-opt.score, k))
            continue
        state.chosen[k] = state.commit(k, opt, urgent)
        done.add(k)
    return list(state.chosen.values())


def stall_padding_s(excess_bytes: np.ndarray, phase: np.ndarray, bytes_per_s: float) -> np.ndarray:
    """Planned stall per op for the ops still over budget: per run of consecutive over-budget ops of
    one phase, the run's max excess / `bytes_per_s` in all, spread in proportion to each op's excess."""
    pad = np.zeros(excess_bytes.size)
    over = excess_bytes > 0
    if not over.any() or bytes_per_s <= 0:
        return pad
    label = np.where(over, 1 + phase.astype(np.int64), 0)
    edges = np.flatnonzero(np.diff(np.concatenate([[0], label, [0]])) != 0)
    for a, z in zip(edges[:-1].tolist(), edges[1:].tolist()):
        if over[a]:
            run = excess_bytes[a:z]
            pad[a:z] = run / run.sum() * run.max() / bytes_per_s
    return pad


def _stretched(lt: Lifetimes, pad_s: np.ndarray) -> Lifetimes:
    durations = lt.op_durations_s + pad_s
    return replace(lt, op_durations_s=durations, op_start_s=np.concatenate([[0.0], np.cumsum(durations)]))


def _plan_round(trace: Trace, lt: Lifetimes, hardware: Hardware, budget_bytes: int,
                candidates: np.ndarray, categories: list[str]) -> tuple[list[Transfer], np.ndarray, np.ndarray]:
    """One greedy pass (overlapped, then urgent): transfers, excess left after the overlapped
    pass, and the planned device bytes per op."""
    state = _PlannerState(lt, hardware, budget_bytes)
    state._nbytes = trace.buffers["nbytes"]
    state._category = categories
    transfers = _greedy(state, candidates, urgent=False)
    excess_left = state.excess.copy()
    if state.excess.any():
        # Nothing overlapped is left that helps: let the GPU wait for the rest.
        transfers = _greedy(state, candidates, urgent=True)
    return transfers, excess_left, state.usage.copy()


def default_budget_bytes(hardware: Hardware) -> int:
    """Device capacity less what never reaches PyTorch's allocator (CUDA context, cuBLAS workspace):
    the budget `plan_offload` and `evaluate.evaluate` use when none is given."""
    gpu = hardware.gpu
    return int(gpu.capacity_bytes - gpu.context_bytes() - gpu.cublas_workspace_bytes)


def _candidate_intervals(trace: Trace, lt: Lifetimes, min_nbytes: int,
                         categories: tuple[str, ...]) -> tuple[np.ndarray, list[str]]:
    """(the inactive intervals the greedy may take: of buffers of `categories` of at least
    `min_nbytes`; every buffer's category name)."""
    unknown = sorted(set(categories) - set(CANDIDATE_CATEGORIES))
    if unknown:
        raise UserError(f"cannot offload {', '.join(unknown)}: choose among {', '.join(CANDIDATE_CATEGORIES)}")
    names = {v: k for k, v in CATEGORY.items()}
    category_names = [names[int(c)] for c in trace.buffers["category"]]
    allowed = np.isin(trace.buffers["category"], [CATEGORY[c] for c in categories])
    big = trace.buffers["nbytes"] >= min_nbytes
    return np.flatnonzero((allowed & big)[lt.inactive_buffer]), category_names


def _stream_bytes_per_s(links: dict[str, float], hardware: Hardware) -> float:
    """The bandwidth at which the links stream a buffer out and back: SSD plus host memory (when
    the hardware has some), the slower of the read and write directions."""
    use_host = hardware.host_capacity_bytes > 0
    return min(
        links["ssd_read"] + (links["host_read"] if use_host else 0.0),
        links["ssd_write"] + (links["host_write"] if use_host else 0.0),
    )


def _round_plan(transfers: list[Transfer], usage: np.ndarray, lt: Lifetimes, hardware: Hardware,
                budget_bytes: int, pad: np.ndarray) -> OffloadPlan:
    """The plan of one greedy round, before its tensor schedule and validation."""
    peak_after = int(usage.max())
    return OffloadPlan(
        transfers=sorted(transfers, key=lambda t: (t.after_op, t.buffer)),
        budget_bytes=int(budget_bytes),
        num_ops=lt.num_ops,
        ideal_step_s=lt.step_s,
        peak_bytes_before=int(lt.op_bytes.max()),
        peak_bytes_after=peak_after,
        feasible=peak_after <= budget_bytes,
        plan_elapsed_s=0.0,
        hardware=hardware.to_json(),
        planned_stall_s=float(pad.sum()),
    )


def plan_lifetimes(
    trace: Trace,
    lt: Lifetimes,
    hardware: Hardware,
    budget_bytes: int,
    *,
    min_nbytes: int = 1 << 20,
    categories: tuple[str, ...] = CANDIDATE_CATEGORIES,
    max_rounds: int = 24,
    patience: int = 4,
) -> OffloadPlan:
    """Plan offloads of `trace` with lifetimes `lt` so device memory stays within `budget_bytes`.

    Up to `max_rounds` greedy rounds, each on the op timeline stretched by the planned
    stalls of the rounds before (see the module docstring), ending early after `patience`
    rounds in a row that do not beat the fastest so far; the fastest in simulation wins.
    """
    t0 = time.perf_counter()
    if budget_bytes <= 0:
        raise UserError(f"the device-memory budget must be positive, not {budget_bytes}")
    candidates, category_names = _candidate_intervals(trace, lt, min_nbytes, categories)
    links = hardware.link_bytes_per_s()
    stream_bytes_per_s = _stream_bytes_per_s(links, hardware)
    pad = np.zeros(lt.num_ops)
    best: OffloadPlan | None = None
    best_step_s = math.inf
    rounds: list[dict[str, float]] = []
    stale = 0  # rounds since the fastest so far
    for _ in range(max(1, max_rounds)):
        transfers, excess_left, usage = _plan_round(
            trace, _stretched(lt, pad), hardware, budget_bytes, candidates, category_names
        )
        candidate = _round_plan(transfers, usage, lt, hardware, budget_bytes, pad)
        sim = simulate_offload_plan(lt, candidate, links)
        step_s = sim.step_s
        rounds.append({"planned_stall_s": float(pad.sum()), "urgent": float(sum(t.urgent for t in transfers)),
                       "simulated_step_s": step_s})
        if best is None or (candidate.feasible, -step_s) > (best.feasible, -best_step_s * (1 - 1e-6)):
            best, best_step_s, stale = candidate, step_s, 0
        else:
            stale += 1
            if stale >= patience:
                break
        if not excess_left.any() and sim.stall_s <= 1e-9 * lt.step_s:
            break  # the overlapped transfers fit and nothing waits: the ideal step
        # The next round plans on the timeline this one produced: each op's planned stall
        # moves halfway to the stall the simulation measured before it (damped, so the
        # rounds do not swing between over- and under-padding), plus planned stalls for
        # the memory the overlapped greedy left over budget.
        assert sim.op_stall_s is not None
        pad = 0.5 * (pad + sim.op_stall_s) + stall_padding_s(excess_left, trace.ops["phase"], stream_bytes_per_s)
    assert best is not None
    best.rounds = rounds
    best.tensors = tensor_schedule(trace, best.transfers, lt.num_ops)
    validate_plan(trace, best)
    best.plan_elapsed_s = time.perf_counter() - t0
    return best


def plan_offload(
    trace: Trace,
    hardware: Hardware,
    budget: int | str | None = None,
    *,
    op_durations_s: np.ndarray | None = None,
    min_nbytes: int = 1 << 20,
    categories: tuple[str, ...] = CANDIDATE_CATEGORIES,
) -> OffloadPlan:
    """`memplan.offload.plan_offload(trace, hardware, budget=...)`: a validated TERAIO-style plan.

    `budget` defaults to `default_budget_bytes(hardware)`. Op times default to the roofline of
    `hardware.gpu`.
    """
    if budget is None:
        budget_bytes = default_budget_bytes(hardware)
    else:
        budget_bytes = parse_size(budget) if isinstance(budget, str) else int(budget)
    if op_durations_s is None:
        op_durations_s = op_seconds(trace, hardware.gpu)
    lt = analyse_lifetimes(trace, op_durations_s)
    return plan_lifetimes(trace, lt, hardware, budget_bytes, min_nbytes=min_nbytes, categories=categories)
