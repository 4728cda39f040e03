"""Native (C++) kernels of the `ai.fastcar` custom ops, built on first use into a per-user cache.

Without the library ONNX Runtime runs the model-local function bodies that fast.onnx ships (same results,
slower), so the library is a speed-up, never a requirement. `library_path()` builds it lazily (once per
onnxruntime version and kernel source, ~10 s with g++) so that the README's install command is the only
step; when it cannot be built it says why in one line and the function bodies run.

FASTCAR_NATIVE: unset or 1 = use (build if needed); 0 = never (A/B timing); a path = use that library.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

LIB_NAME = {"darwin": "libfastcar_ops.dylib", "win32": "fastcar_ops.dll"}.get(sys.platform, "libfastcar_ops.so")
ENV = "FASTCAR_NATIVE"

# why the last library_path() call found no library (None when it found one); read by native_status()
_reason: str | None = None
_said = False


def library_path(build: bool = True) -> Path | None:
    """The kernel library to register, or None (FASTCAR_NATIVE=0, or it cannot be built: see _reason)."""
    global _reason
    env = os.environ.get(ENV)
    if env == "0":
        _reason = f"{ENV}=0"
        return None
    if env and env != "1":
        p = Path(env)
        _reason = None if p.is_file() else f"{ENV}={env} is not a file"
        return p if p.is_file() else None
    from fastcar_compile.runtime.native import build as b

    lib = b.lib_path()
    if lib.is_file():
        _reason = None
        return lib
    if not build:
        _reason = "not built yet"
        return None
    started: list[str] = []

    def log(msg: str) -> None:  # say so once, when a fetch or compile really starts (not when it skips)
        if not started and (msg.startswith("fetching") or "-shared" in msg):
            started.append(msg)
            print(f"fastcar-compile: building the native ai.fastcar kernels once into {lib.parent} ...",
                  file=sys.stderr, flush=True)

    try:
        lib = b.build(log=log)
    except b.Skipped as exc:
        _reason = str(exc)
        return None
    except RuntimeError as exc:
        _reason = str(exc)
        return None
    _reason = None
    return lib


def native_status(lib: Path | None) -> str:
    """One line saying whether the native kernels are in use, and why not."""
    if lib is not None:
        return f"fastcar-compile: native ai.fastcar kernels in use ({lib})"
    why = _reason or "not available"
    return (f"fastcar-compile: native kernels OFF ({why}); running the ONNX function bodies (slower; "
            f"docs/runtime.md, {ENV})")


def announce(lib: Path | None) -> None:
    """Print native_status once per process (the runtime calls it when its first FastCarSession starts)."""
    global _said
    if not _said and os.environ.get("FASTCAR_QUIET", "0") != "1":
        print(native_status(lib), file=sys.stderr, flush=True)
    _said = True
