"""User-facing errors: the CLI prints them without a traceback and exits with code 2."""

from __future__ import annotations


class FastCarError(Exception):
    """An error caused by the user's input (bad model, bad option); says what is wrong and what to do."""

    exit_code = 2


def read_json_file(path, what: str):
    """Parse a user-supplied JSON file, turning a missing or malformed file into a FastCarError."""
    import json
    from pathlib import Path

    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FastCarError(f"{what} {path} not found") from None
    except json.JSONDecodeError as exc:
        raise FastCarError(f"{what} {path} is not valid JSON: {exc}") from None
