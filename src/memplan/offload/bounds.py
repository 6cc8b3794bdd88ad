"""A lower bound on the step time of any offload plan in memplan's model, from link bandwidths.

In memplan's model a buffer can be away during op p only if one of its inactive
intervals (`lifetimes.analyse_lifetimes`) covers p, and each away buffer lowers the op's device
bytes by exactly its size; so the buffers away at p are drawn from those candidates
and hold at least `op_bytes[p] - budget` bytes (the bytes the op's own inputs and
outputs need stay). Two consequences, on disjoint stretches of time:

- **writes before p**: a buffer last written at op w (its allocation, or an in-place
  update such as an optimizer step) and away at p was written out between the end of w
  and the start of p: its copy elsewhere is stale until then. Take the k candidates
  written most recently: of the bytes that must be away, all but those of the other
  candidates are among them, crossed the write links in the window since the oldest of
  those writes, so that window lasts at least (those bytes) / write bandwidth, and the
  GPU stalled in it for at least that less the window's compute;
- **reads after p**: a buffer away at p and used again comes back before that use. Take
  the k candidates needed again soonest: the same argument after p (candidates freed
  without another use never come back).

Each window spans at most one step; the step is periodic, so a window's stall is stall of
one step. A write window and a read window around the same op add up when together with
that op they span at most one step's compute (disjoint arcs of the step); otherwise only
the larger counts. The bound is the ideal compute plus the largest such stall over the ops
of highest demand. Buffers the trace never writes (an input batch) may stay on the SSD from one step
to the next and do not count on the write side. SSD and host links count at their combined
bandwidth (host memory only when the hardware has some); capacities are ignored. The bound
holds for memplan's model (a buffer written while on the device is written out whole on
every offload) and says how close a plan is to the best any plan could do on those links.
"""

from __future__ import annotations

import numpy as np

from memplan.hardware.links import Hardware
from memplan.offload.lifetimes import Lifetimes
from memplan.trace.model import Trace


def _window_stalls(spans_s: np.ndarray, nbytes: np.ndarray, budget: float,
                   bytes_per_s: float) -> tuple[np.ndarray, np.ndarray]:
    """(span of each window, least stall in it), windows growing with k: the k buffers of the
    shortest spans, whose bytes less `budget` must cross a link of `bytes_per_s` within
    the k-th span of compute."""
    order = np.argsort(spans_s, kind="stable")
    spans = spans_s[order]
    excess = np.cumsum(nbytes[order].astype(np.float64)) - budget
    if bytes_per_s > 0:
        return spans, excess / bytes_per_s - spans
    return spans, np.where(excess > 0, np.inf, -spans)


def _combined_stall_s(write: tuple[np.ndarray, np.ndarray], read: tuple[np.ndarray, np.ndarray],
                      gap_s: float, step_s: float) -> float:
    """The most stall one step must hold: a write window, a read window, or both when the two,
    with the op between them (`gap_s`), fit in one step's compute (they are then disjoint arcs
    of the periodic step, so their stalls add)."""
    (w_span, w_stall), (r_span, r_stall) = write, read
    best = max(0.0, float(w_stall.max(initial=0.0)), float(r_stall.max(initial=0.0)))
    if w_span.size and r_span.size:
        w_best = np.maximum.accumulate(w_stall)  # best write stall within each span
        room = step_s - gap_s - r_span  # the write span each read window leaves
        k = np.searchsorted(w_span, room, side="right") - 1
        ok = k >= 0
        if ok.any():
            best = max(best, float((r_stall[ok] + w_best[k[ok]]).max()))
    return best


def step_lower_bound_s(trace: Trace, lt: Lifetimes, hardware: Hardware, budget_bytes: int,
                       *, top_ops: int = 64) -> float:
    """Seconds no offload plan of `trace` within `budget_bytes` can beat on `hardware`'s links
    (see the module docstring); `lt.step_s` when the budget holds the peak."""
    n = lt.num_ops
    step = lt.step_s
    start = lt.op_start_s
    links = hardware.link_bytes_per_s()
    use_host = hardware.host_capacity_bytes > 0
    write_bw = links["ssd_write"] + (links["host_write"] if use_host else 0.0)
    read_bw = links["ssd_read"] + (links["host_read"] if use_host else 0.0)
    budget = float(budget_bytes)
    over = np.flatnonzero(lt.op_bytes > budget)
    if over.size == 0:
        return step
    demand = over[np.argsort(-lt.op_bytes[over], kind="stable")[:top_ops]]

    nbytes = trace.buffers["nbytes"]
    # (buffer, op) of every write, sorted, keyed so one searchsorted finds a buffer's last write <= p
    outs = trace.csr["op_outputs"]
    out_op = np.repeat(np.arange(n), np.diff(trace.csr["op_outputs_ptr"]))
    key_span = 2 * n + 2
    wkey = np.unique(outs.astype(np.int64) * key_span + out_op)
    wbuf, wop = wkey // key_span, wkey % key_span
    last_write = np.full(trace.num_buffers, -1, np.int64)
    last_write[wbuf] = wop  # ascending keys: the last assignment per buffer is its last write
    inactive_b, after_op, before_op = lt.inactive_buffer, lt.inactive_after_op, lt.inactive_before_op
    worst = 0.0
    for p in demand.tolist():
        # the buffers that may be away at op p: an inactive interval covers it (this
        # iteration's p or, for an interval that wraps, the next iteration's)
        now = (after_op < p) & (p < before_op)
        covers = now | ((after_op < p + n) & (p + n < before_op))
        cand = inactive_b[covers]
        cand_next = np.where(now[covers], before_op[covers], before_op[covers] - n)  # the next use, after p
        # of the candidates' bytes, at most this many may stay on the device
        room = budget - (float(lt.op_bytes[p]) - float(nbytes[cand].sum()))
        # write side: the candidates written at some op, by the compute time since their last write
        written = cand[last_write[cand] >= 0]
        i = np.searchsorted(wkey, written * key_span + p, side="right") - 1
        mine = (i >= 0) & (wbuf[np.maximum(i, 0)] == written)
        w = np.where(mine, wop[np.maximum(i, 0)], last_write[written] - n)  # else: last step's last write
        ages = np.maximum(start[p] - (np.floor_divide(w + 1, n) * step + start[(w + 1) % n]), 0.0)
        before = _window_stalls(ages, nbytes[written], room, write_bw)
        # read side: the candidates used again, by the compute time until that use
        back = lt.inactive_returns[covers]
        nxt = cand_next[back]
        leads = np.maximum((nxt // n) * step + start[nxt % n] - start[p + 1], 0.0)
        after = _window_stalls(leads, nbytes[cand[back]], room, read_bw)
        worst = max(worst, _combined_stall_s(before, after, float(lt.op_durations_s[p]), step))
    return step + worst
