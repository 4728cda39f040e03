"""ai.fastcar.TemporalGate's packed forms (packed_qkv, with or without do_rotary: the one-node gate of
onnxruntime-genai's packed-QKV layers) and the `age_offset` encoding: function body (stock ORT), native kernel and
the kernel under the op names models compiled before the one gate op carry, against a NumPy reading of
docs/DESIGN.md.

The reference rotates the query itself (GroupQueryAttention's do_rotary semantics: cos/sin rows at position
total_len - S + i, half-split or interleaved pairs, the first `rotary_embedding_dim` channels), so neither ORT's
RotaryEmbedding (the body) nor the kernel's own rotation is its source.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import ort_driver
import pytest
from gate_models import gate_model, legacy
from onnx import TensorProto, helper

from fastcar_compile.core import contract
from fastcar_compile.passes.fastcar_ops import DOMAIN, function_proto

pytestmark = pytest.mark.filterwarnings("ignore")
OUTS = ("replay", "tas", "slot", "write", "cached", "compute_all", "compute_some")
OUT_TYPES = (TensorProto.BOOL, TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL, TensorProto.FLOAT,
             TensorProto.BOOL, TensorProto.BOOL)


@pytest.fixture(scope="module")
def native_lib():
    """The kernels' library, or None where it cannot be built (the function-body half runs either way); it
    overrides conftest's skipping native_lib in this module."""
    return ort_driver.native_or_none()


def _libs(native_lib) -> list:
    """Function body (None), then the kernel where its library exists."""
    return [None] + ([native_lib] if native_lib is not None else [])


def _rotate(q, cos, sin, pos, rot, interleaved):
    """q [B, S, H, D] rotated at positions pos [S] in its first `rot` channels."""
    c, s = cos[pos][None, :, None, :], sin[pos][None, :, None, :]
    out = q.copy()
    if interleaved:
        x1, x2 = q[..., 0:rot:2], q[..., 1:rot:2]
        out[..., 0:rot:2], out[..., 1:rot:2] = x1 * c - x2 * s, x2 * c + x1 * s
    else:
        half = rot // 2
        x1, x2 = q[..., :half], q[..., half:rot]
        out[..., :half], out[..., half:rot] = x1 * c - x2 * s, x2 * c + x1 * s
    return out


def _reference(f, *, H, L, K, age_offset, t_index, rope, rot, interleaved):
    qkv, key, age, cache, total = f["qkv"], f["key"], f["age"], f["cache"], int(f["total_len"])
    B, S, _ = qkv.shape
    Hkv, D = key.shape[1], key.shape[3]
    vs, tau = int(f["video_start"]), f["threshold"].reshape(-1)[t_index]
    p = np.arange(total - S, total)
    q = qkv[..., :H * D].reshape(B, S, H, D)
    if rope:
        q = _rotate(q, f["cos"], f["sin"], p, rot, interleaved)
    tas = np.zeros((B, S), np.float32)
    for b in range(B):
        for i in range(S):
            k = key[b, :, max(p[i] - L, 0)]  # [Hkv, D]
            tas[b, i] = np.mean([q[b, i, h] @ k[h // (H // Hkv)] for h in range(H)]) / np.sqrt(D)
    slot = (p - vs) % L
    write = (p >= vs) & (p >= total - L)
    a = age[:, slot] - age_offset
    decode = total - S > 0 and S <= L  # after the prefill, at most one frame: every token decides
    elig = decode & (p - L >= vs)[None, :] & (a >= 0) & ((K == 0) | (a < K))
    replay = elig & (tas > tau)
    return {"replay": replay, "tas": tas, "slot": slot, "write": write, "cached": cache[:, slot],
            "compute_all": np.array(not replay.any()), "compute_some": np.array(not replay.all())}


FEEDS = {"q": "qkv", "key": "key", "past_mlp_age": "age", "past_mlp_cache": "cache", "threshold": "threshold",
         "video_start": "video_start", "total_len": "total_len", "cos_cache": "cos", "sin_cache": "sin"}


def _model(attrs: dict, rope: bool) -> onnx.ModelProto:
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    names = ["qkv", "key", "age", "cache", "threshold", "video_start", "total_len"] + (["cos", "sin"] if rope else [])
    types = [f, f, i64, f, f, i64, TensorProto.INT32, f, f]
    ins = [helper.make_tensor_value_info(n, t, None) for n, t in zip(names, types, strict=False)]
    outs = [helper.make_tensor_value_info(n, t, None) for n, t in zip(OUTS, OUT_TYPES, strict=True)]
    form = contract.GateForm(use_total_len=True, packed_qkv=True, do_rotary=rope)
    return gate_model(form, {k: v for k, v in FEEDS.items() if v in names}, attrs, ins, outs)


def _runs(model: onnx.ModelProto, feeds: dict, native_lib) -> list[tuple[str, dict]]:
    """(which, outputs): the function body, then where the library exists the kernel, and the kernel on the same
    model written with the old per-form op name (contract.LEGACY_GATE_OPS)."""
    runs = [("body", _run(model, feeds, None))]
    if native_lib is not None:
        runs += [("kernel", _run(model, feeds, native_lib)), ("legacy name", _run(legacy(model), feeds, native_lib))]
    return runs


def _run(model: onnx.ModelProto, feeds: dict, lib) -> dict:
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.log_severity_level = 1, 3
    if lib is not None:
        so.register_custom_ops_library(str(lib))
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return dict(zip(OUTS, sess.run(None, feeds), strict=True))


CASES = {  # B, H, Hkv, D, S, past, buffer rows (0: exactly T), L, video_start, K, rope, rot, interleaved, offset,
    #          per-layer taus, tau
    "decode rope, shared buffer, genai ages, per-layer tau": (6, 4, 2, 16, 1, 20, 40, 8, 3, 0, True, 16, 0, 1, 3, 0.0),
    "decode rope interleaved, partial rotary, drift guard": (5, 6, 3, 8, 1, 13, 0, 4, 2, 2, True, 4, 1, 0, 0, 0.0),
    "decode raw": (6, 4, 1, 16, 1, 9, 16, 4, 0, 0, False, 0, 0, 0, 0, 0.0),
    "prefill past a frame: writes, never replays": (2, 4, 2, 16, 6, 0, 12, 4, 1, 0, True, 16, 0, 1, 0, -np.inf),
    "multi-token step after a past: every token decides": (2, 4, 2, 8, 3, 11, 0, 8, 4, 0, True, 8, 0, 0, 0, -np.inf),
    "step longer than a frame after a past: computes": (2, 4, 2, 8, 10, 11, 0, 8, 0, 0, True, 8, 0, 0, 0, -np.inf),
    "every row replays": (3, 4, 2, 8, 1, 30, 0, 8, 0, 0, True, 8, 0, 1, 0, -np.inf),
    "aligned position before the video": (3, 4, 2, 8, 1, 5, 0, 8, 0, 0, False, 0, 0, 0, 0, -np.inf),
}


def case_feeds(name: str) -> tuple[np.random.Generator, dict[str, np.ndarray], dict[str, int]]:
    """CASES[name]'s random gate inputs (without cos/sin) and the gate's attributes, and the generator that drew
    them (the rope tables come next from it); shared with test_row_ops' Rows-variant test."""
    B, H, Hkv, D, S, past, rows, L, vs, K, rope, rot, inter, offset, n_tau, tau = CASES[name]
    rng = np.random.default_rng(len(name))
    T = past + S
    feeds = {
        "qkv": rng.standard_normal((B, S, (H + 2 * Hkv) * D)).astype(np.float32),
        "key": rng.standard_normal((B, Hkv, max(rows, T), D)).astype(np.float32),
        "age": (rng.integers(-1, 4, (B, L)) + offset).astype(np.int64),
        "cache": rng.standard_normal((B, L, 24)).astype(np.float32),
        "threshold": (rng.standard_normal(n_tau).astype(np.float32) * 0.1 if n_tau
                      else np.array(tau, np.float32)),
        "video_start": np.array(vs, np.int64),
        "total_len": np.array(T, np.int32),
    }
    if name == "every row replays":
        feeds["age"][:] = offset
    attrs = {"frame_tokens": L, "max_replay": K, "num_heads": H, "age_offset": offset,
             "threshold_index": n_tau - 1 if n_tau else 0}
    return rng, feeds, attrs


@pytest.mark.parametrize("name", list(CASES))
def test_packed_gate_body_and_kernel_match_numpy(native_lib, name):
    B, H, Hkv, D, S, past, rows, L, vs, K, rope, rot, inter, offset, n_tau, tau = CASES[name]
    T = past + S
    rng, feeds, attrs = case_feeds(name)
    if rope:
        attrs |= {"rotary_embedding_dim": rot, "interleaved": inter}
        angles = rng.uniform(0, 6.3, (T + 5, rot // 2))
        feeds["cos"], feeds["sin"] = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    want = _reference(feeds, H=H, L=L, K=K, age_offset=offset, t_index=attrs["threshold_index"], rope=rope,
                      rot=rot, interleaved=inter)
    model = _model(attrs, rope)
    for which, got in _runs(model, feeds, native_lib):  # function body, kernel, kernel under the old name
        for k in OUTS:
            assert got[k].shape == want[k].shape, (k, which)
            if k == "tas":
                np.testing.assert_allclose(got[k], want[k], atol=1e-5, rtol=0, err_msg=f"{k} {which}")
            else:
                np.testing.assert_array_equal(got[k], want[k], err_msg=f"{k} {which}")
    if name.startswith("decode rope, shared"):
        assert want["replay"].any() and not want["replay"].all(), "the case must mix replay and compute"
    if name == "every row replays":
        assert want["replay"].all()
    ort_driver.skip_native_half(native_lib)


def test_cache_update_age_offset(native_lib):
    """MLPCacheUpdate with age_offset 1 (genai's zero-filled state): a computed token's age resets to the
    offset, a replayed one counts on; body and kernel vs NumPy."""
    rng = np.random.default_rng(1)
    B, L, Hd, S = 3, 4, 6, 6
    f, i64, bl = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL
    names, types = ["c", "a", "v", "r", "s", "w"], [f, i64, f, bl, i64, bl]
    node = helper.make_node(contract.MLP_CACHE_UPDATE, names, ["c2", "a2"], domain=DOMAIN, age_offset=1)
    model = helper.make_model(
        helper.make_graph([node], "g", [helper.make_tensor_value_info(n, t, None) for n, t in zip(names, types, strict=True)],
                          [helper.make_tensor_value_info("c2", f, None), helper.make_tensor_value_info("a2", i64, None)]),
        ir_version=10, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid(DOMAIN, 1)],
        functions=[function_proto(contract.MLP_CACHE_UPDATE, 20)])
    p = np.arange(7, 7 + S)
    feeds = {"c": rng.standard_normal((B, L, Hd)).astype(np.float32),
             "a": rng.integers(0, 4, (B, L)).astype(np.int64), "v": rng.standard_normal((B, S, Hd)).astype(np.float32),
             "r": rng.random((B, S)) > 0.5, "s": (p - 5) % L, "w": (p >= 5) & (p >= p[-1] + 1 - L)}
    ref_c, ref_a = feeds["c"].copy(), feeds["a"].copy()
    for i in np.flatnonzero(feeds["w"]):
        s = feeds["s"][i]
        ref_c[:, s] = feeds["v"][:, i]
        ref_a[:, s] = np.where(feeds["r"][:, i], feeds["a"][:, s] + 1, 1)
    for lib in _libs(native_lib):
        so = ort.SessionOptions()
        if lib is not None:
            so.register_custom_ops_library(str(lib))
        c2, a2 = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(
            None, feeds)
        np.testing.assert_array_equal(c2, ref_c)
        np.testing.assert_array_equal(a2, ref_a)
    ort_driver.skip_native_half(native_lib)


@pytest.mark.parametrize("tas_query,gate", [("rope", "use_total_len_packed_qkv_do_rotary_select_rows"),
                                            ("raw", "use_total_len_packed_qkv_select_rows")])
def test_genai_layer_adds_three_main_graph_nodes(genai_model, fc_compile, tmp_path, tas_query, gate):
    """Every node on a genai step's main graph is a kernel launch per step, replayed or not: a rewritten layer
    (genai state names, per-layer tau) adds exactly its gate (which also selects the MLP's rows), the If and
    MLPCacheMerge; the If runs the MLP's own nodes or one Identity."""
    src = genai_model("llama", "fp32")
    out = tmp_path / "fast" / "fast.onnx"
    fc_compile(str(src / "model.onnx"), output=str(out), frame_tokens=4, threshold=[0.0, 1.0],
               per_layer_threshold=True, tas_query=tas_query)
    model = onnx.load(str(out), load_external_data=False)
    original = {n.name for n in onnx.load(str(src / "model.onnx"), load_external_data=False).graph.node}
    added: dict[str, list[str]] = {}
    for node in model.graph.node:
        if node.name not in original:
            layer = next(p.value for p in node.metadata_props if p.key == contract.TAG_LAYER)
            added.setdefault(layer, []).append(node.op_type + (f"[{node.overload}]" if node.overload else ""))
    assert added == {n: [f"{contract.TEMPORAL_GATE}[{gate}]", "If", contract.MLP_CACHE_MERGE] for n in ("0", "1")}
    mlp = ["MatMul", "MatMul", "Sigmoid", "Mul", "Mul", "MatMul"]  # the builder's SwiGLU
    for node in model.graph.node:
        if node.op_type == "If":
            branches = {a.name: [n.op_type for n in a.g.node] for a in node.attribute}
            assert branches == {"then_branch": mlp, "else_branch": ["Identity"]}


def _gqa_rotated(x: np.ndarray, past: int, cos: np.ndarray, sin: np.ndarray, interleaved: int, packed: bool) -> np.ndarray:
    """x [B, 1, H * D] as com.microsoft.GroupQueryAttention (do_rotary=1) rotates it at position `past`: fed as
    its key too (Hkv = H), read back from the present key [B, H, past + 1, D] at index `past`."""
    B, _, HD = x.shape
    H, D = 2, HD // 2
    f, i32 = TensorProto.FLOAT, TensorProto.INT32
    names = ["qkv", "", ""] if packed else ["q", "k", "v"]
    ins = [helper.make_tensor_value_info(n, f, None) for n in names if n]
    ins += [helper.make_tensor_value_info("pk", f, None), helper.make_tensor_value_info("pv", f, None),
            helper.make_tensor_value_info("seqlens", i32, None), helper.make_tensor_value_info("total", i32, None),
            helper.make_tensor_value_info("cos", f, None), helper.make_tensor_value_info("sin", f, None)]
    node = helper.make_node("GroupQueryAttention", [*names, "pk", "pv", "seqlens", "total", "cos", "sin"],
                            ["out", "present_key", "present_value"], domain="com.microsoft", num_heads=H,
                            kv_num_heads=H, do_rotary=1, rotary_interleaved=interleaved)
    outs = [helper.make_tensor_value_info(n, f, None) for n in ("out", "present_key", "present_value")]
    model = helper.make_model(helper.make_graph([node], "g", ins, outs), ir_version=10,
                              opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("com.microsoft", 1)])
    zeros = np.zeros((B, H, past, D), np.float32)
    feeds = {"pk": zeros, "pv": zeros, "seqlens": np.full(B, past, np.int32), "total": np.array(past + 1, np.int32),
             "cos": cos, "sin": sin}
    feeds |= {"qkv": np.concatenate([x, x, x], -1)} if packed else {"q": x, "k": x, "v": x}
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(["present_key"], feeds)[0][:, :, past]


@pytest.mark.parametrize("rot,interleaved,packed", [(32, 0, True), (32, 0, False), (16, 0, False), (16, 1, True),
                                                    (32, 1, False)])
def test_rope_gate_rotates_as_group_query_attention(native_lib, rot, interleaved, packed):
    """The `rope` gate's query rotation is GroupQueryAttention's own (do_rotary=1), read off ORT's op rather than
    written from the same formula: half-split or interleaved pairs, full or partial width, on a packed QKV or a
    separate query input (the Qwen3 builder form); function body and native kernel."""
    rng = np.random.default_rng(rot + interleaved + 2 * packed)
    B, H, D, L, past = 3, 2, 32, 4, 9
    q = rng.standard_normal((B, 1, H * D)).astype(np.float32)
    angles = rng.uniform(0, 6.3, (past + 4, rot // 2))
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    key = rng.standard_normal((B, H, past + 1, D)).astype(np.float32)
    rotated = _gqa_rotated(q, past, cos, sin, interleaved, packed)  # [B, H, D]
    want = (rotated * key[:, :, past - L]).sum(-1).mean(1) / np.sqrt(D)
    feeds = {"qkv": np.concatenate([q, q, q], -1) if packed else q, "key": key,
             "age": np.zeros((B, L), np.int64), "cache": np.zeros((B, L, 8), np.float32),
             "threshold": np.array(0.0, np.float32), "video_start": np.array(0, np.int64),
             "total_len": np.array(past + 1, np.int32), "cos": cos, "sin": sin}
    attrs = {"frame_tokens": L, "max_replay": 0, "num_heads": H, "rotary_embedding_dim": rot, "interleaved": interleaved}
    model = _model(attrs, rope=True)
    for which, got in _runs(model, feeds, native_lib):
        np.testing.assert_allclose(got["tas"][:, 0], want, atol=1e-5, rtol=0, err_msg=which)
    ort_driver.skip_native_half(native_lib)


def test_old_gate_name_runs_on_the_kernel_not_its_body(native_lib):
    """An old op name (TemporalGatePacked) resolves to the one kernel: with the model's own body for it made wrong
    (TAS negated), the registered library still gives the NumPy reference's TAS."""
    if native_lib is None:
        pytest.skip("native kernels not built here")
    name = "decode raw"
    B, H, Hkv, D, S, past, rows, L, vs, K, rope, rot, inter, offset, n_tau, tau = CASES[name]
    _, feeds, attrs = case_feeds(name)
    model = legacy(_model(attrs, rope=False))
    (fn,) = [f for f in model.functions if f.name == "TemporalGatePacked"]
    for node in fn.node:
        node.output[:] = ["tas_body" if o == "tas" else o for o in node.output]
        node.input[:] = ["tas_body" if i == "tas" else i for i in node.input]
    fn.node.append(helper.make_node("Neg", ["tas_body"], ["tas"]))
    want = _reference(feeds, H=H, L=L, K=K, age_offset=offset, t_index=attrs["threshold_index"], rope=False, rot=0,
                      interleaved=0)
    np.testing.assert_allclose(_run(model, feeds, None)["tas"], -want["tas"], atol=1e-5, rtol=0)  # the wrong body
    np.testing.assert_allclose(_run(model, feeds, native_lib)["tas"], want["tas"], atol=1e-5, rtol=0)
