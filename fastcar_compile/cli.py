"""Command line: `fastcar-compile model.onnx -o fast.onnx ...` and subcommands (registered in commands.py)."""

from __future__ import annotations

import importlib
import sys

from fastcar_compile.commands import SUBCOMMANDS, lookup
from fastcar_compile.errors import FastCarError

__all__ = ["SUBCOMMANDS", "main"]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        module, func, rest = lookup(argv)
        return int(getattr(importlib.import_module(module), func)(rest) or 0)
    except FastCarError as exc:
        print(f"fastcar-compile: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("fastcar-compile: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
