"""The compiler as a pass pipeline: the pass list, --verbose, negative thresholds, quiet shape inference."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

import fastcar_compile as fc
from fastcar_compile import api
from fastcar_compile.cli import main
from fastcar_compile.passes import pipeline
from fastcar_compile.passes.context import CompileContext, CompileOptions

L = 4
PASSES = ["RotaryFusionPass", "RmsNormFusionPass", "SkipNormFusionPass",
          "DiscoverPass", "SelectLayersPass", "PlanPass", "FusedAttentionPass",
          "GatePass", "BranchPass", "CacheStatePass", "NativeGqaPass", "KvDimNamesPass",
          "IrVersionPass", "MetadataPass", "ValidatePass", "SavePass"]


def test_pass_list_follows_the_options():
    names = lambda **kw: [line.split()[0] for line in api.pass_list(**kw)]  # noqa: E731
    assert names() == PASSES
    assert names(validate=False) == [p for p in PASSES if p != "ValidatePass"]
    assert names(output=False) == PASSES[:-2]
    manager = pipeline.build(CompileContext(CompileOptions(frame_tokens=L)))
    assert all(isinstance(p, ir.passes.InPlacePass) for p in manager.passes)


def test_verbose_prints_the_pass_list(zoo_model, tmp_path, capsys):
    out = tmp_path / "fast.onnx"
    assert main([str(zoo_model("llama", "dynamo20")), "-o", str(out), "--frame-tokens", str(L), "--verbose"]) == 0
    text = capsys.readouterr().out
    listed = [line.split()[1] for line in text.splitlines() if line.strip()[:2].rstrip(".").isdigit()]
    assert listed == PASSES
    assert out.is_file()


@pytest.mark.parametrize("value,expected", [("-1e30", -1e30), ("-inf", -np.inf), ("-2.5", -2.5)])
def test_negative_threshold_values_are_accepted(zoo_model, tmp_path, value, expected):
    out = tmp_path / "fast.onnx"
    assert main([str(zoo_model("llama", "dynamo20")), "-o", str(out), "--frame-tokens", str(L),
                 "--threshold", value, "--no-validate"]) == 0
    model = onnx.load(str(out))
    tau = next(t for t in model.graph.initializer if t.name == "fastcar_threshold")
    assert onnx.numpy_helper.to_array(tau) == np.float32(expected)


def test_per_layer_negative_list(zoo_model, tmp_path):
    out = tmp_path / "fast.onnx"
    assert main([str(zoo_model("llama", "dynamo20")), "-o", str(out), "--frame-tokens", str(L), "--per-layer-threshold",
                 "--threshold", "-1e30,-inf", "--no-validate"]) == 0
    tau = next(t for t in onnx.load(str(out)).graph.initializer if t.name == "fastcar_threshold")
    np.testing.assert_array_equal(onnx.numpy_helper.to_array(tau), np.array([-1e30, -np.inf], np.float32))


def _shape_inference_breaker(path):
    """A decoder-shaped graph (present.0.key/value outputs) whose ONNX shape inference fails (float + int64
    in one Add), and no attention, so discovery asks for shape inference."""
    x = helper.make_tensor_value_info("input_ids", TensorProto.FLOAT, [2, 3])
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("present.0.key", "present.0.value")]
    nodes = [helper.make_node("Constant", [], ["c"], value=helper.make_tensor("s", TensorProto.INT64, [1], [7])),
             helper.make_node("Add", ["input_ids", "c"], ["bad"]),
             helper.make_node("Identity", ["bad"], ["present.0.key"]),
             helper.make_node("Identity", ["input_ids"], ["present.0.value"])]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], outs), opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, str(path))
    with pytest.raises(onnx.shape_inference.InferenceError):  # the premise: shape inference really fails on this graph
        onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True, data_prop=True)
    return path


def test_failed_shape_inference_is_one_line(tmp_path, capfd):
    path = _shape_inference_breaker(tmp_path / "broken.onnx")
    assert main([str(path), "--inspect"]) == 2
    captured = capfd.readouterr()
    text = captured.out + captured.err
    assert "Traceback" not in text
    assert sum("shape inference failed" in line for line in text.splitlines()) == 1
    assert "missing anchor" in text
    with pytest.raises(fc.FastCarError, match="no decoder layer matched"):
        fc.compile(path, frame_tokens=L)
