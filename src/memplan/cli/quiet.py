"""The libraries' warnings, held back and counted while a subcommand runs.

torch, transformers, peft, bitsandbytes and torchao warn about things a memplan user cannot
act on (bitsandbytes' "pip install kernels" on a CPU backend, torchao's CUDA-only
extensions a CPU build cannot load, transformers' `loss_type`, peft's `rank_pattern`,
torch's pytree deprecations), through Python's `warnings` and through `logging`. While a
subcommand runs, `LibraryWarnings` keeps every such warning (a `logging` record below ERROR
from a logger outside memplan, or a `warnings.warn`) instead of printing it, and says once
at the end on stderr how many distinct ones it held back (not after memplan's own error,
which stays one line); `--verbose` lets them through as they come. Errors are never held back.

Assumes: the libraries log through `logging` (`logging.Handler.handle` is where every record
reaches a handler, the `lastResort` one included), and warn through `warnings.showwarning`.
Lines a library's C++ code writes to the process's stderr itself are not Python's to catch.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from types import TracebackType
from typing import Any


class LibraryWarnings:
    """A context manager: the libraries' warnings held back (module docstring)."""

    def __init__(self, verbose: bool = False) -> None:
        self.verbose = verbose
        self.held: dict[str, int] = {}  # message -> times
        self.summarise = True  # say how many were held back (the caller turns it off after an error)
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> LibraryWarnings:
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
        if self.verbose:
            return self
        self._saved = {"handle": logging.Handler.handle, "showwarning": warnings.showwarning}
        original = logging.Handler.handle
        held = self

        def handle(handler: logging.Handler, record: logging.LogRecord) -> bool:
            if record.levelno < logging.ERROR and not record.name.startswith("memplan"):
                held.keep(record.getMessage())
                return False
            return bool(original(handler, record))

        def showwarning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                        file: Any = None, line: str | None = None) -> None:
            held.keep(f"{category.__name__}: {message}")

        setattr(logging.Handler, "handle", handle)  # noqa: B010 - every handler, the libraries' and lastResort
        warnings.showwarning = showwarning
        return self

    def keep(self, message: str) -> None:
        self.held[message] = self.held.get(message, 0) + 1

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        if self._saved:
            setattr(logging.Handler, "handle", self._saved["handle"])  # noqa: B010 - as it was
            warnings.showwarning = self._saved["showwarning"]
        if self.held and self.summarise and kind is None:
            count = len(self.held)
            sys.stderr.write(f"memplan: {count} library warning{'s' if count != 1 else ''} hidden; "
                             "--verbose shows them\n")
