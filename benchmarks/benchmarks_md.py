"""BENCHMARKS.md is shared: each benchmark owns one marked section of it. Also the one way a
benchmark times the CLI as a user runs it (`run_cli`)."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
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


def run_cli(argv: list[str], *, check: bool = False) -> tuple[subprocess.CompletedProcess, float, float]:
    """A fresh `python -m memplan ARGV` process of this checkout's src: the finished process, its
    wall seconds and its CPU seconds (user + system, children included)."""
    env = {**os.environ, "PYTHONPATH": str(BENCHMARKS_MD.parent / "src")}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "memplan", *argv], capture_output=True, text=True, env=env,
                          check=check)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return proc, wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
