"""Event-driven simulator of a training step with offloading: one compute stream plus transfer links.

The compute stream runs the trace's ops in order with their durations. Every link
(`ssd_write`, `ssd_read`, `host_write`, `host_read`, and any a baseline adds) serves
its transfers first-come first-served at its bandwidth. A `Move` is issued at the
start or the end of an op; it can change device memory when issued (a prefetch
reserves its bytes) and when it completes (an offload frees them), and an op can wait
for it (a prefetch must land before the op that uses it). Before an op starts, device
memory must fit the budget: the stream waits for pending offloads to complete, and if
that is not enough the op runs over budget and the overshoot is reported.

The step repeats: the simulator runs `iterations` steps back to back (moves whose
ops fall in the next iteration carry over) and reports the last one, the steady
state. Outputs: step time, stall time, peak device memory, per-link utilisation.

The baselines of TERAIO's evaluation (arXiv 2506.06472, §5) are built as moves and
op-time changes in `baselines.py` and run through this same simulator.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from memplan.offload.plan_file import OffloadPlan


@dataclass(frozen=True)
class Move:
    """One periodic transfer. Op indices may reach into the next iteration (>= num_ops)."""

    link: str | None  # None: instantaneous (only a memory change)
    nbytes: int
    issue_op: int
    issue_at_end: bool
    wait_op: int | None = None  # this op cannot start before the move completes
    device_delta_on_issue: int = 0
    device_delta_on_complete: int = 0
    key: int | None = None  # names this move so that another can follow it
    after_key: int | None = None  # starts only once the move named so (same iteration) completed


@dataclass
class OffloadSim:
    """The steady-state step of one simulation (`simulate_offload`)."""

    step_s: float
    stall_s: float
    peak_device_bytes: int
    over_budget_bytes: int  # 0 when the budget held at every op
    link_utilisation: dict[str, float] = field(default_factory=dict)
    op_stall_s: np.ndarray | None = None  # seconds each op of the reported step waited before it started

    @property
    def within_budget(self) -> bool:
        return self.over_budget_bytes == 0

    def to_json(self) -> dict[str, Any]:
        return {
            "step_s": self.step_s,
            "stall_s": self.stall_s,
            "peak_device_bytes": self.peak_device_bytes,
            "over_budget_bytes": self.over_budget_bytes,
            "link_utilisation": self.link_utilisation,
        }


def _unrolled_moves(moves: list[Move], n: int, iterations: int) -> tuple[dict[int, list[Move]], dict[int, list[Move]], int]:
    """The periodic `moves` placed on `iterations` steps of `n` ops: (moves issued at the start of
    each global op, at its end, and the device bytes of moves that completed before the first op)."""
    total = iterations * n
    at_start: dict[int, list[Move]] = {}
    at_end: dict[int, list[Move]] = {}
    initial_delta = 0
    for m in moves:
        for k in range(-2, iterations):
            g = m.issue_op + k * n
            if g >= total:
                continue
            if g < 0:
                # issued (and, being periodic, completed) before the first simulated op,
                # unless its wait lands in the simulated window: then it is still in flight
                wait = None if m.wait_op is None else m.wait_op + k * n
                if wait is not None and wait >= 0:
                    at_start.setdefault(0, []).append(
                        Move(m.link, m.nbytes, 0, False, wait, m.device_delta_on_issue, m.device_delta_on_complete)
                    )
                else:
                    initial_delta += m.device_delta_on_issue + m.device_delta_on_complete
                continue
            shifted = Move(
                m.link, m.nbytes, g, m.issue_at_end, None if m.wait_op is None else m.wait_op + k * n,
                m.device_delta_on_issue, m.device_delta_on_complete,
                None if m.key is None else m.key * (iterations + 3) + k + 2,
                None if m.after_key is None else m.after_key * (iterations + 3) + k + 2,
            )
            (at_end if m.issue_at_end else at_start).setdefault(g, []).append(shifted)
    return at_start, at_end, initial_delta


class _Links:
    """The links' FIFO queues and the device bytes the moves in flight hold or will free."""

    def __init__(self, link_bytes_per_s: dict[str, float], initial_delta: int) -> None:
        self.link_bytes_per_s = link_bytes_per_s
        self.link_free = dict.fromkeys(link_bytes_per_s, 0.0)
        self.busy: dict[str, list[tuple[float, float]]] = {name: [] for name in link_bytes_per_s}
        self.waits: dict[int, float] = {}
        self.completed: dict[int, float] = {}
        self.pending: list[tuple[float, int]] = []  # (completion time, device delta) not yet applied
        self.delta = initial_delta

    def issue(self, m: Move, t: float) -> None:
        if m.after_key is not None:
            t = max(t, self.completed.get(m.after_key, 0.0))
        if m.link is None:
            done = t
        else:
            bw = self.link_bytes_per_s[m.link]
            start = max(t, self.link_free[m.link])
            done = start + m.nbytes / bw
            self.link_free[m.link] = done
            self.busy[m.link].append((start, done))
        if m.key is not None:
            self.completed[m.key] = done
        self.delta += m.device_delta_on_issue
        if m.device_delta_on_complete:
            heapq.heappush(self.pending, (done, m.device_delta_on_complete))
        if m.wait_op is not None:
            self.waits[m.wait_op] = max(self.waits.get(m.wait_op, 0.0), done)

    def apply_until(self, t: float) -> None:
        while self.pending and self.pending[0][0] <= t:
            self.delta += heapq.heappop(self.pending)[1]

    def ready_s(self, g: int, op_bytes: int, now: float, budget_bytes: float) -> float:
        """When global op `g` (of `op_bytes` device bytes, nothing moved) can start: after the moves
        it waits for, and after offloads in flight until it fits `budget_bytes` (when they can)."""
        ready = max(now, self.waits.pop(g, 0.0))
        self.apply_until(ready)
        while op_bytes + self.delta > budget_bytes and self.pending:
            t_done, d = self.pending[0]
            if d >= 0 and all(x[1] >= 0 for x in self.pending):
                break
            heapq.heappop(self.pending)
            self.delta += d
            ready = max(ready, t_done)
            self.apply_until(ready)
        return ready

    def utilisation(self, lo: float, hi: float) -> dict[str, float]:
        """Each link's busy fraction of [lo, hi)."""
        step = hi - lo
        util = {}
        for name, spans in self.busy.items():
            used = sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in spans)
            util[name] = used / step if step > 0 else 0.0
        return util


def simulate_offload(
    op_durations_s: np.ndarray,
    op_bytes: np.ndarray,
    moves: list[Move],
    link_bytes_per_s: dict[str, float],
    budget_bytes: float = float("inf"),
    *,
    iterations: int = 3,
) -> OffloadSim:
    """Run `iterations` steps; report the last. `op_bytes[i]`: device bytes during op i, nothing moved."""
    n = int(len(op_durations_s))
    durations = np.asarray(op_durations_s, dtype=np.float64).tolist()
    base = np.asarray(op_bytes, dtype=np.int64).tolist()
    total = iterations * n
    at_start, at_end, initial_delta = _unrolled_moves(moves, n, iterations)
    links = _Links(link_bytes_per_s, initial_delta)
    now = 0.0
    stall = 0.0
    peak = 0
    over = 0
    iter_start = [0.0] * (iterations + 1)
    stall_at_iter = [0.0] * (iterations + 1)
    op_stall = np.zeros(n)
    for g in range(total):
        i = g % n
        if i == 0:
            iter_start[g // n] = now
            stall_at_iter[g // n] = stall
        for m in at_start.get(g, ()):
            links.issue(m, now)
        ready = links.ready_s(g, base[i], now, budget_bytes)
        mem = base[i] + links.delta
        peak = max(peak, mem)
        over = max(over, int(mem - budget_bytes)) if mem > budget_bytes else over
        stall += ready - now
        if g >= total - n:
            op_stall[i] = ready - now
        now = ready + durations[i]
        for m in at_end.get(g, ()):
            links.issue(m, now)
    iter_start[iterations] = now
    stall_at_iter[iterations] = stall
    lo, hi = iter_start[iterations - 1], iter_start[iterations]
    return OffloadSim(
        step_s=hi - lo,
        stall_s=stall_at_iter[iterations] - stall_at_iter[iterations - 1],
        peak_device_bytes=int(peak),
        over_budget_bytes=int(over),
        link_utilisation=links.utilisation(lo, hi),
        op_stall_s=op_stall,
    )


def plan_moves(plan: OffloadPlan) -> list[Move]:
    """The moves that carry out an offload plan (urgent offloads hold the next op until done)."""
    moves: list[Move] = []
    for key, t in enumerate(plan.transfers):
        # a buffer freed while away cannot be freed before its write completes
        wait = t.done_op if t.urgent else (t.return_op if t.use_op is None else None)
        moves.append(
            Move(f"{t.tier}_write", t.nbytes, t.after_op, True, wait_op=wait,
                 device_delta_on_complete=-t.nbytes, key=key)
        )
        if t.use_op is not None:
            moves.append(
                Move(f"{t.tier}_read", t.nbytes, t.return_op, False, wait_op=t.use_op,
                     device_delta_on_issue=t.nbytes, after_key=key)
            )
        else:
            # freed while away: the trace's own free drops it from op_bytes, so give back the saving
            moves.append(Move(None, 0, t.return_op, False, device_delta_on_issue=t.nbytes))
    return moves


def simulate_offload_plan(lifetimes: Any, plan: OffloadPlan, link_bytes_per_s: dict[str, float],
                          iterations: int = 3) -> OffloadSim:
    """Simulate `plan` on the ops and bytes of `lifetimes` (from `lifetimes.analyse_lifetimes`)."""
    return simulate_offload(
        lifetimes.op_durations_s, lifetimes.op_bytes, plan_moves(plan), link_bytes_per_s,
        plan.budget_bytes, iterations=iterations,
    )
