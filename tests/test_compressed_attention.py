"""ai.fastcar CompressedAttention, plain mode: function body (stock ORT) and native kernel against an independent
NumPy attention (causal over KV indices, left-padding mask, GQA), for a growing cache, a preallocated buffer,
and the same buffer bound as past and present (written in place: only the new rows change)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import ort_driver
import pytest
from onnx import TensorProto, helper

from fastcar_compile.passes import fastcar_ops

HQ, HKV, D = 4, 2, 8


def _model(n_in: int = 7, n_out: int = 3, opset: int = 20, **attrs) -> bytes:
    names = ["q", "k", "v", "past_key", "past_value", "attention_mask", "total_len", "past_slots", "k_raw",
             "past_key_raw", "past_dense", "video_start"][:n_in]
    types = {"attention_mask": TensorProto.INT64, "total_len": TensorProto.INT32, "video_start": TensorProto.INT64}
    rank = {"attention_mask": 2, "total_len": 0, "video_start": 0}
    ins = [helper.make_tensor_value_info(n, types.get(n, TensorProto.FLOAT),
                                         [f"{n}_{i}" for i in range(rank.get(n, 4))]) for n in names]
    onames = ["out", "present_key", "present_value", "present_slots", "aligned_key", "present_key_raw",
              "present_dense", "kv_stats"][:n_out]
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [f"{n}_{i}" for i in range(
        3 if n in ("out", "kv_stats") else 4)]) for n in onames]
    attrs = {"num_heads": HQ, "kv_num_heads": HKV, "scale": 1 / np.sqrt(D), **attrs}
    node = helper.make_node("CompressedAttention", names, onames, domain="ai.fastcar", **attrs)
    model = helper.make_model(helper.make_graph([node], "g", ins, outs),
                              opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("ai.fastcar", 1)],
                              functions=[fastcar_ops.function_proto("CompressedAttention", opset)], ir_version=10)
    onnx.checker.check_model(model)
    return model.SerializeToString()


def session(native: bool, threads: int = 2, **kw) -> ort.InferenceSession:
    return ort_driver.make_session(_model(**kw), threads=threads, native=native)


def reference(q, keys, vals, mask, P, scale):
    """Independent dense attention: query i (KV index P + i) of row b sees key j iff j <= P + i and mask[b, j];
    one that sees nothing (a left pad) averages all P + S values, as exporters' finite-minimum masks do."""
    B, Hq, S, _ = q.shape
    g = Hq // keys.shape[1]
    out = np.zeros((B, S, Hq, q.shape[3]))
    for b in range(B):
        for h in range(Hq):
            for i in range(S):
                vis = [j for j in range(P + i + 1) if mask[b, j]]
                if not vis:
                    out[b, i, h] = vals[b, h // g, : mask.shape[1]].mean(0)
                    continue
                s = np.array([q[b, h, i] @ keys[b, h // g, j] for j in vis], np.float64) * scale
                w = np.exp(s - s.max())
                out[b, i, h] = (w / w.sum()) @ vals[b, h // g, vis]
    return out.reshape(B, S, Hq * q.shape[3])


def _case(rng, B, P, S, N, pad):
    T = P + S
    q = rng.standard_normal((B, HQ, S, D)).astype(np.float32)
    k, v = (rng.standard_normal((B, HKV, S, D)).astype(np.float32) for _ in range(2))
    pk, pv = (rng.standard_normal((B, HKV, N, D)).astype(np.float32) for _ in range(2))
    mask, _ = ort_driver.left_pad_masks(pad, T)
    return q, k, v, pk, pv, mask, np.array(T, np.int32)


@pytest.mark.parametrize("native", [False, True], ids=["body", "native"])
@pytest.mark.parametrize("P,S,extra", [(0, 6, 0), (5, 1, 0), (5, 3, 0), (5, 3, 4), (70, 1, 3), (9, 37, 0)])
def test_plain_mode_equals_numpy(native, P, S, extra):
    """Growing cache (extra = 0: present = past + new) and preallocated buffer (N = T + extra rows: rows past
    T keep their contents); batch 3 with left padding, multi-token steps after a past."""
    rng = np.random.default_rng(P * 7 + S)
    B, pad = 3, [0, 2, 4]
    N = P if extra == 0 else P + S + extra
    q, k, v, pk, pv, mask, T = _case(rng, B, P, S, N, pad)
    out, pres_k, pres_v = session(native).run(None, {"q": q, "k": k, "v": v, "past_key": pk, "past_value": pv,
                                                     "attention_mask": mask, "total_len": T})
    want_k = np.concatenate([pk[:, :, :P], k, pk[:, :, P + S:]], axis=2)
    want_v = np.concatenate([pv[:, :, :P], v, pv[:, :, P + S:]], axis=2)
    assert pres_k.shape == (B, HKV, max(N, P + S), D)
    np.testing.assert_array_equal(pres_k, want_k)
    np.testing.assert_array_equal(pres_v, want_v)
    want = reference(q.astype(np.float64), want_k, want_v, mask, P, 1 / np.sqrt(D))
    assert np.abs(out - want).max() <= 2e-5


def test_native_writes_the_shared_buffer_in_place():
    """The same OrtValue bound as past and present (GroupQueryAttention's past_present_share_buffer): the kernel
    writes only the S new rows into it; earlier rows and rows past total_len are untouched."""
    from onnxruntime.capi import _pybind_state as C

    sess = session(True)
    rng = np.random.default_rng(3)
    B, P, S, N = 2, 11, 2, 20
    q, k, v, pk, pv, mask, T = _case(rng, B, P, S, N, [0, 3])
    before_k, before_v = pk.copy(), pv.copy()
    out = np.empty((B, S, HQ * D), np.float32)
    feeds = {"q": q, "k": k, "v": v, "past_key": pk, "past_value": pv, "attention_mask": mask, "total_len": T}
    names = list(feeds)
    fv, ov = C.OrtValueVector(), C.OrtValueVector()
    keep = [ort.OrtValue.ortvalue_from_numpy(feeds[n]) for n in names]
    okeep = [ort.OrtValue.ortvalue_from_numpy(a) for a in (out, pk, pv)]
    for x in keep:
        fv.push_back(x._ortvalue)
    for x in okeep:
        ov.push_back(x._ortvalue)
    dev = C.OrtDevice(C.OrtDevice.cpu(), C.OrtDevice.default_memory(), 0)
    sess._sess.run_with_ortvaluevector(C.RunOptions(), names, fv, ["out", "present_key", "present_value"], ov,
                                       [dev] * 3)
    np.testing.assert_array_equal(pk[:, :, P:P + S], k)
    np.testing.assert_array_equal(pv[:, :, P:P + S], v)
    rest = np.ones(N, bool)
    rest[P:P + S] = False
    np.testing.assert_array_equal(pk[:, :, rest], before_k[:, :, rest])
    np.testing.assert_array_equal(pv[:, :, rest], before_v[:, :, rest])
    want = reference(q.astype(np.float64), pk, pv, mask, P, 1 / np.sqrt(D))
    assert np.abs(out - want).max() <= 2e-5
