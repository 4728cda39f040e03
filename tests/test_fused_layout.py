"""The layout form (passes/attention_form.py, built by passes/fused_attention.py): q/k/v stay [B, S, H*D] into RotaryEmbedding and CompressedAttention (qkv_perm), and the
gate of a dynamo export's fused layer is one packed TemporalGate; the MLP norm is joined to the residual Add. References: NumPy attention (the op on its own),
the eager PyTorch FastCar reference (finite tau, function bodies and native kernels) and the uncompiled export
(tau = +inf, tests/test_export_fusions.py and tests/test_fused_attention.py run the same compiles)."""

from __future__ import annotations

import functools

import numpy as np
import onnx
import ort_driver
import pytest
import test_pass_reference as tpr
from onnx import TensorProto, helper
from test_compressed_attention import HKV, HQ, D, reference

from fastcar_compile.core import contract
from fastcar_compile.passes import fastcar_ops

L = tpr.L


def test_layer_is_one_gate_and_no_layout_ops(zoo_model, fc_compile, tmp_path):
    """Each fused layer's main graph: no Transpose/Reshape between the projections and the attention, and the
    gate is one packed TemporalGate that selects rows (no TemporalGate on the [B, H, S, D] query, MLPCacheRead, tau
    Gather, Cast/ReduceSum/Equal/Less, SelectRows)."""
    out = tmp_path / "fast.onnx"
    _, report = fc_compile(str(zoo_model("llama", "dynamo20")), output=str(out), frame_tokens=L, threshold=[0.1, 0.2],
                           per_layer_threshold=True, pack_qkv=False)  # the layout form alone
    assert any("one-node gate (packed TemporalGate) in 2" in n for n in report.notes)
    graph = onnx.load(str(out)).graph
    ops = [n.op_type + (f"[{n.overload}]" if n.overload else "") for n in graph.node]
    rows_gate = f"TemporalGate[{contract.GateForm(True, False, True, False, True).overload}]"
    # the packed gate also selects the MLP's rows (select_rows); the merge writes the cache back
    assert ops.count(rows_gate) == 2 and ops.count("CompressedAttention") == 2
    assert ops.count("MLPCacheMerge") == 2 and ops.count("If") == 2
    assert ops.count(rows_gate) == sum(op.startswith("TemporalGate") for op in ops)  # no other gate
    for gone in ("SelectRows", "MLPCacheRead", "MLPCacheUpdate", "Transpose",
                 "Equal", "Less", "ReduceSum", "Add"):
        assert gone not in ops, gone  # (Add: the attention residual joins the MLP norm in a skip norm)
    for n in graph.node:
        if n.op_type == "If":  # compute: the MLP's own nodes from its first MatMul on; skip: one Identity
            then, other = (next(a.g for a in n.attribute if a.name == k) for k in ("then_branch", "else_branch"))
            assert then.node[0].op_type == "MatMul" and "If" not in [m.op_type for m in then.node]
            assert [m.op_type for m in other.node] == ["Identity"]
    assert ops.count("Reshape") <= 3  # the rotary caches' two and position rows, once per step
    for n in graph.node:
        if n.op_type == "CompressedAttention":
            assert [list(a.ints) for a in n.attribute if a.name == "qkv_perm"] == [[0, 2, 1, 3]]
    gates = [n for n in graph.node if n.op_type == "TemporalGate"]
    assert sorted(a.i for n in gates for a in n.attribute if a.name == "threshold_index") == [0, 1]


@pytest.mark.parametrize("case,runner", [
    (tpr.Case("llama", "dynamo20", "rope", max_replay=2, pad=(0, 2), video_start=3, per_layer=True, chunk=L + 2),
     "native"),
    (tpr.Case("llama", "dynamo20", "rope", max_replay=2, pad=(0, 2), video_start=3, per_layer=True, chunk=L + 2),
     "body"),
    (tpr.Case("llama", "dynamo20", "raw", max_replay=0, pad=(2, 0), video_start=2, layers=(1,), runtime_tau=True),
     "native"),
], ids=["rope-perlayer-chunk-native", "rope-perlayer-chunk-body", "raw-layer1-native"])
def test_packed_gate_matches_eager_reference(zoo_model, fc_compile, tmp_path, case, runner):
    """Finite tau: logits, replay decisions, TAS and final state equal the eager reference, with the native
    kernels (the packed TemporalGate on the [B, S, H*D] query, CompressedAttention with qkv_perm) and with the bodies;
    per-layer taus (threshold_index), a multi-token step after the prompt, TAS `raw` on a layer-subset model."""
    seen = []

    def compile_and_check(*args, **kwargs):
        result = fc_compile(*args, **kwargs)
        seen.append(result[1].notes)
        return result

    session = functools.partial(ort_driver.make_session, native=True, inputs=ort_driver.VIDEO_INPUTS) if runner == "native" else None
    tpr.check_against_reference(zoo_model, functools.partial(compile_and_check), tmp_path, case, session=session)
    n = len(case.layers) if case.layers else 2
    assert any(f"one-node gate (packed TemporalGate) in {n}" in note for note in seen[0])


def _bshd_model(opset: int = 20) -> bytes:
    """One CompressedAttention with qkv_perm [0, 2, 1, 3]: q [B, S, HQ*D], k/v [B, S, HKV*D]."""
    ins = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["B", "S", w]) for n, w in
           (("q", HQ * D), ("k", HKV * D), ("v", HKV * D))]
    ins += [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["B", HKV, "N", D]) for n in ("past_key", "past_value")]
    ins += [helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["B", "T"]),
            helper.make_tensor_value_info("total_len", TensorProto.INT32, [])]
    outs = [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["B", "S", HQ * D])]
    outs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["B", HKV, "M", D]) for n in ("pk", "pv")]
    node = helper.make_node("CompressedAttention", [i.name for i in ins], ["out", "pk", "pv"], domain="ai.fastcar",
                            num_heads=HQ, kv_num_heads=HKV, scale=1 / np.sqrt(D), qkv_perm=[0, 2, 1, 3])
    model = helper.make_model(helper.make_graph([node], "g", ins, outs),
                              opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("ai.fastcar", 1)],
                              functions=[fastcar_ops.function_proto("CompressedAttention", opset)], ir_version=10)
    onnx.checker.check_model(model)
    return model.SerializeToString()


@pytest.mark.parametrize("native", [False, True], ids=["body", "native"])
@pytest.mark.parametrize("P,S,extra", [(0, 5, 0), (6, 1, 0), (6, 3, 4)])
def test_bshd_inputs_equal_numpy(native, P, S, extra):
    """qkv_perm [0, 2, 1, 3]: [B, S, heads*D] inputs give NumPy's attention of the same heads (batch 3, left
    padding; a growing cache and a preallocated buffer; a prompt, one token, a multi-token step)."""
    sess = ort_driver.make_session(_bshd_model(), native=native)
    rng = np.random.default_rng(P + 10 * S)
    B, pad, N = 3, [0, 1, 3], P if extra == 0 else P + S + extra
    q = rng.standard_normal((B, HQ, S, D)).astype(np.float32)
    k, v = (rng.standard_normal((B, HKV, S, D)).astype(np.float32) for _ in range(2))
    pk, pv = (rng.standard_normal((B, HKV, N, D)).astype(np.float32) for _ in range(2))
    mask, _ = ort_driver.left_pad_masks(pad, P + S)

    def bse(x):  # [B, H, S, D] -> [B, S, H*D], the projections' layout
        return np.ascontiguousarray(x.transpose(0, 2, 1, 3).reshape(B, S, -1))

    out, pres_k, pres_v = sess.run(None, {"q": bse(q), "k": bse(k), "v": bse(v), "past_key": pk, "past_value": pv,
                                          "attention_mask": mask, "total_len": np.array(P + S, np.int32)})
    want_k = np.concatenate([pk[:, :, :P], k, pk[:, :, P + S:]], axis=2)
    want_v = np.concatenate([pv[:, :, :P], v, pv[:, :, P + S:]], axis=2)
    np.testing.assert_array_equal(pres_k, want_k)
    np.testing.assert_array_equal(pres_v, want_v)
    assert np.abs(out - reference(q.astype(np.float64), want_k, want_v, mask, P, 1 / np.sqrt(D))).max() <= 2e-5
