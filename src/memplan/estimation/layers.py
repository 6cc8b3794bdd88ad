"""A deep model's peaks extrapolated region by region from its traces at k and k+1 blocks.

Used where a call is traced twice rather than unrolled: `memplan generate` (a decode
loop's regions, `memplan.inference.generate`) and RL's no-gradient passes
(`memplan.rl.passes`). A training step is unrolled to its full depth instead
(`memplan.estimation.unroll`), so its figures come from one full-depth view.

Method (memplan's own; docs/estimation.md, "Deep models"): the step of a model with `k` blocks and
the step of the same model with `k + 1` blocks differ by one block's worth of events,
in every phase. memplan traces both with k = 3, so that a middle block with a block
on each side exists in both (the first block can differ from the others, e.g. its
input needs no gradient under LoRA; the last one prefetches nothing under FSDP), and
cuts each trace into
**regions**: maximal runs of events with the same (phase, micro-batch, inside-a-block)
key, recompute counted as backward, so that a block's forward ops form one region and
the whole backward through the blocks another. Both traces have the same regions; in
a region, every memory counter's maximum is a maximum of quantities linear in the
number of blocks whose maximiser sits at the same end of the block range (the first
block for backward with most activations still live, the last for forward), so it is
linear in the number of blocks itself. The full-depth value of each region's maximum
is extrapolated linearly from the two traces, and the peak is the maximum over
regions; the breakdown and phase come from the winning region's maximiser.

Assumptions: the blocks are identical (same class, same shapes), and ops outside
the blocks do not repeat per block. `check_regions` refuses the method (and the
caller traces the full depth) when the two traces' regions do not line up.
Validated against full-depth traces in tests/inference/test_generate.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from memplan.estimation.figures import (
    Counters,
    Figures,
    HostFigures,
    breakdown_of,
    breakdown_vector,
    host_at,
    host_series,
)
from memplan.trace import edit as trace_edit
from memplan.trace.model import PHASE, PHASES, Trace

PHASE_CLASS = {PHASE["forward"]: 0, PHASE["backward"]: 1, PHASE["recompute"]: 1,
               PHASE["optimizer"]: 2, PHASE["other"]: 3}


def block_pattern(blocks_path: str) -> re.Pattern[str]:
    """Matches module paths inside one block of the ModuleList at `blocks_path`."""
    tail = blocks_path.split(".")[-1]
    return re.compile(rf"(^|\.){re.escape(tail)}\.\d+(\.|$)")


@dataclass
class Regions:
    """Event regions of a trace: `keys[r]` and the event range `[starts[r], ends[r])`."""

    keys: list[tuple[int, int, bool]]
    starts: np.ndarray
    ends: np.ndarray


def regions(trace: Trace, pattern: re.Pattern[str]) -> Regions:
    """Cut the events into runs of equal (phase class, micro-batch, in-a-block) keys.

    Events outside any op (pre-existing allocations, frees after the last op) take the
    key of the nearest op before them, or (other, -1, False) at the start.
    """
    n = trace.num_events
    in_block_module = np.array([bool(pattern.search(m)) for m in trace.modules], bool)
    op = trace.events["op"]
    phase_class = np.array([PHASE_CLASS[int(p)] for p in range(len(PHASES))], np.int64)
    ev_phase = np.where(op >= 0, phase_class[trace.ops["phase"][np.maximum(op, 0)]], 3)
    ev_mb = np.where(op >= 0, trace.ops["microbatch"][np.maximum(op, 0)], -1)
    ev_block = np.where(op >= 0, in_block_module[trace.ops["module"][np.maximum(op, 0)]], False)
    ev_block = _module_less_ops_stay_in_their_region(trace, op, ev_block)
    # Optimizer ops have no module; they are one region per optimizer step.
    ev_block = ev_block & (ev_phase != 2)
    code = (ev_phase * 1_000_003 + (ev_mb + 1)) * 2 + ev_block.astype(np.int64)
    change = np.flatnonzero(np.diff(code)) + 1 if n else np.zeros(0, np.int64)
    starts = np.concatenate([[0], change]).astype(np.int64) if n else np.zeros(0, np.int64)
    ends = np.concatenate([change, [n]]).astype(np.int64) if n else np.zeros(0, np.int64)
    keys = [(int(ev_phase[s]), int(ev_mb[s]), bool(ev_block[s])) for s in starts.tolist()]
    return Regions(keys, starts, ends)


def _module_less_ops_stay_in_their_region(trace: Trace, op: np.ndarray, ev_block: np.ndarray) -> np.ndarray:
    """An op run in no module's forward or backward (module "") takes the in-a-block flag
    of the event before it: FSDP2's post-backward of a submodule sharded on its own (the
    experts of an EP layout) detaches and frees its gradients from autograd's hooks,
    between two blocks' backward, once per block; counted outside the blocks, each would
    open a region of its own, one more per block."""
    if not trace.modules or "" not in trace.modules:
        return ev_block
    no_module = np.where(op >= 0, trace.ops["module"][np.maximum(op, 0)] == trace.modules.index(""), False)
    if not no_module.any():
        return ev_block
    index = np.where(no_module, 0, np.arange(ev_block.shape[0]))
    np.maximum.accumulate(index, out=index)
    return np.where(no_module & (index > 0), ev_block[index], ev_block)


def check_regions(a: Regions, b: Regions) -> bool:
    """Whether two traces (k and k+1 blocks) have the same region sequence."""
    return a.keys == b.keys


@dataclass
class RegionPeaks:
    """Per region: the maximum of one counter series and the event where it is first reached."""

    values: np.ndarray
    events: np.ndarray


def region_peaks(series: np.ndarray, reg: Regions) -> RegionPeaks:
    values = np.zeros(len(reg.keys), np.int64)
    events = np.zeros(len(reg.keys), np.int64)
    for r, (s, e) in enumerate(zip(reg.starts.tolist(), reg.ends.tolist())):
        window = series[s:e]
        if window.shape[0] == 0:
            values[r], events[r] = 0, s
            continue
        i = int(np.argmax(window))
        values[r], events[r] = int(window[i]), s + i
    return RegionPeaks(values, events)


def extrapolate(value_k: np.ndarray | float, value_k1: np.ndarray | float, k: int, layers: int) -> np.ndarray:
    """Linear extrapolation from k and k+1 blocks to `layers` blocks."""
    a = np.asarray(value_k, dtype=np.float64)
    b = np.asarray(value_k1, dtype=np.float64)
    return a + (layers - k) * (b - a)


def figures_extrapolated(pair: tuple[Trace, Trace], counters: tuple[Counters, Counters],
                         pattern: re.Pattern[str], k: int, target_layers: int) -> Figures | None:
    """Peaks at `target_layers` blocks from traces at k and k+1 blocks (None: regions differ)."""
    reg = [regions(t, pattern) for t in pair]
    if not check_regions(*reg):
        return None
    alloc = [region_peaks(c.allocated, r) for c, r in zip(counters, reg)]
    resv = [region_peaks(c.reserved, r) for c, r in zip(counters, reg)]
    alloc_full = extrapolate(alloc[0].values, alloc[1].values, k, target_layers)
    resv_full = extrapolate(resv[0].values, resv[1].values, k, target_layers)
    win = int(np.argmax(alloc_full))
    vectors = [breakdown_vector(trace_edit.without_host(t), int(a.events[win]), c.charged_nbytes)
               for t, a, c in zip(pair, alloc, counters)]
    vector = extrapolate(vectors[0], vectors[1], k, target_layers)
    peak = float(alloc_full[win])
    # The caching allocator's slack (reserved - allocated) does not grow linearly with
    # depth (segments are reused across blocks): keep the deeper trace's slack on top of
    # the extrapolated allocated peak, unless the linear reserved figure is larger.
    slack = float(counters[1].reserved.max() - counters[1].allocated.max())
    reserved = max(float(resv_full.max()), peak + slack)
    return Figures(int(round(peak)), int(round(reserved)), breakdown_of(vector, peak),
                   pair[1].phase_at(int(alloc[1].events[win])), _host_extrapolated(pair, reg, k, target_layers),
                   peak_events=(int(alloc[0].events[win]), int(alloc[1].events[win])))


def _host_extrapolated(pair: tuple[Trace, Trace], reg: list[Regions], k: int, target_layers: int) -> HostFigures:
    """The host figures at `target_layers` blocks, region by region as the device's."""
    series = [host_series(t) for t in pair]
    peaks = [region_peaks(s.sum(axis=0), r) for s, r in zip(series, reg)]
    full = extrapolate(peaks[0].values, peaks[1].values, k, target_layers)
    if not full.shape[0]:
        return HostFigures()
    win = int(np.argmax(full))
    by_kind = extrapolate(series[0][:, int(peaks[0].events[win])], series[1][:, int(peaks[1].events[win])],
                          k, target_layers)
    return host_at(by_kind)
