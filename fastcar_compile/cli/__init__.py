"""Command line: `fastcar-compile model.onnx -o fast.onnx ...` and its subcommands, one module each in this folder
(registered in registry.py); `main` dispatches."""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import sys

from fastcar_compile.cli.registry import SUBCOMMANDS, lookup
from fastcar_compile.core.errors import FastCarError

__all__ = ["SUBCOMMANDS", "main"]


# Heavy modules each command needs, imported up front under `_sigint_deferred` (not for --help).
PRELOAD: dict[str, tuple[str, ...]] = {
    "compile": ("fastcar_compile.api",),
    "sim": ("fastcar_compile.fpga_backend.simulate",),
    "asm": ("fastcar_compile.fpga_backend.asm",),
    "disasm": ("fastcar_compile.fpga_backend.asm",),
    "report": ("fastcar_compile.runtime.report",),
}


@contextlib.contextmanager
def _sigint_deferred():
    """Ctrl-C while the heavy imports load is remembered and raised once they are done: an interrupt inside
    a C extension's import leaves it half-initialised (shutdown then crashes), and some libraries' import
    fallbacks swallow it."""
    hit: list[int] = []
    try:
        old = signal.signal(signal.SIGINT, lambda signum, frame: hit.append(signum))
    except ValueError:  # not the main thread: nothing to defer
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
    if hit:
        raise KeyboardInterrupt


def _load(command: str, argv: list[str]) -> None:
    if "-h" in argv or "--help" in argv:
        return
    with _sigint_deferred():
        for name in PRELOAD.get(command, ()):
            importlib.import_module(name)


@contextlib.contextmanager
def _sigint_remembered():
    """Ctrl-C raises KeyboardInterrupt as usual and is also remembered: Python drops an exception raised inside a
    weakref callback or __del__ ("Exception ignored in ..."), so a Ctrl-C landing in a garbage collection would
    otherwise let the command run on and exit 0."""
    hit: list[int] = []

    def handler(signum, frame):
        hit.append(signum)
        raise KeyboardInterrupt

    try:
        old = signal.signal(signal.SIGINT, handler)
    except ValueError:  # not the main thread
        yield hit
        return
    try:
        yield hit
    finally:
        signal.signal(signal.SIGINT, old)


def main(argv: list[str] | None = None) -> int:
    from_console = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        module, func, rest = lookup(argv)
        _load(argv[0] if argv and argv[0] in SUBCOMMANDS else "compile", argv)
        with _sigint_remembered() as hit:
            rc = int(getattr(importlib.import_module(module), func)(rest) or 0)
        if hit:
            raise KeyboardInterrupt
        return rc
    except FastCarError as exc:
        print(f"fastcar-compile: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except OSError as exc:  # a file-system problem the command did not anticipate: still a user error
        from fastcar_compile.core.fileio import describe_os_error

        print(f"fastcar-compile: error: {describe_os_error(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # also during the (lazy) imports of the first second: exit quietly
        print("fastcar-compile: interrupted", file=sys.stderr)
        if from_console:
            # An interrupt inside a C extension's import (onnx, onnxruntime) leaves it half-initialised, and
            # the interpreter's normal shutdown then crashes in its destructors (SIGSEGV): leave at once.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(130)
        return 130


if __name__ == "__main__":
    sys.exit(main())
