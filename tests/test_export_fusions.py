"""Export fusions after the FastCar rewrite (passes/fuse_norm.py, fuse_rotary.py): RMSNorm chains ->
SimplifiedLayerNormalization (main graph and If branches), a residual Add + norm -> SkipSimplifiedLayerNormalization,
rotate-half RoPE -> com.microsoft.RotaryEmbedding.

References: the uncompiled export (tau = +inf: logits within 1e-4 over a long decode at batch 2 with left
padding) and the eager FastCar reference in PyTorch at finite tau (tests/test_pass_reference.py's check:
logits, replay decisions, TAS from the `rope` or `raw` query, final state). Each test also checks that the
fusions happened, so none passes on an unfused graph.
"""

from __future__ import annotations

import functools

import numpy as np
import onnx
import ort_driver
import pytest
import test_pass_reference as tpr
import zoo

from fastcar_compile.passes import fastcar_ops

L = 4
FAMILIES = [("llama", "dynamo20"), ("qwen2", "dynamo20"), ("phi3", "dynamo18")]


def _ops(graph: onnx.GraphProto) -> list[str]:
    """Op types of the graph and of every graph nested in it (If branches)."""
    out = []
    for node in graph.node:
        out.append(node.op_type)
        for attr in node.attribute:
            for g in [attr.g] if attr.HasField("g") else list(attr.graphs):
                out += _ops(g)
    return out


def _assert_fused(path, layers: int) -> None:
    graph = onnx.load(str(path)).graph
    ops = _ops(graph)
    # q and k of every layer: RotaryEmbedding nodes, or inside the packed attention op (passes/attention_form.py)
    packed = sum(n.op_type == "CompressedAttention" and n.overload == fastcar_ops.PACKED_ROTARY for n in graph.node)
    assert ops.count("RotaryEmbedding") + 2 * packed == 2 * layers
    # both residual Adds close into a norm: the attention's into the MLP norm (moved out of the If), the MLP's
    # into the next layer's (or the final) norm
    assert ops.count("SkipSimplifiedLayerNormalization") == 2 * layers
    # layer 0's input norm alone has no residual to close (the hoisted MLP norms and the final norm are Skip*Norms;
    # the rows op gathers the hoisted norm's rows: one MLP per layer, passes/branch.py)
    assert ops.count("SimplifiedLayerNormalization") == 1
    assert "Pow" not in ops and "Neg" not in ops and "Reciprocal" not in ops


@pytest.mark.parametrize("family,exporter", FAMILIES)
def test_fusions_equal_the_export(zoo_model, fc_compile, tmp_path, family, exporter):
    """tau = +inf: the fused compiled graph's logits equal the uncompiled export (batch 2, left padding, a
    3-token step after the prompt), and equal the same compile without fusions."""
    src = zoo_model(family, exporter)
    fused, plain = tmp_path / "fused.onnx", tmp_path / "plain.onnx"
    fc_compile(str(src), output=str(fused), frame_tokens=L, threshold=float("inf"))
    fc_compile(str(src), output=str(plain), frame_tokens=L, threshold=float("inf"), fusions=False)
    _assert_fused(fused, zoo.model_info(family).num_layers)
    assert "RotaryEmbedding" not in _ops(onnx.load(str(plain)).graph)
    rng = np.random.default_rng(2)
    pad = [0, 3]
    steps = [rng.integers(0, zoo.VOCAB, (2, 6))] + [rng.integers(0, zoo.VOCAB, (2, 1)) for _ in range(6 * L)]
    steps += [rng.integers(0, zoo.VOCAB, (2, 3))] + [rng.integers(0, zoo.VOCAB, (2, 1)) for _ in range(3 * L)]
    want = ort_driver.decode(src, steps, pad=pad)
    got = ort_driver.decode(fused, steps, pad=pad)
    unfused = ort_driver.decode(plain, steps, pad=pad)
    real = ort_driver.left_pad_masks(pad, 6)[0].astype(bool)
    assert np.abs(got.logits[0] - want.logits[0])[real].max() <= 1e-4
    for k in range(1, len(steps)):
        assert np.abs(got.logits[k] - want.logits[k]).max() <= 1e-4, f"step {k}"
        assert np.abs(got.logits[k] - unfused.logits[k]).max() <= 1e-4, f"step {k}"


@pytest.mark.parametrize("family,exporter,query", [("llama", "dynamo20", "rope"), ("qwen2", "dynamo20", "raw"),
                                                   ("phi3", "dynamo18", "rope")])
def test_fusions_match_eager_reference(zoo_model, fc_compile, tmp_path, family, exporter, query):
    """Finite tau: the fused graph's decisions, TAS, logits and state equal the eager PyTorch reference."""
    compiled = []

    def compile_and_keep(*args, **kwargs):
        compiled.append(kwargs["output"])
        return fc_compile(*args, **kwargs)

    case = tpr.Case(family, exporter, query, max_replay=2, pad=(0, 2), video_start=3)
    tpr.check_against_reference(zoo_model, functools.partial(compile_and_keep), tmp_path, case)
    _assert_fused(compiled[0], zoo.model_info(family).num_layers)


def test_fusions_off_switch(zoo_model, tmp_path):
    """--fusions off keeps the export's RMSNorm and RoPE ops (the CLI switch reaches the pipeline)."""
    from fastcar_compile.cli import main

    out = tmp_path / "fast.onnx"
    assert main([str(zoo_model("llama", "dynamo20")), "-o", str(out), "--frame-tokens", str(L),
                 "--fusions", "off"]) == 0
    ops = _ops(onnx.load(str(out)).graph)
    assert "Pow" in ops and "Neg" in ops and "RotaryEmbedding" not in ops


def _rope_graph(equal_halves: bool, f_batch: int = 2) -> onnx.ModelProto:
    """x [B, H, S, D] rotated by transformers' rotate-half with cos/sin = trig(Concat(f, g)) [B, S, D]: the
    halves are equal (g = f) as in every exporter's RoPE, or not (g = 2 f), which no RotaryEmbedding cache can hold."""
    from onnx import TensorProto as T
    from onnx import helper as h

    def c(name, vals):
        return h.make_node("Constant", [], [name], value=h.make_tensor(name, T.INT64, [len(vals)], vals))

    nodes = [c("half", [2]), c("end", [9]), c("zero", [0]), c("ax", [3]), c("one", [1]),
             h.make_node("Constant", [], ["two"], value=h.make_tensor("two", T.FLOAT, [], [2.0])),
             h.make_node("Mul", ["f", "two"], ["f2"]),
             h.make_node("Concat", ["f", "f" if equal_halves else "f2"], ["emb"], axis=-1),
             h.make_node("Cos", ["emb"], ["cos3"]), h.make_node("Sin", ["emb"], ["sin3"]),
             h.make_node("Unsqueeze", ["cos3", "one"], ["cos"]), h.make_node("Unsqueeze", ["sin3", "one"], ["sin"]),
             h.make_node("Slice", ["x", "zero", "half", "ax", "one"], ["x1"]),
             h.make_node("Slice", ["x", "half", "end", "ax", "one"], ["x2"]),
             h.make_node("Neg", ["x2"], ["nx2"]), h.make_node("Concat", ["nx2", "x1"], ["rot"], axis=-1),
             h.make_node("Mul", ["x", "cos"], ["a"]), h.make_node("Mul", ["rot", "sin"], ["b"]),
             h.make_node("Add", ["a", "b"], ["rope"]), h.make_node("Identity", ["rope"], ["y"])]
    graph = h.make_graph(nodes, "rope", [h.make_tensor_value_info("x", T.FLOAT, [2, 3, 5, 4]),
                                         h.make_tensor_value_info("f", T.FLOAT, [f_batch, 5, 2])],
                         [h.make_tensor_value_info("y", T.FLOAT, [2, 3, 5, 4])])
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 20)], ir_version=10)


@pytest.mark.parametrize("equal_halves,f_batch", [(True, 2), (False, 2), (True, 1)])
def test_rotary_fusion_claims_only_equal_halves(equal_halves, f_batch):
    """Equal cos/sin halves: fused, and ORT's RotaryEmbedding gives the unfused graph's output (per-row angles,
    batch 2); unequal halves, or one table broadcast over the batch ([1, S, D]: the caches are per row), are
    left as exported."""
    import onnx_ir as ir
    import onnxruntime as ort

    from fastcar_compile.passes.context import CompileContext, CompileOptions
    from fastcar_compile.passes.fuse_rotary import RotaryFusionPass

    proto = _rope_graph(equal_halves, f_batch)
    model = ir.from_proto(onnx.shape_inference.infer_shapes(proto))  # the pipeline's values carry shapes too
    result = RotaryFusionPass(CompileContext(CompileOptions(frame_tokens=1)))(model)
    claimed = equal_halves and f_batch == 2
    assert result.modified == claimed
    fused = ir.to_proto(result.model)
    assert ("RotaryEmbedding" in [n.op_type for n in fused.graph.node]) == claimed
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((2, 3, 5, 4)).astype(np.float32),
             "f": rng.uniform(0, 6, (f_batch, 5, 2)).astype(np.float32)}
    run = lambda m: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]  # noqa: E731
    np.testing.assert_allclose(run(fused), run(proto), atol=1e-5, rtol=0)
