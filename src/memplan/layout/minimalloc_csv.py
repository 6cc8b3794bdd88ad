"""minimalloc's CSV problem format, both ways, and a trace as an offset problem.

The format (google/minimalloc, src/converter.cc): a header row, then one buffer per
row. Required columns `id`, `lower`, `upper`, `size`; optional `alignment`, `hint`,
`gaps` and `offset`. Aliases: `begin` or `start` for `lower`, `buffer` or `buffer_id`
for `id`, and `end` for an **inclusive** upper (`upper = end + 1`, gap ends too).
`gaps` is a space-separated list of `lo-hi` (inactive) or `lo-hi@wlo:whi` (only bytes
`[wlo, whi)` in use). Any other column is kept and written back unchanged.

What "alignment that does not divide" means here: an alignment must be a power of two,
and a `hint` or `offset` must be a multiple of its row's alignment. Every bad value is
a `UserError` naming the row (1-based, header = row 1) and the column.

A trace becomes a problem through `Trace.lifetimes()`: lifetimes are half-open
`[alloc_event, free_event)`, and a buffer never freed lives to the end of the trace.
"""

from __future__ import annotations

import csv
import io
import os
from pathlib import Path

import numpy as np

from memplan.errors import UserError
from memplan.layout.problem import Gap, Problem
from memplan.trace.io import atomic_write
from memplan.trace.model import Trace

_ALIASES = {"begin": "lower", "start": "lower", "buffer": "id", "buffer_id": "id", "end": "upper"}
_REQUIRED = ("id", "lower", "upper", "size")
_KNOWN = {"id", "lower", "upper", "size", "alignment", "hint", "gaps", "offset"}


def _int(text: str, row: int, column: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise UserError(f"row {row}, column {column}: {text!r} is not an integer") from None


def _gaps(text: str, row: int, addend: int) -> tuple[Gap, ...]:
    out = []
    for item in text.split():
        span, _, window = item.partition("@")
        lo, dash, hi = span.partition("-")
        if not dash:
            raise UserError(f"row {row}, column gaps: {item!r} is not lo-hi or lo-hi@wlo:whi")
        g_lo, g_hi = _int(lo, row, "gaps"), _int(hi, row, "gaps") + addend
        w_lo = w_hi = 0
        if window:
            a, colon, b = window.partition(":")
            if not colon:
                raise UserError(f"row {row}, column gaps: window {window!r} is not wlo:whi")
            w_lo, w_hi = _int(a, row, "gaps"), _int(b, row, "gaps")
        if g_hi <= g_lo:
            raise UserError(f"row {row}, column gaps: gap {item!r} is empty")
        out.append(Gap(g_lo, g_hi, w_lo, w_hi))
    return tuple(out)


def read_csv_text(text: str, source: str = "CSV") -> tuple[Problem, np.ndarray | None]:
    """(problem, offsets from an `offset` column or None)."""
    rows = [r for r in csv.reader(io.StringIO(text)) if r and any(cell.strip() for cell in r)]
    if not rows:
        raise UserError(f"{source} is empty: it needs a header row id,lower,upper,size and one row per buffer")
    header = [cell.strip() for cell in rows[0]]
    addend = 1 if "end" in header else 0
    names = [_ALIASES.get(h, h) for h in header]
    if len(set(names)) != len(names):
        raise UserError(f"{source}, row 1: duplicate column names in {header}")
    missing = [c for c in _REQUIRED if c not in names]
    if missing:
        raise UserError(
            f"{source}, row 1: missing column(s) {', '.join(missing)}; "
            "the header must name id, lower (or begin/start), upper (or end), size"
        )
    col = {name: i for i, name in enumerate(names)}
    extra = [n for n in names if n not in _KNOWN]
    ids: list[str] = []
    lower, upper, size, align, hint, offset = [], [], [], [], [], []
    gaps: list[tuple[Gap, ...]] = []
    extra_values: dict[str, list[str]] = {n: [] for n in extra}
    seen: dict[str, int] = {}
    for k, fields in enumerate(rows[1:], start=2):
        if len(fields) != len(names):
            raise UserError(f"{source}, row {k}: {len(fields)} fields for {len(names)} columns")
        ident = fields[col["id"]].strip()
        if ident in seen:
            raise UserError(f"{source}, row {k}, column id: duplicate id {ident!r} (first on row {seen[ident]})")
        seen[ident] = k
        lo = _int(fields[col["lower"]], k, header[col["lower"]])
        up = _int(fields[col["upper"]], k, header[col["upper"]]) + addend
        sz = _int(fields[col["size"]], k, "size")
        if up <= lo:
            raise UserError(
                f"{source}, row {k}, column {header[col['upper']]}: upper {up} <= lower {lo}; "
                "a lifetime [lower, upper) must be non-empty"
            )
        if sz <= 0:
            raise UserError(f"{source}, row {k}, column size: size {sz} must be positive")
        al = _int(fields[col["alignment"]], k, "alignment") if "alignment" in col else 1
        if al <= 0 or al & (al - 1):
            raise UserError(f"{source}, row {k}, column alignment: {al} is not a power of two (1, 2, 4, ...)")
        hn = -1
        if "hint" in col and fields[col["hint"]].strip():
            hn = _int(fields[col["hint"]], k, "hint")
            if hn < 0 or hn % al:
                raise UserError(f"{source}, row {k}, column hint: {hn} is not a non-negative multiple of alignment {al}")
        off = -1
        if "offset" in col and fields[col["offset"]].strip():
            off = _int(fields[col["offset"]], k, "offset")
            if off < 0 or off % al:
                raise UserError(
                    f"{source}, row {k}, column offset: {off} is not a non-negative multiple of alignment {al}"
                )
        ids.append(ident)
        lower.append(lo)
        upper.append(up)
        size.append(sz)
        align.append(al)
        hint.append(hn)
        offset.append(off)
        gaps.append(_gaps(fields[col["gaps"]], k, addend) if "gaps" in col else ())
        for n in extra:
            extra_values[n].append(fields[col[n]])
    problem = Problem(
        ids=ids,
        lower=np.asarray(lower, np.int64),
        upper=np.asarray(upper, np.int64),
        nbytes=np.asarray(size, np.int64),
        alignment=np.asarray(align, np.int64),
        hint=np.asarray(hint, np.int64) if "hint" in col else None,
        gaps=gaps if "gaps" in col else None,
        extra_columns=extra_values,
    )
    problem.check()
    offsets = np.asarray(offset, np.int64) if "offset" in col else None
    if offsets is not None and (offsets < 0).any():
        offsets = None  # a partly filled offset column is no solution
    return problem, offsets


def read_csv(path: str | os.PathLike) -> tuple[Problem, np.ndarray | None]:
    """Read a minimalloc CSV file; UserError if missing or malformed."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"problem file {path} does not exist")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read {path}: {exc}") from None
    return read_csv_text(text, source=str(path))


def to_csv_text(problem: Problem, offsets: np.ndarray | None = None) -> str:
    """The problem in minimalloc's format (half-open `upper`), plus `offset` if given."""
    header = ["id", "lower", "upper", "size"]
    if (problem.alignment != 1).any():
        header.append("alignment")
    if problem.hint is not None:
        header.append("hint")
    if problem.gaps is not None and any(problem.gaps):
        header.append("gaps")
    header += list(problem.extra_columns)
    if offsets is not None:
        header.append("offset")
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(header)
    for i, ident in enumerate(problem.ids):
        row = [ident, int(problem.lower[i]), int(problem.upper[i]), int(problem.nbytes[i])]
        if "alignment" in header:
            row.append(int(problem.alignment[i]))
        if "hint" in header:
            assert problem.hint is not None
            row.append("" if problem.hint[i] < 0 else int(problem.hint[i]))
        if "gaps" in header:
            assert problem.gaps is not None
            row.append(
                " ".join(
                    f"{g.lower}-{g.upper}" + (f"@{g.window_lower}:{g.window_upper}" if g.window_upper > g.window_lower else "")
                    for g in problem.gaps[i]
                )
            )
        row += [problem.extra_columns[n][i] for n in problem.extra_columns]
        if offsets is not None:
            row.append(int(offsets[i]))
        writer.writerow(row)
    return out.getvalue()


def write_csv(path: str | os.PathLike, problem: Problem, offsets: np.ndarray | None = None) -> None:
    """Write the problem (and offsets) atomically."""
    text = to_csv_text(problem, offsets)
    atomic_write(path, lambda fh: fh.write(text), mode="w")


def problem_from_trace(trace: Trace) -> Problem:
    """The trace's buffers as an offset problem: ids are buffer indices, time is events."""
    lower, upper, nbytes = trace.lifetimes()
    keep = nbytes > 0  # a zero-byte storage occupies no address range
    ids = [str(i) for i in np.flatnonzero(keep).tolist()]
    return Problem(
        ids=ids,
        lower=lower[keep],
        upper=np.maximum(upper[keep], lower[keep] + 1),
        nbytes=nbytes[keep],
        alignment=np.ones(int(keep.sum()), np.int64),
    ).check()
