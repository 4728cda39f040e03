"""User-facing errors: the CLI prints them without a traceback and exits with code 2."""

from __future__ import annotations


class FastCarError(Exception):
    """An error caused by the user's input (bad model, bad option); says what is wrong and what to do."""

    exit_code = 2

