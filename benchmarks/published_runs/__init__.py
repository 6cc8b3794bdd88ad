"""Published GPU runs re-run through the trainers' own code, under `memplan run`.

`bench_published_gpu.py` compares each published figure with two answers: `memplan estimate`
of the job rebuilt from flags, and `memplan run -- <the trainer's command>`, the trainer's own
program traced as it runs (docs/run.md). This package says, per case id of
`published_gpu.json`, how that command is made: every module here exports
`RUNS: dict[str, Callable[[dict, Path], TrainerRun]]`, a function per case that writes what
the command needs into a fresh folder (a checkpoint of shapes only, a tokenizer, local data:
`assets`) and returns the command. Modules are found by listing the package, so each trainer's
runs live in their own file.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class TrainerRun:
    """The command a user of the trainer types for one published run, and where it runs.

    `env` adds to the environment of the `memplan run` process; `notes` says what was made
    up to run it here (synthetic data and tokenizer, a setting the source leaves unstated)."""

    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    cwd: Path | None = None
    notes: list[str] = field(default_factory=list)


Prepare = Callable[[dict[str, Any], Path], TrainerRun]


def trainer_runs() -> dict[str, Prepare]:
    """Case id -> the function that prepares its command, over every module of this package."""
    runs: dict[str, Prepare] = {}
    for info in pkgutil.iter_modules(__path__):
        if info.name == "assets":
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        for case_id, prepare in module.RUNS.items():
            if case_id in runs:
                raise ValueError(f"published run {case_id} is prepared by two modules")
            runs[case_id] = prepare
    return runs
