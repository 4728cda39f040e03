"""Native (C++) kernels of the `ai.fastcar` custom ops, built from source by `build.py`.

Without the built library ONNX Runtime runs the model-local function bodies that fast.onnx ships, so the
library is an optional speed-up, never a requirement.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

LIB_NAME = {"darwin": "libfastcar_ops.dylib", "win32": "fastcar_ops.dll"}.get(sys.platform, "libfastcar_ops.so")
# Set FASTCAR_NATIVE=0 to ignore a built library (A/B timing), or to a path to use another build.
ENV = "FASTCAR_NATIVE"


def build_dir() -> Path:
    """Where build.py writes the library: next to this file (the repo checkout / editable install)."""
    return Path(__file__).resolve().parent / "build"


def library_path() -> Path | None:
    """The built kernel library, or None when it was not built (or FASTCAR_NATIVE=0)."""
    env = os.environ.get(ENV)
    if env == "0":
        return None
    if env and env != "1":
        p = Path(env)
        return p if p.is_file() else None
    p = build_dir() / LIB_NAME
    return p if p.is_file() else None
