"""What the compiled DiT mode tests share: compiling the exported step graph through the CLI, a graph that is
not a DiT step graph, and reading a CLI refusal."""

from __future__ import annotations

from pathlib import Path

import pytest

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



def refusal(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run the CLI on ARGV, asserting it exits 2 (argparse's own refusal of a flag's value included) with no
    traceback; the last line it wrote to stderr."""
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's own refusal of a flag's value
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    return err.splitlines()[-1]
