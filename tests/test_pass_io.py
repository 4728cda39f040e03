"""Loading, saving and explaining: external data, in-memory inputs left untouched, --inspect on a partial match."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import onnx
import onnx_ir as ir
import ort_driver

import fastcar_compile as fc

L = 4


def _steps(seed: int = 0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 100, (2, 5))] + [rng.integers(0, 100, (2, 1)) for _ in range(2 * L)]


def test_external_data_lands_next_to_the_output(zoo_model, tmp_path):
    """An input with external weights compiles to fast.onnx + fast.onnx.data in the output folder, same results."""
    src = ir.load(zoo_model("llama", "dynamo20"))
    ext_dir = tmp_path / "in"
    ext_dir.mkdir()
    ir.save(src, ext_dir / "model.onnx", external_data="model.onnx.data", size_threshold_bytes=1024)
    before = (ext_dir / "model.onnx.data").read_bytes()
    out = tmp_path / "out" / "fast.onnx"
    fc.compile(ext_dir / "model.onnx", out, frame_tokens=L, threshold=float("inf"))
    assert (out.parent / "fast.onnx.data").is_file()
    proto = onnx.load(str(out), load_external_data=False)
    locations = {e.value for t in proto.graph.initializer for e in t.external_data if e.key == "location"}
    assert locations == {"fast.onnx.data"}
    assert (ext_dir / "model.onnx.data").read_bytes() == before
    assert sorted(os.listdir(out.parent)) == ["fast.onnx", "fast.onnx.data"]  # no temp folder left
    dense = ort_driver.decode(str(ext_dir / "model.onnx"), _steps(), pad=[0, 1])
    fast = ort_driver.decode(str(out), _steps(), pad=[0, 1], frame_tokens=L)
    for a, b in zip(dense.logits, fast.logits, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_in_memory_model_is_not_modified(zoo_model):
    model = ir.load(zoo_model("qwen2", "dynamo20"))
    before = ir.to_proto(model).SerializeToString()
    compiled, report = fc.compile(model, frame_tokens=L)
    assert ir.to_proto(model).SerializeToString() == before
    assert report.rewritten == [0, 1]
    assert any(n.domain == "ai.fastcar" for n in compiled.graph)


def test_inspect_explains_an_unmatched_layer(zoo_model, tmp_path):
    """Expose an MLP-internal value of layer 1 as a graph output: layer 1 cannot be isolated, layer 0 still can."""
    model = ir.load(zoo_model("llama", "dynamo20"))
    from fastcar_compile.passes.discover import discover

    mlp = discover(model)[1].mlp
    inner = next(n for n in mlp.nodes if n.op_type == "MatMul").outputs[0]
    inner.name = "exposed_mlp_value"
    model.graph.outputs.append(inner)
    path = tmp_path / "partial.onnx"
    ir.save(model, path)

    run = subprocess.run([sys.executable, "-m", "fastcar_compile", str(path), "--inspect"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    layer0 = next(line for line in lines if "layer   0" in line)
    layer1 = next(line for line in lines if "layer   1" in line)
    assert "matched" in layer0 and "NOT MATCHED" not in layer0
    assert "NOT MATCHED" in layer1 and "'mlp'" in layer1 and "exposed_mlp_value" in layer1

    out = tmp_path / "fast.onnx"
    _, report = fc.compile(path, out, frame_tokens=L)
    assert report.rewritten == [0]
    assert any("layers [1] left dense" in n for n in report.notes)
