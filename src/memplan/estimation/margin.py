"""The margin: the share of a GPU's capacity an estimate keeps free for what it does not see
(docs/estimation.md), and the usable memory it leaves. No torch and no numpy: the command
line's help states the default from here."""

from __future__ import annotations

from memplan.errors import UserError

DEFAULT_MARGIN = 0.05  # headroom for what the estimate does not see (docs/estimation.md)


def check_margin(margin: object) -> float:
    """`margin` as a fraction in [0, 1); `UserError` otherwise."""
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
        raise UserError(f"the margin must be a fraction in [0, 1) (e.g. 0.05 for 5%), not {margin!r}")
    return float(margin)


def usable_bytes_of(capacity_bytes: int | None, margin: float) -> int | None:
    """Capacity x (1 - margin): the device memory a step may use (None: no capacity)."""
    return None if capacity_bytes is None else int(capacity_bytes * (1 - margin))
