"""What the compiled DiT mode tests share: compiling the exported step graph through the CLI."""

from __future__ import annotations

from pathlib import Path

from fastcar_compile.cli import main


def compile_cli(exported: Path, folder: Path, *args: str, name: str = "fast.onnx") -> Path:
    """`fastcar-compile EXPORTED -o FOLDER/NAME ARGS...`, asserting it succeeds; the compiled graph's path."""
    out = folder / name
    assert main([str(exported), "-o", str(out), *args]) == 0
    return out
