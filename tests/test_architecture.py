"""The house rules that keep memplan readable, checked on every test run.

- no function in `src/memplan` over 80 lines (from its `def` line to its last line);
- the code and the docs speak of the project alone: no pointer to notes outside the
  repository, no talk of the task or of the host the code was written on (`FORBIDDEN_PHRASES`;
  docs/sources.md holds the public sources);
- the import layers of `pyproject.toml` hold (`lint-imports`, see docs/architecture.md).
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src" / "memplan"
MAX_FUNCTION_LINES = 80

# Phrases that point outside the project (exact case, as `grep` finds them).
FORBIDDEN_PHRASES = ("facts" + ".md", "the " + "issue", "this " + "machine")
TEXT_SUFFIXES = {".py", ".md", ".json", ".cpp", ".h", ".cu", ".txt", ".toml"}


def _functions_over_limit() -> list[str]:
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    offenders.append(
                        f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines} lines)"
                    )
    return offenders


def test_no_function_in_src_is_longer_than_80_lines():
    offenders = _functions_over_limit()
    assert not offenders, (
        f"{len(offenders)} functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(offenders)
    )


def _project_text_files() -> list[Path]:
    files = [REPO / "README.md", REPO / "BENCHMARKS.md"]
    for root in (SRC, REPO / "docs"):
        files += [p for p in sorted(root.rglob("*")) if p.is_file() and p.suffix in TEXT_SUFFIXES]
    return [p for p in files if p.exists()]


def test_code_and_docs_speak_of_the_project_alone():
    hits = []
    for path in _project_text_files():
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
            for phrase in FORBIDDEN_PHRASES:
                if phrase in line:
                    hits.append(
                        f"{path.relative_to(REPO)}:{number}: {phrase!r}: {line.strip()[:100]}"
                    )
    assert not hits, (
        "cite docs/sources.md or a public source, and speak of the project alone:\n"
        + "\n".join(hits)
    )


def _lint_imports() -> str | None:
    beside_python = Path(sys.executable).with_name("lint-imports")
    if beside_python.exists():
        return str(beside_python)
    return shutil.which("lint-imports")


def test_import_layers_hold():
    lint_imports = _lint_imports()
    if lint_imports is None:
        pytest.skip("import-linter is not installed (pip install import-linter)")
    result = subprocess.run(
        [lint_imports, "--no-cache", "--no-logo"], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout + result.stderr
