"""The one exception type that reaches users as a one-line message.

Anything a user can get wrong (a model name, a file, a size string, a setup that
cannot run) raises `UserError`; the CLI prints its message on stderr and exits 2.
Every other exception is a bug in memplan and keeps its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input: the message says what is wrong and how to fix it."""
