"""fastcar-compile: FastCar temporal MLP replay for exported auto-regressive video decoders."""

from fastcar_compile._version import __version__
from fastcar_compile.api import CompileReport, compile, inspect
from fastcar_compile.errors import FastCarError

__all__ = ["CompileReport", "FastCarError", "__version__", "compile", "inspect"]
