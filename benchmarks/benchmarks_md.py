"""BENCHMARKS.md is shared: each benchmark owns one marked section of it."""

from __future__ import annotations

from pathlib import Path

BENCHMARKS_MD = Path(__file__).resolve().parents[1] / "BENCHMARKS.md"


def write_section(name: str, section: str, path: Path = BENCHMARKS_MD) -> None:
    """Replace the `<!-- bench:NAME -->` … `<!-- /bench:NAME -->` section (append if absent)."""
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    if not section.startswith(start):
        section = f"{start}\n{section.strip()}\n{end}"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if start in text and end in text:
        text = text[: text.index(start)] + section + text[text.index(end) + len(end) :]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(text)
