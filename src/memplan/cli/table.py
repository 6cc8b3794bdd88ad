"""Every table and paragraph the CLI prints, readable at the terminal's width (80 columns too).

One owner for terminal rendering: the subcommands build rows, this module lays them out.
- `pairs`: one record as `key  value` rows (a single-rank estimate, a replay's statistics);
  a value too long for the line wraps under itself.
- `table`: a header and rows. When the columns do not fit the width, the table is
  wrapped: printed as several tables, each repeating the first column (the row's name)
  with as many further columns as fit; a cell too long for any line wraps inside its
  column. Headers are never cut: a column is at least as wide as its header's longest word
  and a header wraps at spaces only.
- `paragraph`: prose wrapped at the width, continuation lines indented.
- `command`: a shell command wrapped between its words with `\\` continuations, so that
  it still pastes into a shell as one command.
The width is the terminal's (`shutil.get_terminal_size`, which reads `COLUMNS` first),
80 when stdout is not a terminal.
"""

from __future__ import annotations

import shlex
import shutil
import sys
import textwrap
from collections.abc import Sequence

GAP = "  "  # between two columns


def terminal_columns() -> int:
    """Columns to lay out in: `COLUMNS`, else the terminal's, else 80."""
    return max(40, shutil.get_terminal_size((80, 24)).columns)


def _wrap(text: str, width: int) -> list[str]:
    """`text` in lines of at most `width` characters (long words are split)."""
    lines: list[str] = []
    for part in str(text).split("\n"):
        lines += textwrap.wrap(part, width, break_long_words=True, break_on_hyphens=False) or [""]
    return lines


def paragraph(text: str, width: int | None = None, indent: str = "  ") -> str:
    """`text` wrapped at the width; continuation lines start with `indent`."""
    width = width or terminal_columns()
    return "\n".join(textwrap.wrap(text, width, subsequent_indent=indent, break_long_words=True,
                                   break_on_hyphens=False)) + "\n"


def command(text: str, prefix: str = "", width: int | None = None) -> str:
    """The shell command `text` after `prefix`, wrapped between its words with ` \\`
    line continuations (a word longer than the line stays whole on its own line)."""
    width = width or terminal_columns()
    indent = " " * (len(prefix) + 4)
    lines, line = [], prefix
    for i, word in enumerate(shlex.quote(w) for w in shlex.split(text)):
        if i and len(line) + 1 + len(word) + 2 > width:
            lines.append(line + " \\")
            line = indent + word
        else:
            line = f"{line} {word}" if i else line + word
    return "\n".join([*lines, line]) + "\n"


def pairs(rows: Sequence[tuple[str, str]], title: str | None = None, width: int | None = None) -> str:
    """One record as aligned `key  value` rows under an optional title."""
    width = width or terminal_columns()
    key_w = min(max((len(k) for k, _ in rows), default=0), width // 2)
    out = _wrap(title, width) if title else []
    for key, value in rows:
        keys = _wrap(key, key_w)
        values = _wrap(value, max(8, width - key_w - len(GAP)))
        for i in range(max(len(keys), len(values))):
            k = keys[i] if i < len(keys) else ""
            v = values[i] if i < len(values) else ""
            out.append(f"{k:<{key_w}}{GAP}{v}".rstrip())
    return "\n".join(out) + "\n"


def _natural_widths(header: Sequence[str], rows: Sequence[Sequence[str]], width: int) -> list[int]:
    """Each column's width: its widest cell, at least its header's longest word, at most what fits."""
    widths = []
    for j, head in enumerate(header):
        floor = max(len(word) for word in head.split() or [""])
        cell = max([len(head)] + [len(r[j]) for r in rows])
        widths.append(max(floor, min(cell, width - 2 * len(GAP) - 8)))
    return widths


def _column_groups(widths: list[int], width: int) -> list[list[int]]:
    """Columns 1.. packed greedily into groups that fit beside column 0."""
    groups: list[list[int]] = []
    used = width  # forces a new group for the first column
    for j in range(1, len(widths)):
        if used + len(GAP) + widths[j] > width and (not groups or groups[-1]):
            groups.append([])
            used = widths[0]
        groups[-1].append(j)
        used += len(GAP) + widths[j]
    return groups or [[]]


def _shrink(widths: list[int], columns: list[int], width: int) -> list[int]:
    """Narrow the widest columns of one group (never below their header's longest word)
    until the group fits `width`; the cells wrap inside."""
    widths = list(widths)
    while sum(widths[j] for j in columns) + len(GAP) * (len(columns) - 1) > width:
        j = max(columns, key=lambda c: widths[c])
        if widths[j] <= 8:
            break
        widths[j] -= 1
    return widths


def _lines(header: Sequence[str], rows: Sequence[Sequence[str]], columns: list[int], widths: list[int],
           right: Sequence[bool]) -> list[str]:
    def one(cells: Sequence[str]) -> list[str]:
        wrapped = [_wrap(cells[j], widths[j]) for j in columns]
        out = []
        for i in range(max(len(w) for w in wrapped)):
            parts = []
            for w, j in zip(wrapped, columns, strict=True):
                text = w[i] if i < len(w) else ""
                parts.append(f"{text:>{widths[j]}}" if right[j] else f"{text:<{widths[j]}}")
            out.append(GAP.join(parts).rstrip())
        return out

    rule = GAP.join("-" * widths[j] for j in columns)
    return [*one(header), rule, *(line for row in rows for line in one(row))]


def table(header: Sequence[str], rows: Sequence[Sequence[object]], title: str | None = None,
          right: Sequence[bool] | None = None, width: int | None = None) -> str:
    """Rows under a header (see the module doc for how a wide table wraps)."""
    width = width or terminal_columns()
    text_rows = [[str(c) for c in r] for r in rows]
    right = list(right) if right is not None else [j > 0 for j in range(len(header))]
    widths = _natural_widths(header, text_rows, width)
    out = _wrap(title, width) if title else []
    if sum(widths) + len(GAP) * (len(widths) - 1) <= width:
        return "\n".join(out + _lines(header, text_rows, list(range(len(header))), widths, right)) + "\n"
    widths[0] = min(widths[0], max(max(len(w) for w in header[0].split() or [""]), width // 3))
    for k, group in enumerate(_column_groups(widths, width)):
        columns = [0, *group]
        if k:
            out.append("")
        out += _lines(header, text_rows, columns, _shrink(widths, columns, width), right)
    return "\n".join(out) + "\n"


def echo(*blocks: str) -> None:
    """Write rendered blocks to stdout."""
    for block in blocks:
        sys.stdout.write(block)
