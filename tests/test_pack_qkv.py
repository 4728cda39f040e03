"""The packed form (passes/attention_form.py, built by passes/fused_attention.py): one packed q/k/v MatMul per layer, RoPE inside CompressedAttention (overload packed_rotary)
and the gate (TemporalGate with packed_qkv and do_rotary). References: NumPy (the op alone: rotation at KV indices, attention), the
eager PyTorch FastCar reference (finite tau: logits, decisions, TAS, state) and the uncompiled export (tau = +inf),
with batch 2, left padding and a multi-token step after the prompt, through the function bodies and the kernels."""

from __future__ import annotations

import functools

import numpy as np
import onnx
import ort_driver
import pytest
import test_pass_reference as tpr
import zoo
from onnx import TensorProto, helper
from test_compressed_attention import HKV, HQ, D, reference

from fastcar_compile.core import contract
from fastcar_compile.passes import attention_form, fastcar_ops

L = tpr.L
PACKED = fastcar_ops.PACKED_ROTARY


def _rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleaved: bool) -> np.ndarray:
    """RoPE of x [B, H, S, D] with per-token cos/sin [S, D/2] in float64 (half-split or interleaved pairs)."""
    half = cos.shape[-1]
    a = np.arange(half)
    i1, i2 = (2 * a, 2 * a + 1) if interleaved else (a, a + half)
    out = x.astype(np.float64).copy()
    c, s = cos[None, None], sin[None, None]
    out[..., i1] = x[..., i1] * c - x[..., i2] * s
    out[..., i2] = x[..., i2] * c + x[..., i1] * s
    return out


def _packed_model(interleaved: int, positions: int, do_rotary: int = 1) -> bytes:
    """One CompressedAttention[packed_rotary]: qkv [B, S, (HQ + 2 HKV) D], empty k/v/optional inputs, cos/sin."""
    W = (HQ + 2 * HKV) * D
    ins = [helper.make_tensor_value_info("qkv", TensorProto.FLOAT, ["B", "S", W])]
    ins += [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["B", HKV, "N", D]) for n in ("past_key", "past_value")]
    ins += [helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["B", "T"]),
            helper.make_tensor_value_info("total_len", TensorProto.INT32, []),
            helper.make_tensor_value_info("cos", TensorProto.FLOAT, [positions, D // 2]),
            helper.make_tensor_value_info("sin", TensorProto.FLOAT, [positions, D // 2])]
    outs = [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["B", "S", HQ * D])]
    outs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["B", HKV, "M", D]) for n in ("pk", "pv")]
    none_f = helper.make_tensor("none", TensorProto.FLOAT, [0], [])
    none_i = helper.make_tensor("none_i64", TensorProto.INT64, [0], [])
    node = helper.make_node("CompressedAttention", ["qkv", "none", "none", "past_key", "past_value", "attention_mask",
                                                    "total_len", "none", "none", "none", "none", "none_i64", "cos",
                                                    "sin"], ["out", "pk", "pv"], domain="ai.fastcar",
                            num_heads=HQ, kv_num_heads=HKV, scale=1 / np.sqrt(D), qkv_perm=[0, 2, 1, 3],
                            do_rotary=do_rotary, rotary_interleaved=interleaved)
    node.overload = PACKED
    fns = [fastcar_ops.function_proto("CompressedAttention", 20),
           fastcar_ops.function_proto("CompressedAttention", 20, PACKED)]
    model = helper.make_model(helper.make_graph([node], "g", ins, outs, [none_f, none_i]),
                              opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("ai.fastcar", 1),
                                             helper.make_opsetid("com.microsoft", 1)], functions=fns, ir_version=10)
    onnx.checker.check_model(model)
    return model.SerializeToString()


@pytest.mark.parametrize("native", [False, True], ids=["body", "native"])
@pytest.mark.parametrize("P,S,extra,interleaved", [(0, 5, 0, 0), (6, 1, 0, 0), (6, 3, 4, 0), (6, 2, 0, 1)])
def test_packed_rotary_op_equals_numpy(native, P, S, extra, interleaved):
    """The op on a packed projection: q and k rotated at KV index P + i by the table rows, then NumPy's attention
    over the past and the rotated new keys (batch 3, left padding; growing cache and preallocated buffer)."""
    positions = 40
    sess = ort_driver.make_session(_packed_model(interleaved, positions), native=native)
    rng = np.random.default_rng(P + 10 * S + interleaved)
    B, pad, N = 3, [0, 1, 3], P if extra == 0 else P + S + extra
    qkv = rng.standard_normal((B, S, (HQ + 2 * HKV) * D)).astype(np.float32)
    angles = np.arange(positions)[:, None] * rng.uniform(0.05, 1.0, D // 2)[None, :]
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    pk, pv = (rng.standard_normal((B, HKV, N, D)).astype(np.float32) for _ in range(2))
    mask, _ = ort_driver.left_pad_masks(pad, P + S)
    out, pres_k, pres_v = sess.run(None, {"qkv": qkv, "past_key": pk, "past_value": pv, "attention_mask": mask,
                                          "total_len": np.array(P + S, np.int32), "cos": cos, "sin": sin})

    def heads(lo, n):  # channels [lo, lo + n*D) of the packed rows as [B, n, S, D]
        return qkv[..., lo:lo + n * D].reshape(B, S, n, D).transpose(0, 2, 1, 3)

    rows = slice(P, P + S)
    q = _rotate(heads(0, HQ), cos[rows].astype(np.float64), sin[rows].astype(np.float64), bool(interleaved))
    k = _rotate(heads(HQ * D, HKV), cos[rows].astype(np.float64), sin[rows].astype(np.float64), bool(interleaved))
    v = heads((HQ + HKV) * D, HKV)
    want_k = np.concatenate([pk[:, :, :P], k, pk[:, :, P + S:]], axis=2)
    want_v = np.concatenate([pv[:, :, :P], v, pv[:, :, P + S:]], axis=2)
    np.testing.assert_allclose(pres_k, want_k, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(pres_v, want_v)
    assert np.abs(out - reference(q, want_k, want_v, mask, P, 1 / np.sqrt(D))).max() <= 2e-5


def _prompt_feeds(S: int, rows: int) -> dict[str, np.ndarray]:
    """A first prompt of S tokens (batch 1, empty past) for the one-node packed model, with a rows-long table."""
    return {"qkv": np.zeros((1, S, (HQ + 2 * HKV) * D), np.float32),
            "past_key": np.zeros((1, HKV, 0, D), np.float32), "past_value": np.zeros((1, HKV, 0, D), np.float32),
            "attention_mask": np.ones((1, S), np.int64), "total_len": np.array(S, np.int32),
            "cos": np.ones((rows, D // 2), np.float32), "sin": np.zeros((rows, D // 2), np.float32)}


def test_packed_rotary_op_refuses_a_short_table():
    """A KV index past the table fails the Run with a message naming --rotary-positions (native kernel)."""
    sess = ort_driver.make_session(_packed_model(0, 4), native=True)
    feeds = _prompt_feeds(S=6, rows=4)
    with pytest.raises(Exception, match="rotary-positions"):
        sess.run(None, feeds)


def test_kernel_refuses_packed_qkv_without_rotary():
    """The packed_rotary body always rotates: the kernel computes no packed form without do_rotary (it refuses it)
    rather than a different model than the body."""
    sess = ort_driver.make_session(_packed_model(0, 8, do_rotary=0), native=True)
    feeds = _prompt_feeds(S=2, rows=8)
    with pytest.raises(Exception, match="packed q/k/v .* needs do_rotary = 1"):
        sess.run(None, feeds)


def _layer_ops(path) -> tuple[list[onnx.NodeProto], dict[str, int]]:
    graph = onnx.load(str(path)).graph
    nodes = list(graph.node)
    return nodes, {op: sum(n.op_type == op for n in nodes) for op in {n.op_type for n in nodes}}


def test_pass_fires_and_weights_do_not_grow(zoo_model, fc_compile, tmp_path):
    """Per layer: one MatMul into the packed attention (plus the output projection), no RotaryEmbedding, the
    gate rotates the packed query itself; the q/k/v weights are replaced, not kept beside the packed one; the
    per-step rotary plumbing (Cos/Sin of the positions, cache Slices/Reshapes) is gone with them."""
    src = zoo_model("llama", "dynamo20")
    packed, plain = tmp_path / "packed.onnx", tmp_path / "plain.onnx"
    _, report = fc_compile(str(src), output=str(packed), frame_tokens=L, threshold=0.5, rotary_positions=64)
    fc_compile(str(src), output=str(plain), frame_tokens=L, threshold=0.5, pack_qkv=False)
    assert any("packed QKV with RoPE inside CompressedAttention in 2 layers" in n for n in report.notes)
    nodes, ops = _layer_ops(packed)
    _, plain_ops = _layer_ops(plain)
    layers = zoo.model_info("llama").num_layers
    cas = [n for n in nodes if n.op_type == "CompressedAttention"]
    assert len(cas) == layers and all(n.overload == PACKED for n in cas)
    assert "RotaryEmbedding" not in ops and ops.get("Cos", 0) == 0 and ops.get("Sin", 0) == 0
    # the gate rotates the query itself (and selects the MLP rows: the Rows variant)
    gates = [n.overload for n in nodes if n.op_type == contract.TEMPORAL_GATE]
    rope_rows = contract.GateForm(use_total_len=True, packed_qkv=True, do_rotary=True, select_rows=True)
    assert gates == [rope_rows.overload] * layers, gates
    assert plain_ops["MatMul"] - ops["MatMul"] == 2 * layers
    for ca in cas:  # the packed projection feeds the op and the gate, nothing else
        qkv = ca.input[0]
        readers = [n.op_type for n in nodes if qkv in n.input]
        assert readers == ["CompressedAttention", contract.TEMPORAL_GATE], readers

    def weight_bytes(path):
        model = onnx.load(str(path))
        return sum(onnx.numpy_helper.to_array(t).nbytes for t in model.graph.initializer
                   if not t.name.startswith(attention_form.TABLE_PREFIX))

    # not more; less only by the rotary plumbing's small constants (inv_freq, index vectors)
    assert weight_bytes(plain) - 1024 <= weight_bytes(packed) <= weight_bytes(plain)


def test_pass_explains_what_it_leaves(zoo_model, fc_compile, tmp_path):
    """TAS `raw` layers stay unpacked and the notes say why; --pack-qkv off keeps every layer as it was."""
    src = zoo_model("llama", "dynamo20")
    _, report = fc_compile(str(src), output=str(tmp_path / "raw.onnx"), frame_tokens=L, threshold=0.5,
                           tas_query="raw")
    assert any("packed QKV: left" in n and "TAS `raw`" in n for n in report.notes)
    _, ops = _layer_ops(tmp_path / "raw.onnx")
    assert ops["RotaryEmbedding"] == 2 * zoo.model_info("llama").num_layers

    from fastcar_compile.cli import main

    out = tmp_path / "off.onnx"
    assert main([str(src), "-o", str(out), "--frame-tokens", str(L), "--pack-qkv", "off"]) == 0
    nodes, ops = _layer_ops(out)
    assert ops["RotaryEmbedding"] == 4 and not any(n.overload for n in nodes if n.op_type == "CompressedAttention")


OPS = {"fastcar": "CompressedAttention", "gqa": "GroupQueryAttention"}


@pytest.mark.parametrize("kind,family,runner", [("fastcar", "llama", "native"), ("fastcar", "llama", "body"),
                                                ("fastcar", "qwen2", "native"), ("gqa", "llama", "native"),
                                                ("gqa", "llama", "body")])
def test_packed_matches_eager_reference(zoo_model, fc_compile, tmp_path, kind, family, runner):
    """Finite tau, batch 2 with left padding, per-layer taus (fastcar: and a multi-token step after the prompt,
    which ORT's GroupQueryAttention refuses at batch 2): logits, replay decisions, TAS and final state equal the
    eager PyTorch reference, both fused kinds (qwen2: q/k/v biases, packed too)."""
    notes = []

    def compile_and_check(*args, **kwargs):
        result = fc_compile(*args, fused_attention=kind, **kwargs)
        notes.extend(result[1].notes)
        return result

    case = tpr.Case(family, "dynamo20", "rope", max_replay=2, pad=(0, 2), video_start=3, per_layer=True,
                    chunk=L + 2 if kind == "fastcar" else 0)
    session = functools.partial(ort_driver.make_session, native=True, inputs=ort_driver.VIDEO_INPUTS) if runner == "native" else None
    tpr.check_against_reference(zoo_model, compile_and_check, tmp_path, case, session=session)
    n = zoo.model_info(family).num_layers
    assert any(f"packed QKV with RoPE inside {OPS[kind]} in {n} layers" in x for x in notes), notes


@pytest.mark.parametrize("kind,runner", [("fastcar", "native"), ("fastcar", "body"), ("gqa", "native")])
def test_packed_equals_the_export_at_inf(zoo_model, fc_compile, tmp_path, kind, runner):
    """tau = +inf: the packed graph's logits equal the uncompiled export's over a long decode (batch 2, left
    padding of 3; fastcar: a 3-token step after the prompt)."""
    src = zoo_model("llama", "dynamo20")
    out = tmp_path / "fast.onnx"
    fc_compile(str(src), output=str(out), frame_tokens=L, threshold=float("inf"), fused_attention=kind)
    nodes = onnx.load(str(out)).graph.node
    if kind == "fastcar":
        assert sum(n.overload == PACKED for n in nodes) == 2
    else:  # GroupQueryAttention's own packed form: key/value empty, do_rotary with the table
        gqa = [n for n in nodes if n.op_type == "GroupQueryAttention"]
        assert len(gqa) == 2 and all(n.input[1] == "" and n.input[7] for n in gqa)
        assert all(a.i == 1 for n in gqa for a in n.attribute if a.name == "do_rotary")
        assert not any(n.op_type == "RotaryEmbedding" for n in nodes)
    rng = np.random.default_rng(5)
    pad = [0, 3]
    steps = [rng.integers(0, zoo.VOCAB, (2, 6))] + [rng.integers(0, zoo.VOCAB, (2, 1)) for _ in range(5 * L)]
    if kind == "fastcar":
        steps += [rng.integers(0, zoo.VOCAB, (2, 3))] + [rng.integers(0, zoo.VOCAB, (2, 1)) for _ in range(2 * L)]
    want = ort_driver.decode(src, steps, pad=pad)
    got = ort_driver.decode(ort_driver.make_session(out, native=runner == "native"), steps, pad=pad)
    real = ort_driver.left_pad_masks(pad, 6)[0].astype(bool)
    assert np.abs(got.logits[0] - want.logits[0])[real].max() <= 1e-4
    for k in range(1, len(steps)):
        assert np.abs(got.logits[k] - want.logits[k]).max() <= 1e-4, f"step {k}"


def _export_with_hf_positions(src, steps: list[np.ndarray], masks: list[np.ndarray]) -> list[np.ndarray]:
    """The uncompiled export in plain ONNX Runtime, fed as transformers does: the whole attention mask so far and
    position_ids = the count of real tokens before each token (0 for a row's leading padding)."""
    sess = ort_driver.make_session(src)
    names = [o.name for o in sess.get_outputs()]
    state = ort_driver.initial_state(sess, int(steps[0].shape[0]))
    full, seen, logits = np.zeros((steps[0].shape[0], 0), np.int64), np.zeros(steps[0].shape[0], np.int64), []
    for ids, m in zip(steps, masks, strict=True):
        full = np.concatenate([full, m], axis=1)
        pos = np.maximum(seen[:, None] + np.cumsum(m, axis=1) - 1, 0)
        seen = seen + m.sum(axis=1)
        outs = dict(zip(names, sess.run(names, {"input_ids": ids, "attention_mask": full, "position_ids": pos,
                                                 **state}), strict=True))
        state.update({ort_driver.past_name_for(n): v for n, v in outs.items() if ort_driver.past_name_for(n)})
        logits.append(outs["logits"])
    return logits


def test_session_refuses_feeds_the_packed_rotary_cannot_honour(zoo_model, fc_compile, tmp_path):
    """Packed rotary turns at the KV index, the export at KV index minus the row's left padding (equal scores:
    RoPE depends on differences, and that padding is a per-row constant only before the first real token).
    FastCarSession refuses (one line naming --pack-qkv off / --rotary-positions) a mask 0 after a row's first
    real token, explicit position_ids other than the real-token counts, and a video past the table; the same
    mid-stream padding on a --pack-qkv off compile equals the export fed transformers' positions."""
    from fastcar_compile.core.errors import FastCarError
    from fastcar_compile.runtime import FastCarSession

    src = zoo_model("llama", "dynamo20")
    packed, plain = tmp_path / "packed.onnx", tmp_path / "plain.onnx"
    fc_compile(str(src), output=str(packed), frame_tokens=L, threshold=float("inf"), rotary_positions=24)
    fc_compile(str(src), output=str(plain), frame_tokens=L, threshold=float("inf"), pack_qkv=False)
    meta = {m.key: m.value for m in onnx.load(str(packed), load_external_data=False).metadata_props}
    assert meta["fastcar.rotary_positions"] == "24"
    assert "fastcar.rotary_positions" not in {m.key for m in onnx.load(str(plain), load_external_data=False)
                                              .metadata_props}
    rng = np.random.default_rng(11)
    prompt_mask = ort_driver.left_pad_masks([0, 2], 6)[0]
    steps = [rng.integers(0, zoo.VOCAB, (2, 6))] + [rng.integers(0, zoo.VOCAB, (2, 1)) for _ in range(6)]
    masks = [prompt_mask] + [np.array([[1], [0]]) if k == 1 else np.ones((2, 1), np.int64) for k in range(6)]

    with pytest.raises(FastCarError, match="rotary-positions 25"):
        FastCarSession(packed, max_length=25, native=False)
    s = FastCarSession(packed)
    out = s.step(s.new_state(2), steps[0], attention_mask=prompt_mask)  # left padding: exact, accepted
    out = s.step(out.state, steps[1], position_ids=np.array([[6], [4]]))  # the implied positions: accepted
    with pytest.raises(FastCarError, match=r"row 1 has a 0 after a real token.*--pack-qkv off"):
        s.step(out.state, steps[2], attention_mask=masks[2])
    with pytest.raises(FastCarError, match=r"position_ids\[1, 0\] = 3 but .* at 5 .*--pack-qkv off"):
        s.step(out.state, steps[2], position_ids=np.array([[7], [3]]))
    with pytest.raises(FastCarError, match="0 after a real token"):  # padding inside the prompt, not before it
        s.step(s.new_state(1), steps[0][:1], attention_mask=np.array([[1, 1, 0, 1, 1, 1]]))
    with pytest.raises(FastCarError, match=r"rotary table covers 24 positions.*--rotary-positions 25"):
        s.step(out.state, rng.integers(0, zoo.VOCAB, (2, 18)))
    with pytest.raises(FastCarError, match="rotary-positions"):  # refused before the prompt runs
        s.generate([[1, 2, 3]], num_frames=24 // L + 1)

    want = _export_with_hf_positions(src, steps, masks)
    s = FastCarSession(plain)
    state = s.new_state(2)
    for k, (ids, m) in enumerate(zip(steps, masks, strict=True)):
        out = s.step(state, ids, attention_mask=m)
        state = out.state
        rows = [0] if k == 2 else [0, 1]  # (row 1's padded token itself: logits of no real token)
        real = m[rows].astype(bool)
        assert np.abs(out.logits[rows] - want[k][rows])[real].max() <= 1e-4, f"step {k}"


@pytest.mark.parametrize("switch", [False, True], ids=["plain", "length_dependent"])
def test_table_refuses_a_rotary_that_depends_on_the_length(switch):
    """rotary_table: cos/sin of position_ids alone give the table NumPy computes; a rotary whose frequencies switch with
    max(position_ids) (dynamic / longrope scaling) is refused with a reason instead of tabulated."""
    import onnx_ir as ir


    half, inv = 4, (1.0 / 10000 ** (np.arange(4) / 4)).astype(np.float32)
    t = helper.make_tensor
    nodes = [helper.make_node("Cast", ["position_ids"], ["pf"], to=TensorProto.FLOAT),
             helper.make_node("Unsqueeze", ["pf", "ax"], ["pu"]),
             helper.make_node("Mul", ["pu", "inv"], ["ang0"]),
             helper.make_node("ReduceMax", ["pf"], ["mx"], keepdims=0),
             helper.make_node("Greater", ["mx", "limit"], ["long"]),
             helper.make_node("Where", ["long", "half_f", "one_f"], ["scale"]),
             helper.make_node("Mul", ["ang0", "scale"], ["ang"]),
             helper.make_node("Reshape", ["ang", "shape"], ["ang2"]),
             helper.make_node("Cos", ["ang2"], ["cos"]), helper.make_node("Sin", ["ang2"], ["sin"])]
    inits = [t("ax", TensorProto.INT64, [1], [-1]), t("inv", TensorProto.FLOAT, [half], inv),
             t("limit", TensorProto.FLOAT, [], [80.0 if switch else 1e9]), t("half_f", TensorProto.FLOAT, [], [0.5]),
             t("one_f", TensorProto.FLOAT, [], [1.0]), t("shape", TensorProto.INT64, [2], [-1, half])]
    graph = helper.make_graph(nodes, "rope", [helper.make_tensor_value_info("position_ids", TensorProto.INT64,
                                                                            [1, "S"])],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("cos", "sin")],
                              inits)
    model = ir.serde.deserialize_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    outs = tuple(model.graph.outputs)
    found = attention_form.rotary_table(model, outs, 100)
    if switch:
        assert isinstance(found, str) and "depend on the sequence length" in found
    else:
        want = np.arange(100, dtype=np.float32)[:, None] * inv[None, :]
        np.testing.assert_allclose(found[0], np.cos(want), atol=1e-6)
        np.testing.assert_allclose(found[1], np.sin(want), atol=1e-6)


def test_matchers_refuse_what_the_packed_form_would_drop():
    """A RotaryEmbedding with scale != 1 or is_packed_batching is left unpacked with a reason: the packed op and
    the gate have no room for them. (The packed GroupQueryAttention is the plan's fused one, which
    FusedAttentionPass builds with inputs 0-10 only: no head_sink to refuse.)"""
    import onnx_ir as ir


    def rotary(**attrs):
        x, pos, cos, sin = (ir.Value(name=n) for n in ("x", "pos", "cos", "sin"))
        node = ir.node("RotaryEmbedding", [x, pos, cos, sin], {"num_heads": 2, **attrs}, domain="com.microsoft",
                       name="rope")
        return node

    assert attention_form.rotary_form(rotary(), 2) is None  # the form RotaryFusionPass writes
    for attrs in ({"scale": 0.5}, {"is_packed_batching": 1}):
        why = attention_form.rotary_form(rotary(**attrs), 2)
        assert isinstance(why, str) and "does not apply" in why, attrs

