"""The two kinds of error memplan raises on purpose.

- `UserError`: bad input (a model name, a file, a size string, a setup that cannot
  run). The CLI prints its message as one line on stderr and exits 2.
- `MemplanBug`: an independent validator caught memplan's own mistake (a plan that
  overlaps, an order that breaks a dependency, a replay that disagrees with the trace).
  It is an `AssertionError`: the input was fine and memplan is wrong. The CLI prints
  the message with a request to report it, names the file it was working on, and
  exits 3. Each validator has its own subclass, named `<What>Bug`.
"""

from __future__ import annotations

BUG_EXIT_CODE = 3


class UserError(Exception):
    """Bad input: the message says what is wrong and how to fix it."""


class MemplanBug(AssertionError):
    """A validator caught a mistake of memplan's own: a bug to report, not bad input."""
