"""What the compiled DiT mode tests share: compiling the exported step graph through the CLI, and a graph that
is not a DiT step graph."""

from __future__ import annotations

from pathlib import Path

from fastcar_compile.cli import main


def compile_cli(exported: Path, folder: Path, *args: str, name: str = "fast.onnx") -> Path:
    """`fastcar-compile EXPORTED -o FOLDER/NAME ARGS...`, asserting it succeeds; the compiled graph's path."""
    out = folder / name
    assert main([str(exported), "-o", str(out), *args]) == 0
    return out


def not_a_dit(folder: Path) -> Path:
    """A one-node Identity graph without the DiT metadata (what a DiT-only option must refuse); its path."""
    from onnx import TensorProto, helper, save

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    src = folder / "m.onnx"
    save(helper.make_model(helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [x], [y])), str(src))
    return src

