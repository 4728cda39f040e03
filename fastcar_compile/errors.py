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
    if path.is_dir():
        raise FastCarError(f"{what} {path} is a directory; give the path of a JSON file")
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise FastCarError(f"{what} {path} not found") from None
    except UnicodeDecodeError:
        raise FastCarError(f"{what} {path} is not a text file (binary?); give the JSON file") from None
    except json.JSONDecodeError as exc:
        raise FastCarError(f"{what} {path} is not valid JSON: {exc}") from None
    except RecursionError:
        raise FastCarError(f"{what} {path} nests too deeply to be a {what}") from None
    except OSError as exc:
        raise FastCarError(f"{what} {path}: cannot read it ({exc.strerror or exc})") from None
