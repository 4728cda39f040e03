"""The ai.fastcar function bodies, run by stock ONNX Runtime, against a NumPy reading of docs/DESIGN.md."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from fastcar_compile.passes import fastcar_ops


def _session(op: str, inputs, outputs, attrs, opset: int = 20) -> ort.InferenceSession:
    node = helper.make_node(op, [i.name for i in inputs], [o.name for o in outputs], domain="ai.fastcar", **attrs)
    graph = helper.make_graph([node], "g", inputs, outputs)
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("ai.fastcar", 1)],
        functions=[fastcar_ops.function_proto(op, opset)],
        ir_version=10,
    )
    onnx.checker.check_model(model)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _vi(name, dtype, rank):
    """A graph input/output of the given rank with symbolic dims (the ops take any size)."""
    return helper.make_tensor_value_info(name, dtype, [f"{name}_{i}" for i in range(rank)])


def _gate_reference(q, key, age, tau, vstart, L, K):
    B, H, S, D = q.shape
    Hkv, T = key.shape[1], key.shape[2]
    g = H // Hkv
    p = np.arange(T - S, T)
    tas = np.zeros((B, S), np.float32)
    for b in range(B):
        for i in range(S):
            a = max(p[i] - L, 0)
            tas[b, i] = np.mean([q[b, h, i] @ key[b, h // g, a] for h in range(H)]) / np.sqrt(D)
    slot = (p - vstart) % L
    write = (p >= vstart) & (p >= T - L)
    age_slot = age[:, slot]
    decode = T - S > 0 and S <= L  # after the prefill, at most one frame: every token decides
    elig = decode & (p - L >= vstart)[None, :] & (age_slot >= 0) & ((K == 0) | (age_slot < K))
    return elig & (tas > tau), tas, slot, write


@pytest.mark.parametrize("S,T,vstart,K", [(1, 13, 2, 0), (1, 13, 2, 2), (1, 5, 2, 0), (4, 12, 3, 0), (3, 13, 2, 2),
                                             (6, 14, 3, 0), (9, 9, 0, 0)])
def test_temporal_gate_matches_numpy(S, T, vstart, K):
    rng = np.random.default_rng(S * 100 + T)
    B, H, Hkv, D, L = 3, 4, 2, 8, 4
    q = rng.standard_normal((B, H, S, D)).astype(np.float32)
    key = rng.standard_normal((B, Hkv, T, D)).astype(np.float32)
    age = rng.integers(-1, 4, size=(B, L)).astype(np.int64)
    sess = _session(
        "TemporalGate",
        [_vi("q", TensorProto.FLOAT, 4), _vi("k", TensorProto.FLOAT, 4), _vi("age", TensorProto.INT64, 2),
         _vi("tau", TensorProto.FLOAT, 0), _vi("vs", TensorProto.INT64, 0)],
        [_vi("replay", TensorProto.BOOL, 2), _vi("tas", TensorProto.FLOAT, 2),
         _vi("slot", TensorProto.INT64, 1), _vi("write", TensorProto.BOOL, 1)],
        {"frame_tokens": L, "max_replay": K},
    )
    ref = _gate_reference(q, key, age, 0.0, vstart, L, K)
    tau = np.float32(np.median(ref[1]))
    ref = _gate_reference(q, key, age, tau, vstart, L, K)
    got = sess.run(None, {"q": q, "k": key, "age": age, "tau": np.array(tau, np.float32), "vs": np.array(vstart)})
    np.testing.assert_allclose(got[1], ref[1], atol=1e-5)
    np.testing.assert_array_equal(got[2], ref[2])
    np.testing.assert_array_equal(got[3], ref[3])
    np.testing.assert_array_equal(got[0], ref[0])


def test_cache_update_and_read_match_numpy():
    rng = np.random.default_rng(0)
    B, L, Hd, S = 2, 4, 6, 6
    cache = rng.standard_normal((B, L, Hd)).astype(np.float32)
    age = rng.integers(-1, 3, size=(B, L)).astype(np.int64)
    branch = rng.standard_normal((B, S, Hd)).astype(np.float32)
    replay = rng.random((B, S)) > 0.5
    p = np.arange(7, 7 + S)
    slot = (p - 5) % L
    write = (p >= 5) & (p >= p[-1] + 1 - L)
    sess = _session(
        "MLPCacheUpdate",
        [_vi("c", TensorProto.FLOAT, 3), _vi("a", TensorProto.INT64, 2), _vi("v", TensorProto.FLOAT, 3),
         _vi("r", TensorProto.BOOL, 2), _vi("s", TensorProto.INT64, 1), _vi("w", TensorProto.BOOL, 1)],
        [_vi("c2", TensorProto.FLOAT, 3), _vi("a2", TensorProto.INT64, 2)],
        {},
    )
    c2, a2 = sess.run(None, {"c": cache, "a": age, "v": branch, "r": replay, "s": slot, "w": write})
    ref_c, ref_a = cache.copy(), age.copy()
    for i in range(S):
        if write[i]:
            ref_c[:, slot[i]] = branch[:, i]
            ref_a[:, slot[i]] = np.where(replay[:, i], age[:, slot[i]] + 1, 0)
    np.testing.assert_array_equal(c2, ref_c)
    np.testing.assert_array_equal(a2, ref_a)

    read = _session("MLPCacheRead", [_vi("c", TensorProto.FLOAT, 3), _vi("s", TensorProto.INT64, 1)],
                    [_vi("o", TensorProto.FLOAT, 3)], {})
    (o,) = read.run(None, {"c": cache, "s": slot})
    np.testing.assert_array_equal(o, cache[:, slot])


@pytest.mark.parametrize("form_name", ["plain", "total_len", "aligned_keys"])
@pytest.mark.parametrize("S,past,vstart,K", [(1, 12, 2, 0), (1, 12, 2, 2), (1, 4, 2, 0), (4, 8, 3, 0),
                                                   (3, 9, 2, 2), (6, 8, 3, 0)])
def test_temporal_gate_forms_body_kernel_and_old_names(form_name, S, past, vstart, K):
    """TemporalGate's [B, H, S, D] forms: positions from the key's length, from total_len with a longer
    (preallocated) key buffer, and aligned keys given per token (a compressed cache); function body, native
    kernel and the kernel under the old op name (TemporalGateAt / TemporalGateAligned) against NumPy."""
    import ort_driver
    from gate_models import gate_model, legacy

    from fastcar_compile.core import contract

    rng = np.random.default_rng(S * 100 + past + K + len(form_name))
    B, H, Hkv, D, L = 3, 4, 2, 8, 4
    T = past + S
    form = {"plain": contract.GateForm(), "total_len": contract.GateForm(use_total_len=True),
            "aligned_keys": contract.GateForm(use_total_len=True, aligned_keys=True)}[form_name]
    q = rng.standard_normal((B, H, S, D)).astype(np.float32)
    dense = rng.standard_normal((B, Hkv, T, D)).astype(np.float32)  # the reference's key cache
    age = rng.integers(-1, 4, size=(B, L)).astype(np.int64)
    tas0 = np.sort(_gate_reference(q, dense, age, 0.0, vstart, L, K)[1].reshape(-1))
    tau = np.float32((tas0[len(tas0) // 2 - 1] + tas0[len(tas0) // 2]) / 2)  # between two TAS: no rounding tie
    want = _gate_reference(q, dense, age, tau, vstart, L, K)
    p = np.arange(T - S, T)
    key = {"plain": dense, "total_len": np.concatenate([dense, rng.standard_normal((B, Hkv, 5, D))], 2),
           "aligned_keys": dense[:, :, np.maximum(p - L, 0)]}[form_name].astype(np.float32)
    feeds = {"q": q, "key": key, "age": age, "tau": np.array(tau, np.float32), "vs": np.array(vstart),
             "total": np.array(T, np.int32)}
    names = {"q": "q", "key": "key", "past_mlp_age": "age", "threshold": "tau", "video_start": "vs"}
    ins = [_vi("q", TensorProto.FLOAT, 4), _vi("key", TensorProto.FLOAT, 4), _vi("age", TensorProto.INT64, 2),
           _vi("tau", TensorProto.FLOAT, 0), _vi("vs", TensorProto.INT64, 0)]
    if form.use_total_len:
        names["total_len"] = "total"
        ins.append(_vi("total", TensorProto.INT32, 0))
    else:
        del feeds["total"]
    outs = [_vi("replay", TensorProto.BOOL, 2), _vi("tas", TensorProto.FLOAT, 2), _vi("slot", TensorProto.INT64, 1),
            _vi("write", TensorProto.BOOL, 1)]
    model = gate_model(form, names, {"frame_tokens": L, "max_replay": K}, ins, outs)
    onnx.checker.check_model(model)
    lib = ort_driver.native_or_none()
    runs = [("body", model, None)]
    if lib is not None:
        runs += [("kernel", model, lib), ("kernel, old op name", legacy(model), lib)]
    for which, m, use in runs:
        so = ort.SessionOptions()
        so.intra_op_num_threads, so.log_severity_level = 1, 3
        if use is not None:
            so.register_custom_ops_library(str(use))
        got = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)
        np.testing.assert_allclose(got[1], want[1], atol=1e-5, err_msg=which)
        for k in (0, 2, 3):
            np.testing.assert_array_equal(got[k], want[k], err_msg=which)
    ort_driver.skip_native_half(lib)
