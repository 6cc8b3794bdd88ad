"""Byte sizes as people write them (`80GiB`, `24GB`, `512MiB`, `1048576`) and back."""

from __future__ import annotations

import re

from memplan.errors import UserError

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Parse a size string into bytes; raise UserError naming the bad text."""
    if isinstance(text, int):
        if text < 0:
            raise UserError(f"size {text} is negative; give a byte count >= 0")
        return text
    match = _SIZE_RE.match(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise UserError(
            f"cannot read size {text!r}: write bytes or a number with a unit, "
            "e.g. 80GiB, 24GB, 512MiB or 1048576"
        )
    value = float(match.group(1)) * _UNITS[unit]
    return int(round(value))


def format_bytes(nbytes: float) -> str:
    """Binary units with three significant figures: 1.50 GiB, 312 MiB, 512 B."""
    value = float(nbytes)
    sign = "-" if value < 0 else ""
    value = abs(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            if unit == "B":
                return f"{sign}{int(value)} B"
            digits = 2 if value < 10 else 1 if value < 100 else 0
            return f"{sign}{value:.{digits}f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
