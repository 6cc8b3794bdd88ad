"""`memplan.plan_addresses(trace)`: a periodic static address plan of a training step,
after STWeaver/STAlloc.

STWeaver (arXiv 2507.16274, EuroSys '26; code infinigence/STAlloc) plans the
allocations of the first iterations ahead and replays iteration 1's plan for every
later one. This module follows its structure:

1. **Window.** The prologue (buffers that exist before iteration 0, such as weights),
   iteration 0 and iteration 1 (the *periodic* iteration L) are planned; later
   iterations replay L's offsets. Time is the trace's event axis, cut at the end of L.
   A buffer of L that is still live when L+1 starts *wraps*: in the periodic replay
   it overlaps the start of the next period, so it gets a second piece at the start of
   L (its free time is read from iteration L+1 of the trace, or from L-1's buffer at the
   same request index when the trace ends with L).
2. **Fixed regions.** Buffers live over the whole periodic window (weights, gradients
   and optimizer states that persist) are stacked at the bottom of the arena:
   parameters, gradients, optimizer states, then the rest, in allocation order.
3. **Cross-phase groups.** Activations allocated in one phase of a micro-batch and
   freed in another are grouped by (iteration, micro-batch, phase -> phase); a group is
   packed on its own and placed as one rigid unit (`_cross_phase_groups`,
   `_staircase_layout`).
4. **The rest into the gaps** by greedy-by-size best fit (`memplan.layout.greedy`).
   The planner also packs everything without groups and keeps the lowest of the
   layouts it tries (`_best_layout`), as STAlloc tries more than one algorithm and
   keeps the smaller. When the rest is small enough (`EXACT_MAX_ITEMS`) and the
   compiled exact search is available, it also asks the offset-order search
   (`memplan.layout.exact`, minimalloc's branching) for a packing at the rest's live
   lower bound, then halfway to the best heuristic height (docs/layout.md has the
   heights each layout reaches).
5. **Dynamic reusable space.** Requests whose size differs between iterations at the
   same request index (MoE routing, variable sequence lengths) are not given offsets;
   their largest size is still reserved in the layout, and for each such request the
   plan lists the arena ranges that no planned buffer uses during its lifetime.

Sizes are rounded up to `alignment_bytes`: by default 512, the caching allocator's
`kMinBlockSize` (c10/cuda/CUDACachingAllocator.cpp, `round_size`). It stays a
parameter here, below `memplan.alloc`, which owns that rule.
Every plan passes the independent validator (`memplan.layout.validate`) before it
is returned. Assumes a validated trace of one device.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from memplan.errors import UserError
from memplan.layout import native
from memplan.layout.exact import FOUND, solve_exact
from memplan.layout.greedy import greedy_by_size, greedy_shapes
from memplan.layout.plan import (
    PROLOGUE,
    AddressPlan,
    DynamicWindow,
    IterationPlan,
    requests_by_group,
    trace_fingerprint,
)
from memplan.layout.validate import check_offsets
from memplan.trace.edit import device_view
from memplan.trace.model import CATEGORY, PHASE, Trace

log = logging.getLogger(__name__)

_FIXED_ORDER = [CATEGORY["parameter"], CATEGORY["gradient"], CATEGORY["optimizer_state"]]

# The exact search keeps, per buffer, the list of buffers live at the same time:
# quadratic memory on long traces, so it is tried only on rests up to this size.
EXACT_MAX_ITEMS = 8000
EXACT_LIMIT_S = 5.0


def plan_addresses(
    trace: Trace,
    *,
    alignment_bytes: int = 512,
    periodic_iteration: int | None = None,
    device: str | None = None,
    search_s: float = 20.0,
) -> AddressPlan:
    """A periodic STWeaver address plan for `trace`'s allocations (see the module docstring).

    Only one device is planned: buffers of other devices (and cpu) count as zero bytes,
    exactly as `memplan.replay` views the trace (`device` picks one when it has several).
    """
    start = time.monotonic()
    trace = device_view(trace, device)
    if alignment_bytes <= 0 or alignment_bytes & (alignment_bytes - 1):
        raise UserError(f"alignment {alignment_bytes} must be a power of two")
    window = _periodic_window(trace, periodic_iteration, alignment_bytes)
    pieces = _lifetime_pieces(trace, window)
    offsets, fixed_bytes = _fixed_regions(trace, window, pieces.fixed)

    # -- the rest: with cross-phase groups as units, and without; keep the lower --------
    item_ids = np.asarray(pieces.items, np.int64)
    plo = np.asarray(pieces.lo, np.int64)
    phi = np.asarray(pieces.hi, np.int64)
    pitem = np.asarray(pieces.item, np.int64)
    sizes = window.reserve[item_ids] if item_ids.size else np.zeros(0, np.int64)
    t0 = time.monotonic()
    chosen, method, groups_used, tried = _best_layout(
        trace, item_ids, plo, phi, pitem, sizes, alignment_bytes, fixed_bytes, search_s
    )
    plain_height = tried.get("greedy by size", fixed_bytes)
    greedy_s = time.monotonic() - t0
    is_twin = np.zeros(item_ids.shape[0], bool)
    is_twin[[k for _, k in pieces.twins]] = True
    offsets[item_ids[~is_twin]] = chosen[~is_twin]

    checked = _checked_layout(window, pieces.fixed, item_ids, plo, phi, pitem, chosen, offsets, alignment_bytes)
    entries, dynamic = _iteration_entries(trace, window, pieces.twins, offsets)
    windows = _dynamic_windows(
        window.groups, window.last, dynamic, window.alloc, window.free, window.window_end,
        checked.lo, checked.hi, checked.owner, checked.offset, window.reserve, checked.height,
    )  # fmt: skip
    elapsed = time.monotonic() - start
    result = AddressPlan(
        trace_fingerprint=trace_fingerprint(trace, window.planned),
        arena_bytes=checked.height,
        alignment_bytes=alignment_bytes,
        iterations=entries,
        lower_bound_bytes=checked.lower_bound,
        dynamic_space=windows,
        stats={
            "method": method,
            "fixed_bytes": fixed_bytes,
            "fixed_buffers": len(pieces.fixed),
            "planned_buffers": len(pieces.items) + len(pieces.fixed),
            "dynamic_requests": int(dynamic.size) - len(pieces.twins),
            "twin_slots": len(pieces.twins),
            "cross_phase_groups": groups_used,
            "greedy_height": plain_height,
            "layouts_tried": tried,
            "trace_peak_bytes": int(trace.peak()[0]),
            "packing_s": round(greedy_s, 3),
            "elapsed_s": round(elapsed, 3),
        },
    )
    log.info("plan: arena %d B, lower bound %d B, %s, %.2f s", checked.height, checked.lower_bound, method, elapsed)
    return result


@dataclass
class _Window:
    """Step 1's periodic window: the groups planned and each buffer's times and arena bytes."""

    groups: dict[int, np.ndarray]  # buffer ids of each group's requests, in allocation order
    last: int  # the periodic iteration (PROLOGUE when the trace has no iteration)
    planned: list[int]  # the groups planned: every group up to `last`
    nbytes: np.ndarray
    alloc: np.ndarray
    free: np.ndarray
    period_start: int  # the first event of iteration `last`
    window_end: int  # the first event of iteration `last + 1` (the trace's end without one)
    dynamic: np.ndarray  # request indices of `last` whose size differs in a later iteration
    reserve: np.ndarray  # per buffer: its arena bytes (the largest size of a dynamic request)


@dataclass
class _Pieces:
    """The buffers of the window as placement items, each with its lifetime pieces."""

    items: list[int] = field(default_factory=list)  # buffer id of each item
    lo: list[int] = field(default_factory=list)  # per piece: start, end and item
    hi: list[int] = field(default_factory=list)
    item: list[int] = field(default_factory=list)
    fixed: list[int] = field(default_factory=list)  # buffers live over the whole window
    twins: list[tuple[int, int]] = field(default_factory=list)  # (buffer, its twin item)


@dataclass
class _CheckedLayout:
    """Every piece of every planned buffer with its offset, after the independent check."""

    lo: np.ndarray
    hi: np.ndarray
    owner: np.ndarray
    offset: np.ndarray
    height: int
    lower_bound: int


def _periodic_window(trace: Trace, periodic_iteration: int | None, alignment_bytes: int) -> _Window:
    """Step 1: the groups to plan, where the period starts and ends, the dynamic requests."""
    groups = requests_by_group(trace)
    iterations = sorted(g for g in groups if g >= 0)
    if not groups:
        raise UserError("the trace has no allocations to plan")
    if periodic_iteration is None:
        last = min(iterations[-1], 1) if iterations else PROLOGUE
    else:
        if periodic_iteration not in iterations:
            raise UserError(f"iteration {periodic_iteration} is not in the trace (it has {iterations})")
        last = periodic_iteration
    planned = [g for g in groups if g <= last]
    nbytes = trace.buffers["nbytes"].astype(np.int64)
    alloc = trace.buffers["alloc_event"].astype(np.int64)
    free = trace.free_event_or_end()
    n_events = trace.num_events
    slot = -(-nbytes // alignment_bytes) * alignment_bytes
    if last >= 0:
        period_start = int(alloc[groups[last]].min())
        window_end = int(alloc[groups[last + 1]].min()) if (last + 1) in groups else n_events
    else:
        period_start, window_end = 0, n_events
    dynamic = _dynamic_indices(groups, nbytes, last)
    reserve = slot.copy()
    if last >= 0 and dynamic.size:
        later = [g for g in groups if g >= last]
        for j in dynamic.tolist():
            sizes = [int(slot[groups[g][j]]) for g in later if j < groups[g].shape[0]]
            reserve[groups[last][j]] = max(sizes)
    return _Window(groups, last, planned, nbytes, alloc, free, period_start, window_end, dynamic, reserve)


def _lifetime_pieces(trace: Trace, w: _Window) -> _Pieces:
    """Steps 1-2: each planned buffer as an item with its pieces in the window (a wrapping
    buffer has two), or as a fixed buffer when it is live over the whole window."""
    out = _Pieces()
    free_event = trace.buffers["free_event"]
    last, window_end, period_start = w.last, w.window_end, w.period_start
    for g in w.planned:
        for idx, buf in enumerate(w.groups[g].tolist()):
            if w.nbytes[buf] <= 0:
                continue
            a, f = int(w.alloc[buf]), int(w.free[buf])
            spans = []
            if g < last or last < 0:
                spans.append((a, min(f, window_end) if f <= window_end else window_end))
            else:
                spans.append((a, min(f, window_end)))
                if f > window_end or free_event[buf] < 0:
                    wrap_end = _wrap_end(trace, w.groups, last, idx, buf, period_start, window_end)
                    if wrap_end > period_start:
                        spans.append((period_start, wrap_end))
                    if a < wrap_end < window_end:
                        # Allocated again before the previous iteration's copy is freed (a
                        # batch replaced by the next one): one offset cannot serve both
                        # copies. A twin slot is reserved; the request takes whichever of
                        # the two is free, through the dynamic space. (A buffer never
                        # freed at all cannot be served every period: it is not twinned.)
                        out.twins.append((buf, -1))
            spans = _merge(spans)
            whole = spans[0][0] <= period_start and spans[-1][1] >= window_end and len(spans) == 1
            if whole and a < period_start and last >= 0:
                out.fixed.append(buf)
                continue
            copies = 2 if out.twins and out.twins[-1] == (buf, -1) else 1
            for copy in range(copies):
                k = len(out.items)
                out.items.append(buf)
                if copy:
                    out.twins[-1] = (buf, k)
                for lo, hi in spans:
                    if hi > lo:
                        out.lo.append(lo)
                        out.hi.append(hi)
                        out.item.append(k)
    return out


def _fixed_regions(trace: Trace, w: _Window, fixed: list[int]) -> tuple[np.ndarray, int]:
    """Step 2: the fixed buffers stacked from offset 0 (sorts `fixed` into that order).
    Returns (offset per buffer, -1 where not placed yet; the bytes they take)."""
    offsets = np.full(trace.num_buffers, -1, np.int64)
    category = trace.buffers["category"].astype(np.int64)
    rank = {c: i for i, c in enumerate(_FIXED_ORDER)}
    fixed.sort(key=lambda x: (rank.get(int(category[x]), len(rank)), int(w.alloc[x])))
    top = 0
    for buf in fixed:
        offsets[buf] = top
        top += int(w.reserve[buf])
    return offsets, top


def _checked_layout(
    w: _Window,
    fixed: list[int],
    item_ids: np.ndarray,
    plo: np.ndarray,
    phi: np.ndarray,
    pitem: np.ndarray,
    chosen: np.ndarray,
    offsets: np.ndarray,
    alignment_bytes: int,
) -> _CheckedLayout:
    """Every piece of every planned buffer through the independent validator."""
    fixed_ids = np.asarray(fixed, np.int64)
    all_hi = np.concatenate([phi, np.full(len(fixed), max(w.window_end, 1), np.int64)])
    fixed_lo = w.alloc[fixed_ids] if fixed_ids.size else np.zeros(0, np.int64)
    all_lo = np.concatenate([plo, fixed_lo])
    all_owner = np.concatenate([item_ids[pitem] if pitem.size else np.zeros(0, np.int64), fixed_ids])
    all_off = np.concatenate([chosen[pitem] if pitem.size else np.zeros(0, np.int64), offsets[fixed_ids]])
    height = check_offsets(all_lo, all_hi, w.reserve[all_owner], all_off, alignment=alignment_bytes)
    lower_bound = _live_peak(all_lo, all_hi, w.reserve[all_owner])
    return _CheckedLayout(all_lo, all_hi, all_owner, all_off, height, lower_bound)


def _iteration_entries(
    trace: Trace, w: _Window, twins: list[tuple[int, int]], offsets: np.ndarray
) -> tuple[list[IterationPlan], np.ndarray]:
    """Step 5: the plan's entries per group, dynamic requests (twins included) at -1;
    and the request indices of the periodic iteration that are dynamic."""
    groups, last, dynamic = w.groups, w.last, w.dynamic
    is_dynamic = np.zeros(trace.num_buffers, bool)
    if last >= 0 and dynamic.size:
        is_dynamic[groups[last][dynamic]] = True
    if twins:
        is_dynamic[[buf for buf, _ in twins]] = True
        position = np.full(trace.num_buffers, -1, np.int64)
        position[groups[last]] = np.arange(groups[last].shape[0])
        dynamic = np.union1d(dynamic, position[[buf for buf, _ in twins]])
    entries = []
    for g in w.planned:
        ids = groups[g]
        off = offsets[ids].copy()
        off[is_dynamic[ids]] = -1
        entries.append(IterationPlan(g, w.nbytes[ids].copy(), off))
    return entries, dynamic


def _merge(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    spans = sorted(s for s in spans if s[1] > s[0])
    out: list[tuple[int, int]] = []
    for lo, hi in spans:
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _wrap_end(trace: Trace, groups: dict, last: int, idx: int, buf: int, period_start: int, window_end: int) -> int:
    """Where, in the periodic window, a buffer of iteration `last` live past its end is freed."""
    f = int(trace.buffers["free_event"][buf])
    if f >= 0:
        return period_start + (f - window_end)
    prev = groups.get(last - 1)
    nbytes = trace.buffers["nbytes"]
    if prev is not None and idx < prev.shape[0] and nbytes[prev[idx]] == nbytes[buf]:
        f_prev = int(trace.buffers["free_event"][prev[idx]])
        if f_prev >= period_start:
            return f_prev  # freed at this point of the next period, as its predecessor was
    return window_end  # never freed: live over the whole period


def _dynamic_indices(groups: dict, nbytes: np.ndarray, last: int) -> np.ndarray:
    """Request indices of the periodic iteration whose size differs in a later iteration."""
    if last < 0 or last not in groups:
        return np.zeros(0, np.int64)
    base = nbytes[groups[last]]
    differs = np.zeros(base.shape[0], bool)
    for g, ids in groups.items():
        if g <= last:
            continue
        m = min(base.shape[0], ids.shape[0])
        differs[:m] |= nbytes[ids[:m]] != base[:m]
        differs[m:] |= ids.shape[0] < base.shape[0]
    return np.flatnonzero(differs)


def _best_layout(
    trace: Trace,
    item_ids: np.ndarray,
    plo: np.ndarray,
    phi: np.ndarray,
    pitem: np.ndarray,
    sizes: np.ndarray,
    alignment: int,
    base: int,
    search_s: float,
) -> tuple[np.ndarray, str, int, dict[str, int]]:
    """Several packings of the planned buffers; the lowest is kept (the first among equals).

    Tried in turn, while the time spent plus the last layout's time stays within
    `search_s`: greedy by size; greedy by area (bytes x lifetime); cross-phase groups
    as staircases among the buffers by size; the same groups first, in time order, so
    equal groups of a pipeline's micro-batches take turns in the same slots; the
    staircases among the buffers by area. Returns
    (offsets, method, groups used, height of each layout tried)."""
    n = item_ids.shape[0]
    if n == 0:
        return np.zeros(0, np.int64), "greedy by size", 0, {}
    start = time.monotonic()
    length = np.bincount(pitem, weights=phi - plo, minlength=n)
    index = np.arange(n)
    by_size = np.lexsort((index, -length, -sizes))
    by_area = np.lexsort((index, -sizes, -(sizes * length)))
    layouts: list[tuple[str, Callable[[], np.ndarray]]] = [
        ("greedy by size", lambda: greedy_by_size(plo, phi, pitem, sizes, alignment, base_offset=base, order=by_size)),
        ("greedy by area", lambda: greedy_by_size(plo, phi, pitem, sizes, alignment, base_offset=base, order=by_area)),
    ]
    groups = _cross_phase_groups(trace, item_ids, plo, phi, pitem, sizes, alignment)
    if groups:
        for name, how in (("cross-phase staircases + greedy by size", "size"),
                          ("cross-phase staircases in time order, then greedy by size", "groups in time order"),
                          ("cross-phase staircases + greedy by area", "area")):
            layouts.append((name, partial(_staircase_layout, plo, phi, pitem, sizes, groups, alignment, base,
                                          length, how)))
    best: tuple[int, np.ndarray, str] | None = None
    tried: dict[str, int] = {}
    last_s = 0.0
    for name, make in layouts:
        if best is not None and time.monotonic() - start + last_s > search_s:
            log.info("plan: layout search stops after %d layouts (%.1f s)", len(tried), time.monotonic() - start)
            break
        t0 = time.monotonic()
        offsets = make()
        last_s = time.monotonic() - t0
        height = int((offsets + sizes).max())
        tried[name] = height
        if best is None or height < best[0]:
            best = (height, offsets, name)
    assert best is not None
    if n <= EXACT_MAX_ITEMS and time.monotonic() - start < search_s and native.available():
        deadline = time.monotonic() + min(EXACT_LIMIT_S, max(search_s - (time.monotonic() - start), 1.0))
        found = _exact_layout(plo, phi, pitem, sizes, alignment, base, best[0], deadline)
        if found is not None:
            height = int((found + sizes).max())
            tried["offset-order search"] = height
            if height < best[0]:
                best = (height, found, "offset-order search")
    used = len(groups) if best[2].startswith("cross-phase") else 0
    return best[1], best[2], used, tried


def _exact_layout(
    plo: np.ndarray,
    phi: np.ndarray,
    pitem: np.ndarray,
    sizes: np.ndarray,
    alignment: int,
    base: int,
    ceiling: int,
    deadline: float,
) -> np.ndarray | None:
    """Offsets (>= base) from the offset-order search below `ceiling`, or None.

    A buffer of several pieces is given the hull of its pieces (one interval: safe,
    if less tight). Tries the live lower bound, then halfway to the ceiling."""
    n = sizes.shape[0]
    lo = np.full(n, np.iinfo(np.int64).max, np.int64)
    np.minimum.at(lo, pitem, plo)
    hi = np.zeros(n, np.int64)
    np.maximum.at(hi, pitem, phi)
    align = np.full(n, alignment, np.int64)
    room = ceiling - base  # heights the heuristics reached, over the base
    target = -(-_live_peak(lo, hi, sizes) // alignment) * alignment
    found = None
    while target < room and time.monotonic() < deadline:
        status, offsets, _ = solve_exact(lo, hi, sizes, align, target, deadline=deadline, engine="offset-order")
        if status == FOUND:
            found, room = offsets + base, target
            break
        nxt = (target + room) // 2 // alignment * alignment
        if nxt <= target:
            break
        target = nxt
    return found


def _cross_phase_groups(
    trace: Trace,
    item_ids: np.ndarray,
    plo: np.ndarray,
    phi: np.ndarray,
    pitem: np.ndarray,
    sizes: np.ndarray,
    alignment: int,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """STWeaver's cross-phase groups: activations of one (iteration, micro-batch) allocated
    in one phase and freed in another, each packed on its own: (members, local offsets).

    The local packing stacks the members in allocation order (best fit), which for the
    usual last-in first-out activations is a staircase exactly as high as the group's
    live peak; greedy by size is tried too and the lower one kept."""
    b = trace.buffers
    single = np.bincount(pitem, minlength=item_ids.shape[0]) == 1
    free = b["free_event"][item_ids]
    free_phase = np.full(item_ids.shape[0], -1, np.int64)
    freed = free >= 0
    op = trace.events["op"][free[freed]]
    phase_of_op = np.where(op >= 0, trace.ops["phase"][np.maximum(op, 0)] if trace.num_ops else -1, -1)
    free_phase[freed] = phase_of_op
    alloc_phase = b["phase"][item_ids].astype(np.int64)
    cross = (
        single
        & freed
        & (b["category"][item_ids] == CATEGORY["activation"])
        & (free_phase >= 0)
        & (free_phase != alloc_phase)
        & (alloc_phase != PHASE["other"])
    )
    if not cross.any():
        return []
    first_piece = np.full(item_ids.shape[0], -1, np.int64)
    first_piece[pitem[::-1]] = np.arange(pitem.shape[0])[::-1]
    keys: dict[tuple[int, ...], list[int]] = {}
    for k in np.flatnonzero(cross).tolist():
        buf = int(item_ids[k])
        key = (int(b["iteration"][buf]), int(b["microbatch"][buf]), int(alloc_phase[k]), int(free_phase[k]))
        keys.setdefault(key, []).append(k)
    groups = []
    for members in keys.values():
        if len(members) < 2:
            continue
        m = np.asarray(members, np.int64)
        lo, hi, size = plo[first_piece[m]], phi[first_piece[m]], sizes[m]
        in_order = greedy_by_size(lo, hi, np.arange(m.shape[0]), size, alignment, order=np.lexsort((-size, lo)))
        by_size = greedy_by_size(lo, hi, np.arange(m.shape[0]), size, alignment)
        local = by_size if (by_size + size).max() < (in_order + size).max() else in_order
        groups.append((m, local))
    return groups


def _staircase_layout(
    plo: np.ndarray,
    phi: np.ndarray,
    pitem: np.ndarray,
    sizes: np.ndarray,
    groups: list[tuple[np.ndarray, np.ndarray]],
    alignment: int,
    base: int,
    length: np.ndarray,
    how: str,
) -> np.ndarray:
    """Each group placed as one rigid shape (its members at their local offsets), every
    other buffer on its own, by `greedy_shapes`; offsets per buffer."""
    n = sizes.shape[0]
    unit_of = np.full(n, -1, np.int64)
    local = np.zeros(n, np.int64)
    for u, (m, offsets) in enumerate(groups):
        unit_of[m] = u
        local[m] = offsets
    rest = np.flatnonzero(unit_of < 0)
    num_units = len(groups)
    shape_of = unit_of.copy()
    shape_of[rest] = num_units + np.arange(rest.shape[0])
    item_lo = np.full(n, np.iinfo(np.int64).max, np.int64)
    np.minimum.at(item_lo, pitem, plo)
    item_hi = np.zeros(n, np.int64)
    np.maximum.at(item_hi, pitem, phi)
    height = np.concatenate([[int((local[m] + sizes[m]).max()) for m, _ in groups], sizes[rest]])
    span = np.concatenate([[int(item_hi[m].max() - item_lo[m].min()) for m, _ in groups], length[rest]])
    first = np.asarray([int(item_lo[m].min()) for m, _ in groups] + [0] * rest.shape[0], np.int64)
    index = np.arange(num_units + rest.shape[0])
    order = np.lexsort((index, -height, -height * span) if how == "area" else (index, -span, -height))
    if how == "groups in time order":
        order = np.concatenate([np.argsort(first[:num_units], kind="stable"), order[order >= num_units]])
    placed = greedy_shapes(plo, phi, shape_of[pitem], local[pitem], sizes[pitem], order, alignment, base_offset=base)
    return placed[shape_of] + local


def _live_peak(lo: np.ndarray, hi: np.ndarray, size: np.ndarray) -> int:
    if lo.size == 0:
        return 0
    t = np.concatenate([lo, hi])
    d = np.concatenate([size, -size])
    order = np.lexsort((d, t))
    return int(np.cumsum(d[order]).max())


def _dynamic_windows(
    groups: dict,
    last: int,
    dynamic: np.ndarray,
    alloc: np.ndarray,
    free: np.ndarray,
    window_end: int,
    piece_lo: np.ndarray,
    piece_hi: np.ndarray,
    piece_owner: np.ndarray,
    piece_offset: np.ndarray,
    reserve: np.ndarray,
    height: int,
) -> list[DynamicWindow]:
    """For each dynamic request: the arena ranges no other request's planned or reserved
    range uses while any of its own pieces is live (its own reserved slots are free)."""
    if last < 0 or dynamic.size == 0:
        return []
    ids = groups[last]
    top = piece_offset + reserve[piece_owner]
    alloc_of_group = alloc[ids]
    order = np.argsort(piece_owner, kind="stable")
    owners = piece_owner[order]
    windows = []
    for j in dynamic.tolist():
        buf = int(ids[j])
        mine = order[np.searchsorted(owners, buf, "left") : np.searchsorted(owners, buf, "right")]
        busy = np.zeros(piece_lo.shape[0], bool)
        for lo, hi in zip(piece_lo[mine].tolist(), piece_hi[mine].tolist()):
            busy |= (piece_lo < hi) & (piece_hi > lo)
        busy &= piece_owner != buf
        intervals = sorted(zip(piece_offset[busy].tolist(), top[busy].tolist()))
        ranges = []
        cursor = 0
        for lo, hi in intervals:
            if lo > cursor:
                ranges.append((cursor, lo))
            cursor = max(cursor, hi)
        if cursor < height:
            ranges.append((cursor, height))
        end_request = int(np.searchsorted(alloc_of_group, min(int(free[buf]), window_end), side="left"))
        windows.append(DynamicWindow(last, j, max(end_request, j + 1), ranges))
    return windows
