"""fastcar-compile: FastCar temporal MLP replay for exported auto-regressive video decoders.

The public names are imported on first use (PEP 562), so `import fastcar_compile.cli` stays light: the CLI
can then guard the heavy imports (onnx, ONNX Runtime) itself, and Ctrl-C while they load exits quietly.
"""

from fastcar_compile.core._version import __version__
from fastcar_compile.core.errors import FastCarError

__all__ = ["CompileReport", "FastCarError", "__version__", "compile", "inspect", "load", "native_attention"]
_LAZY = {"CompileReport", "compile", "inspect", "load", "native_attention"}


def __getattr__(name: str):
    if name in _LAZY:
        from fastcar_compile import api

        return getattr(api, name)
    raise AttributeError(f"module 'fastcar_compile' has no attribute {name!r}")
