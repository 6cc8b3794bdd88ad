"""Greedy-by-size best fit: the offset heuristic of TFLite's GPU delegate and XLA.

Pisarchyk & Lee, "Efficient Memory Management for Deep Neural Net Inference" (2020),
and XLA's `GlobalDecreasingSizeBestFitHeap`: take buffers largest first (longer
lifetime first among equal sizes); place each in the smallest gap, between the buffers
already placed that are live at the same time, that can hold it; with no such gap,
on top of them. O(n^2) in the worst case; each step is a numpy scan of the placed
buffers, so 100,000 buffers take seconds, not minutes.

A buffer may be live over several disjoint time intervals ("pieces", half-open): the
STWeaver planner uses this for buffers that wrap from one iteration into the next.
"""

from __future__ import annotations

import numpy as np


def greedy_by_size(
    piece_lower: np.ndarray,
    piece_upper: np.ndarray,
    piece_buffer: np.ndarray,
    nbytes: np.ndarray,
    alignment: np.ndarray | int = 1,
    *,
    base_offset: int = 0,
    order: np.ndarray | None = None,
) -> np.ndarray:
    """Offsets (>= base_offset) for buffers whose live time is the union of their pieces.

    `order` overrides the placement order (default: size descending, then total
    lifetime descending, then index).
    """
    piece_lower = np.asarray(piece_lower, dtype=np.int64)
    piece_upper = np.asarray(piece_upper, dtype=np.int64)
    piece_buffer = np.asarray(piece_buffer, dtype=np.int64)
    nbytes = np.asarray(nbytes, dtype=np.int64)
    n = nbytes.shape[0]
    align = np.broadcast_to(np.asarray(alignment, dtype=np.int64), (n,))
    offsets = np.full(n, -1, np.int64)
    if n == 0:
        return offsets
    if order is None:
        length = np.bincount(piece_buffer, weights=piece_upper - piece_lower, minlength=n)
        order = np.lexsort((np.arange(n), -length, -nbytes))
    # Pieces grouped by buffer.
    by_buffer = np.argsort(piece_buffer, kind="stable")
    first_piece = np.searchsorted(piece_buffer[by_buffer], np.arange(n + 1))
    m = piece_lower.shape[0]
    placed_lo = np.empty(m, np.int64)
    placed_hi = np.empty(m, np.int64)
    placed_off = np.empty(m, np.int64)
    placed_top = np.empty(m, np.int64)
    count = 0
    for b in np.asarray(order).tolist():
        size = int(nbytes[b])
        a = int(align[b])
        pieces = by_buffer[first_piece[b] : first_piece[b + 1]]
        lo_p = piece_lower[pieces]
        hi_p = piece_upper[pieces]
        if count:
            plo = placed_lo[:count]
            phi = placed_hi[:count]
            mask = (plo < hi_p[0]) & (phi > lo_p[0])
            for k in range(1, pieces.shape[0]):
                mask |= (plo < hi_p[k]) & (phi > lo_p[k])
            hit = np.flatnonzero(mask)
        else:
            hit = np.zeros(0, np.int64)
        offset = _best_fit(placed_off[hit], placed_top[hit], size, a, base_offset)
        offsets[b] = offset
        k = pieces.shape[0]
        placed_lo[count : count + k] = lo_p
        placed_hi[count : count + k] = hi_p
        placed_off[count : count + k] = offset
        placed_top[count : count + k] = offset + size
        count += k
    return offsets


def _best_fit(offs: np.ndarray, tops: np.ndarray, size: int, align: int, base: int) -> int:
    """Lowest-waste gap among the occupied address intervals [offs, tops) that holds `size`."""
    if offs.shape[0] == 0:
        return -(-base // align) * align
    order = np.argsort(offs, kind="stable")
    offs = offs[order]
    reach = np.maximum.accumulate(tops[order])
    gap_start = np.empty_like(offs)
    gap_start[0] = base
    gap_start[1:] = np.maximum(reach[:-1], base)
    gap_start = -(-gap_start // align) * align
    room = offs - gap_start
    fits = np.flatnonzero(room >= size)
    if fits.shape[0]:
        best = fits[np.argmin(room[fits])]  # smallest gap that fits; lowest among equals
        return int(gap_start[best])
    top = max(int(reach[-1]), base)
    return -(-top // align) * align


def greedy_offsets(lower: np.ndarray, upper: np.ndarray, nbytes: np.ndarray, alignment: np.ndarray | int = 1) -> np.ndarray:
    """Greedy-by-size best fit for one-interval lifetimes `[lower, upper)`."""
    n = np.asarray(nbytes).shape[0]
    return greedy_by_size(lower, upper, np.arange(n), nbytes, alignment)


def greedy_shapes(
    piece_lower: np.ndarray,
    piece_upper: np.ndarray,
    piece_item: np.ndarray,
    piece_local: np.ndarray,
    piece_nbytes: np.ndarray,
    order: np.ndarray,
    alignment: int = 1,
    *,
    base_offset: int = 0,
) -> np.ndarray:
    """Offsets (>= base_offset) of items placed one by one in `order`.

    An item is a rigid *shape*: pieces, each live over `[lower, upper)` and occupying
    `[offset + local, offset + local + nbytes)`. A flat item (every piece at local 0,
    all of one size: a plain buffer) goes best fit into a gap, as in `greedy_by_size`.
    Any other item (a packed group of buffers, a staircase that grows in the forward
    and shrinks in the backward pass) goes at the lowest offset where none of its
    pieces collides, so the space a group frees early is open to others, which a
    rectangle of the group's height would hide. `alignment` must divide every local
    offset; offsets returned are multiples of it.
    """
    piece_lower = np.asarray(piece_lower, dtype=np.int64)
    piece_upper = np.asarray(piece_upper, dtype=np.int64)
    piece_item = np.asarray(piece_item, dtype=np.int64)
    piece_local = np.asarray(piece_local, dtype=np.int64)
    piece_nbytes = np.asarray(piece_nbytes, dtype=np.int64)
    n = int(piece_item.max()) + 1 if piece_item.size else 0
    offsets = np.full(n, -1, np.int64)
    by_item = np.argsort(piece_item, kind="stable")
    first_piece = np.searchsorted(piece_item[by_item], np.arange(n + 1))
    m = piece_lower.shape[0]
    placed_lo = np.empty(m, np.int64)
    placed_hi = np.empty(m, np.int64)
    placed_off = np.empty(m, np.int64)
    placed_top = np.empty(m, np.int64)
    count = 0
    for item in np.asarray(order).tolist():
        pieces = by_item[first_piece[item] : first_piece[item + 1]]
        if pieces.shape[0] == 0:
            continue
        lo_p, hi_p = piece_lower[pieces], piece_upper[pieces]
        local, size = piece_local[pieces], piece_nbytes[pieces]
        plo, phi = placed_lo[:count], placed_hi[:count]
        if not local.any() and (size == size[0]).all():
            mask = (plo < hi_p[0]) & (phi > lo_p[0])
            for k in range(1, pieces.shape[0]):
                mask |= (plo < hi_p[k]) & (phi > lo_p[k])
            hit = np.flatnonzero(mask)
            offset = _best_fit(placed_off[hit], placed_top[hit], int(size[0]), alignment, base_offset)
        else:
            offset = _lowest_shape_offset(
                plo, phi, placed_off[:count], placed_top[:count], lo_p, hi_p, local, size, alignment, base_offset
            )
        offsets[item] = offset
        k = pieces.shape[0]
        placed_lo[count : count + k] = lo_p
        placed_hi[count : count + k] = hi_p
        placed_off[count : count + k] = offset + local
        placed_top[count : count + k] = offset + local + size
        count += k
    return offsets


def _lowest_shape_offset(
    plo: np.ndarray,
    phi: np.ndarray,
    poff: np.ndarray,
    ptop: np.ndarray,
    lo: np.ndarray,
    hi: np.ndarray,
    local: np.ndarray,
    size: np.ndarray,
    align: int,
    base: int,
) -> int:
    """Lowest aligned offset >= base at which no piece of the shape meets a placed piece.

    Piece j at offset x collides with placed piece p (live at the same time) iff
    `poff - local_j - size_j < x < ptop - local_j`: each pair forbids an open interval
    of x, and the answer is the first aligned point outside all of them."""
    start = -(-base // align) * align
    j, p = np.nonzero((plo[None, :] < hi[:, None]) & (phi[None, :] > lo[:, None]))
    if j.shape[0] == 0:
        return start
    s = poff[p] - local[j] - size[j] + 1  # first forbidden x
    e = -(-(ptop[p] - local[j]) // align) * align  # first aligned x allowed again
    keep = e > start
    s, e = s[keep], e[keep]
    if s.shape[0] == 0:
        return start
    order = np.argsort(s, kind="stable")
    s, e = s[order], e[order]
    reach = np.maximum(np.maximum.accumulate(e), start)
    cursor = np.concatenate([[start], reach[:-1]])
    free = np.flatnonzero(s > cursor)
    return int(cursor[free[0]]) if free.shape[0] else int(reach[-1])
