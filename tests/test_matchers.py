"""Unit tests of the discovery matchers on hand-built ONNX graphs (onnx.helper, no torch, no exporter).

Each graph is one decoder layer written op by op, so the test knows which value is the query, the raw
query, the MLP entry and the closing Add, and checks that discovery names exactly those (or fails with the
reason a user sees). Hidden 8, 2 query heads, 1 or 2 kv heads, head dim 4.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from fastcar_compile.passes import match_rotary
from fastcar_compile.passes.discover import discover
from fastcar_compile.passes.match_base import MatchFailure, first_match

E, H, D = 8, 2, 4


class G:
    """A tiny graph builder: nodes, initializers, value names; `model()` gives the onnx_ir model."""

    def __init__(self, kv_heads: int = 2):
        self.nodes: list = []
        self.inits: list = []
        self.n = 0
        self.kv = kv_heads
        self.inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", E])]
        for kind in ("key", "value"):
            self.inputs.append(helper.make_tensor_value_info(f"past_key_values.0.{kind}", TensorProto.FLOAT,
                                                             ["b", kv_heads, "p", D]))
        self.outputs: list = []

    def op(self, op: str, inputs: list[str], n_out: int = 1, domain: str = "", name: str | None = None,
           **attrs) -> str | list[str]:
        self.n += 1
        outs = [f"{(name or op.lower())}_{self.n}_{i}" for i in range(n_out)]
        self.nodes.append(helper.make_node(op, inputs, outs, name=f"{op}_{self.n}", domain=domain, **attrs))
        return outs[0] if n_out == 1 else outs

    def const(self, array: np.ndarray) -> str:
        self.n += 1
        name = f"c{self.n}"
        self.inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def weight(self, rows: int, cols: int) -> str:
        return self.const(np.random.default_rng(self.n).standard_normal((rows, cols)).astype(np.float32))

    def linear(self, x: str, cols: int, rows: int = E) -> str:
        return self.op("MatMul", [x, self.weight(rows, cols)])

    def heads(self, x: str, n: int) -> str:
        """[B, S, n*D] -> [B, n, S, D]"""
        return self.op("Transpose", [self.op("Reshape", [x, self.const(np.array([0, 0, n, D]))])], perm=[0, 2, 1, 3])

    def merge(self, x: str) -> str:
        """[B, H, S, D] -> [B, S, H*D]"""
        return self.op("Reshape", [self.op("Transpose", [x], perm=[0, 2, 1, 3]), self.const(np.array([0, 0, E]))])

    def rms(self, x: str) -> str:
        """Decomposed RMSNorm (a diamond: x feeds the square and the division)."""
        sq = self.op("Mul", [x, x])
        mean = self.op("ReduceMean", [sq, self.const(np.array([-1]))], keepdims=1)
        root = self.op("Sqrt", [self.op("Add", [mean, self.const(np.array(1e-5, np.float32))])])
        return self.op("Mul", [self.op("Div", [x, root]), self.const(np.ones(E, np.float32))])

    def rotate_half(self, x: str, dims: int = D) -> str:
        """x*cos + cat(-x2, x1)*sin over the last `dims` dims of [B, H, S, dims]."""
        half = dims // 2
        x1 = self.op("Slice", [x, self.const(np.array([0])), self.const(np.array([half])), self.const(np.array([-1]))])
        x2 = self.op("Slice", [x, self.const(np.array([half])), self.const(np.array([dims])), self.const(np.array([-1]))])
        rot = self.op("Concat", [self.op("Neg", [x2]), x1], axis=-1)
        cos = self.const(np.cos(np.arange(dims, dtype=np.float32)))
        sin = self.const(np.sin(np.arange(dims, dtype=np.float32)))
        return self.op("Add", [self.op("Mul", [x, cos]), self.op("Mul", [rot, sin])])

    def mlp(self, x: str) -> str:
        return self.linear(self.op("Relu", [self.linear(x, 16)]), E, rows=16)

    def output(self, name: str, value: str, shape) -> str:
        """Expose `value` as graph output `name` (renamed in place, as exporters do); returns the new name."""
        if value in {i.name for i in self.inputs}:
            self.nodes.append(helper.make_node("Identity", [value], [name], name=f"out_{name}"))
        else:
            for node in self.nodes:
                node.output[:] = [name if o == value else o for o in node.output]
                node.input[:] = [name if i == value else i for i in node.input]
        self.outputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, shape))
        return name

    def model(self, opset: int = 18) -> ir.Model:
        graph = helper.make_graph(self.nodes, "layer", self.inputs, self.outputs, self.inits)
        imports = [helper.make_opsetid("", opset), helper.make_opsetid("com.microsoft", 1)]
        proto = helper.make_model(graph, opset_imports=imports)
        proto.ir_version = 10
        return ir.from_proto(onnx.shape_inference.infer_shapes(proto))  # shapes, as an exporter writes them


def matmul_attention(g: G, h: str, rotary: str = "rotate-half") -> tuple[str, dict]:
    """Decomposed attention on h; returns the output projection and the names a test checks."""
    q_raw = g.heads(g.linear(h, H * D), H)
    k = g.heads(g.linear(h, g.kv * D), g.kv)
    v = g.heads(g.linear(h, g.kv * D), g.kv)
    if rotary == "rotate-half":
        q, k = g.rotate_half(q_raw), g.rotate_half(k)
    elif rotary == "partial":  # rotate the first half of the head dims, pass the rest through
        r = D // 2
        parts = []
        for t in (q_raw, k):
            rot = g.op("Slice", [t, g.const(np.array([0])), g.const(np.array([r])), g.const(np.array([-1]))])
            rest = g.op("Slice", [t, g.const(np.array([r])), g.const(np.array([D])), g.const(np.array([-1]))])
            parts.append(g.op("Concat", [g.rotate_half(rot, r), rest], axis=-1))
        q, k = parts
    elif rotary == "op":
        cache = g.const(np.ones((32, D // 2), np.float32))
        pos = g.const(np.zeros((1, 1), np.int64))
        q = g.op("RotaryEmbedding", [q_raw, cache, cache, pos])
        k = g.op("RotaryEmbedding", [k, cache, cache, pos])
    else:
        q = q_raw
    pk = g.op("Concat", ["past_key_values.0.key", k], axis=2)
    pv = g.op("Concat", ["past_key_values.0.value", v], axis=2)
    pk = g.output("present.0.key", pk, ["b", g.kv, "t", D])
    pv = g.output("present.0.value", pv, ["b", g.kv, "t", D])
    if g.kv != H:  # GQA: repeat kv heads
        pk = g.op("Reshape", [g.op("Expand", [g.op("Unsqueeze", [pk, g.const(np.array([2]))]),
                                              g.const(np.array([1, 1, H // g.kv, 1, 1]))]),
                              g.const(np.array([0, H, -1, D]))])
        pv = g.op("Reshape", [g.op("Expand", [g.op("Unsqueeze", [pv, g.const(np.array([2]))]),
                                              g.const(np.array([1, 1, H // g.kv, 1, 1]))]),
                              g.const(np.array([0, H, -1, D]))])
    scores = g.op("MatMul", [g.op("Mul", [q, g.const(np.array(0.5, np.float32))]),
                             g.op("Transpose", [pk], perm=[0, 1, 3, 2])])
    att = g.op("MatMul", [g.op("Softmax", [scores], axis=-1), pv])
    return g.linear(g.merge(att), E), {"q": q, "q_raw": q_raw}


def finish(g: G, y: str) -> ir.Model:
    g.outputs.append(helper.make_tensor_value_info(y, TensorProto.FLOAT, ["b", "s", E]))
    return g.model()


def node_of(model: ir.Model, value_name: str) -> ir.Node:
    return next(n for n in model.graph if any(o.name == value_name for o in n.outputs))


def only(model: ir.Model):
    (m,) = discover(model)
    return m


# --- attention forms ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv", [2, 1], ids=["mha", "gqa"])
def test_matmul_softmax_attention(kv):
    g = G(kv)
    a, names = matmul_attention(g, g.rms("x"))
    r = g.op("Add", ["x", a])
    model = finish(g, g.op("Add", [r, g.mlp(g.rms(r))]))
    m = only(model)
    assert m.ok, m.failure and m.failure.reason
    att = m.attention
    assert att.form == "MatMul/Softmax" and att.core_node.op_type == "MatMul"
    assert att.q.name == names["q"] and att.q_raw.name == names["q_raw"]  # behind the scaling Mul
    assert (att.num_heads, att.num_kv_heads, att.head_dim) == (H, kv, D)
    assert att.q_layout == "BHSD"


def test_value_cache_not_read_by_a_matmul_fails_with_reason():
    g = G()
    q = g.heads(g.linear("x", H * D), H)
    pk = g.op("Concat", ["past_key_values.0.key", g.heads(g.linear("x", 2 * D), 2)], axis=2)
    pk = g.output("present.0.key", pk, ["b", 2, "t", D])
    g.output("present.0.value", "past_key_values.0.value", ["b", 2, "p", D])
    scores = g.op("MatMul", [q, g.op("Transpose", [pk], perm=[0, 1, 3, 2])])
    model = finish(g, g.linear(g.merge(g.op("Softmax", [scores], axis=-1)), E, rows=E))
    m = only(model)
    assert not m.ok and m.failure.anchor == "attention"
    assert m.failure.reason == "MatMul/Softmax: no MatMul/Attention op consumes present.0.value"
    assert any(line.startswith("attention as fused op:") for line in m.trace)  # tried, does not apply


def _fused_layer(op: str) -> tuple[ir.Model, str]:
    """One layer whose attention is an ONNX Attention (writes the cache) or a contrib op."""
    g = G(2)
    h = g.rms("x")
    q3 = g.linear(h, H * D)
    k3, v3 = g.linear(h, 2 * D), g.linear(h, 2 * D)
    if op == "Attention":  # ONNX opset 23, 4D inputs: Y [B, H, S, D], present key/value
        qname = g.heads(q3, H)
        y, pk, pv = g.op("Attention", [qname, g.heads(k3, 2), g.heads(v3, 2), "",
                                       "past_key_values.0.key", "past_key_values.0.value"], n_out=3)
        out = g.merge(y)
    else:  # com.microsoft GroupQueryAttention on [B, S, H*D]: writes the cache itself
        seqlens = g.const(np.zeros(1, np.int32))
        total = g.const(np.array(1, np.int32))
        out, pk, pv = g.op("GroupQueryAttention", [q3, k3, v3, "past_key_values.0.key", "past_key_values.0.value",
                                                   seqlens, total], n_out=3, domain="com.microsoft",
                           num_heads=H, kv_num_heads=2)
        qname = q3
    g.output("present.0.key", pk, ["b", 2, "t", D])
    g.output("present.0.value", pv, ["b", 2, "t", D])
    r = g.op("Add", ["x", g.linear(out, E)])
    return finish(g, g.op("Add", [r, g.mlp(g.rms(r))])), qname


@pytest.mark.parametrize("op", ["Attention", "GroupQueryAttention"])
def test_fused_attention_op(op):
    model, qname = _fused_layer(op)
    m = only(model)
    assert m.ok, m.failure and m.failure.reason
    assert m.attention.form == "fused op" and m.attention.core_node.op_type == op
    assert m.attention.q.name == qname and m.attention.num_heads == H
    assert m.mlp.form == "sequential Add"


def _gqa_layer(packed: bool, do_rotary: int, cos_width: int | None = D // 2, interleaved: int = 0,
               rotary_before: bool = False, position_ids: bool = False, q_norm: bool = False,
               window_cache: bool = False) -> ir.Model:
    """One layer whose attention is com.microsoft.GroupQueryAttention as onnxruntime-genai's builder writes it:
    packed QKV or separate q/k/v, rotating inside with cos/sin caches [32, cos_width] (None: a graph input of
    unknown shape); optionally a RotaryEmbedding on the packed tensor, a position_ids input, fused q/k norms, a
    window-sized KV buffer."""
    g = G(1)
    h = g.rms("x")
    qkv = g.linear(h, (H + 2) * D)
    if rotary_before:
        cache = g.const(np.ones((32, D // 2), np.float32))
        qkv = g.op("RotaryEmbedding", [qkv, g.const(np.zeros((1, 1), np.int64)), cache, cache],
                   domain="com.microsoft")
    if packed:
        qkv_in = [qkv, "", ""]
    else:
        qkv_in = g.op("Split", [qkv, g.const(np.array([H * D, D, D]))], n_out=3, axis=-1)
    if cos_width is None:
        g.inputs.append(helper.make_tensor_value_info("cos_cache", TensorProto.FLOAT, None))
        cos = sin = "cos_cache"
    else:
        cos = sin = g.const(np.ones((32, cos_width), np.float32))
    extra = []
    if position_ids:
        g.inputs.append(helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["b", "s"]))
        extra = ["position_ids"]
    if q_norm:
        extra = ["", "", "", "", "", g.const(np.ones(D, np.float32)), g.const(np.ones(D, np.float32))]
    out, pk, pv = g.op("GroupQueryAttention", [*qkv_in, "past_key_values.0.key", "past_key_values.0.value",
                                               g.const(np.zeros(1, np.int32)), g.const(np.array(1, np.int32)),
                                               cos, sin, *extra], n_out=3, domain="com.microsoft", num_heads=H,
                       kv_num_heads=1, do_rotary=do_rotary, rotary_interleaved=interleaved,
                       **({"local_window_size": 8, "sliding_window_cache": 1} if window_cache else {}))
    g.output("present.0.key", pk, ["b", 1, "t", "head"])
    g.output("present.0.value", pv, ["b", 1, "t", "head"])
    r = g.op("Add", ["x", g.linear(out, E)])
    return finish(g, g.op("Add", [r, g.mlp(g.rms(r))]))


@pytest.mark.parametrize("packed,kwargs,rope,refused", [
    (False, {}, "in GroupQueryAttention (do_rotary=1, half-split, dim 4)", None),
    (True, {"cos_width": 1, "interleaved": 1}, "in GroupQueryAttention (do_rotary=1, interleaved, dim 2 of 4)", None),
    (True, {"do_rotary": 0}, "none", None),
    (False, {"position_ids": True}, "in GroupQueryAttention (do_rotary=1, half-split, at position_ids)", "position_ids"),
    (False, {"cos_width": None}, "in GroupQueryAttention (do_rotary=1, half-split)", "is not known"),
    (True, {"cos_width": 4}, "in GroupQueryAttention (do_rotary=1, half-split, dim 8 of 4)", "more than the head"),
    (True, {"do_rotary": 0, "rotary_before": True}, "com.microsoft::RotaryEmbedding on the packed QKV before",
     "rotates the packed q/k/v"),
])
def test_group_query_attention_rotary_forms(packed, kwargs, rope, refused):
    """GroupQueryAttention as the genai builder emits it: the rotary inside the op is named (pairing, width,
    partial), the gate reads the op's own query input, and a rotary the gate cannot reproduce is refused for
    `rope` with the reason (never taken as `none`)."""
    m = only(_gqa_layer(packed, **{"do_rotary": 1, **kwargs}))
    assert m.ok, m.failure and m.failure.reason
    att = m.attention
    assert att.packed_query is not None and att.packed_query.qkv is att.q and att.rope.startswith(rope), att.rope
    assert att.form == ("packed-QKV GroupQueryAttention" if packed else "GroupQueryAttention (separate q/k/v)")
    assert (att.num_heads, att.num_kv_heads, att.head_dim) == (H, 1, D)
    if refused is None:
        assert att.rope_refusal is None
    else:
        assert refused in (att.rope_refusal or ""), att.rope_refusal


@pytest.mark.parametrize("kwargs,anchor,reason", [
    ({"q_norm": True}, "query", "q_norm_weight"), ({"window_cache": True}, "kv", "sliding_window_cache=1")])
def test_group_query_attention_forms_left_dense(kwargs, anchor, reason):
    """q/k norms fused into GroupQueryAttention (q_norm_weight input: the normalised query is never a tensor, so
    neither TAS can be read), and a window-sized KV buffer (Gemma2/3 local layers: the key one frame back is not
    at its absolute position): the layer is left dense with the reason."""
    m = only(_gqa_layer(False, 1, **kwargs))
    assert not m.ok and m.failure.anchor == anchor and reason in m.failure.reason


# --- rotary forms --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rotary,kind", [
    ("rotate-half", "rotate-half (Mul/Add)"),
    ("partial", "partial rotate-half (Mul/Add)"),
    ("op", "onnx::RotaryEmbedding"),
    ("none", "none"),
])
def test_rotary_forms(rotary, kind):
    g = G()
    a, names = matmul_attention(g, g.rms("x"), rotary)
    r = g.op("Add", ["x", a])
    m = only(finish(g, g.op("Add", [r, g.mlp(g.rms(r))])))
    assert m.ok, m.failure and m.failure.reason
    assert m.attention.rope == kind
    assert m.attention.q_raw.name == names["q_raw"]  # the projection, before any rotation


def test_rotary_form_reasons():
    """Each rotary form says why it does not apply to a plain projection."""
    g = G()
    q = g.heads(g.linear("x", H * D), H)
    model = g.model()
    value = next(o for n in model.graph for o in n.outputs if o.name == q)
    for name, form in match_rotary.ROTARY_FORMS:
        with pytest.raises(MatchFailure) as exc:
            form(value)
        assert exc.value.anchor == "rotary" and q in exc.value.reason, name
    assert match_rotary.find_rotary(value) == (value, "none")


# --- residual forms ------------------------------------------------------------------------------------------


def test_sequential_residual_branch_is_norm_and_mlp():
    g = G()
    a, _ = matmul_attention(g, g.rms("x"))
    r = g.op("Add", ["x", a])
    mlp_out = g.mlp(g.rms(r))
    y = g.op("Add", [r, mlp_out])
    model = finish(g, y)
    m = only(model)
    assert m.ok and m.mlp.form == "sequential Add"
    assert m.mlp.entry.name == r and m.mlp.output.name == mlp_out and m.mlp.closing is node_of(model, y)
    assert {n.op_type for n in m.mlp.nodes} == {"Mul", "ReduceMean", "Add", "Sqrt", "Div", "MatMul", "Relu"}
    assert m.mlp.weights == [(E, 16), (16, E)]


def test_post_norms_around_attention_and_mlp():
    """Gemma2/OLMo2: norm(attn) joins the stream, the MLP branch ends with its own norm."""
    g = G()
    a, _ = matmul_attention(g, g.rms("x"))
    r = g.op("Add", ["x", g.rms(a)])  # the attention output path forks inside the norm, then joins
    mlp_out = g.rms(g.mlp(g.rms(r)))
    y = g.op("Add", [r, mlp_out])
    model = finish(g, y)
    m = only(model)
    assert m.ok, m.failure and m.failure.reason
    assert m.attention.join is node_of(model, r)
    assert m.mlp.entry.name == r and m.mlp.output.name == mlp_out


@pytest.mark.parametrize("order", ["mlp+attn+x", "attn+mlp+x", "x+attn+mlp"])
def test_parallel_residual(order):
    """GPT-NeoX: x + attn(ln1(x)) + mlp(ln2(x)), in the association orders transformers uses."""
    g = G()
    a, _ = matmul_attention(g, g.rms("x"))
    mlp_out = g.mlp(g.rms("x"))
    first, second = {"mlp+attn+x": ((mlp_out, a), "x"), "attn+mlp+x": ((a, mlp_out), "x"),
                     "x+attn+mlp": (("x", a), mlp_out)}[order]
    inner = g.op("Add", list(first))
    y = g.op("Add", [inner, second])
    model = finish(g, y)
    m = only(model)
    assert m.ok, m.failure and m.failure.reason
    assert m.mlp.form == "parallel residual"
    assert m.mlp.entry.name == "x" and m.mlp.output.name == mlp_out
    assert m.mlp.closing is node_of(model, y if order == "x+attn+mlp" else inner)
    assert not any(n.op_type == "Softmax" for n in m.mlp.nodes)


def test_parallel_residual_with_shared_norm():
    """GPT-J / Phi-2: one norm feeds attention and MLP; the MLP branch starts at the norm's output."""
    g = G()
    h = g.op("LayerNormalization", ["x", g.const(np.ones(E, np.float32)), g.const(np.zeros(E, np.float32))],
             axis=-1)
    a, _ = matmul_attention(g, h)
    mlp_out = g.mlp(h)
    y = g.op("Add", [g.op("Add", [a, mlp_out]), "x"])
    m = only(finish(g, y))
    assert m.ok, m.failure and m.failure.reason
    assert m.mlp.form == "parallel residual" and m.mlp.entry.name == h
    assert [n.op_type for n in m.mlp.nodes] == ["MatMul", "Relu", "MatMul"]


def test_fused_skip_norm():
    g = G()
    a, _ = matmul_attention(g, g.rms("x"))
    gamma = g.const(np.ones(E, np.float32))
    normed, _, _, r = g.op("SkipSimplifiedLayerNormalization", [a, "x", gamma], n_out=4, domain="com.microsoft")
    y = g.op("Add", [r, g.mlp(normed)])
    m = only(finish(g, y))
    assert m.ok, m.failure and m.failure.reason
    assert m.mlp.form == "fused Skip*Norm" and m.mlp.fused_norm and m.mlp.entry.name == normed


def test_no_closing_add_names_every_form():
    """A stream that is never added to a branch: each residual form gives its reason."""
    g = G()
    a, _ = matmul_attention(g, g.rms("x"))
    r = g.op("Add", ["x", a])
    m = only(finish(g, g.mlp(r)))  # the MLP output is the layer output: no residual around it
    assert not m.ok and m.failure.anchor == "mlp"
    assert m.failure.reason.startswith(f"sequential Add: no Add closes a branch that starts at {r}; "
                                       "parallel residual: ")
    # The fused form does not apply to an Add join: tried (in the trace) but kept out of the summary.
    assert "fused Skip*Norm" not in m.failure.reason
    assert any(line.startswith("mlp as fused Skip*Norm:") for line in m.trace)


def test_attention_path_used_elsewhere_is_refused():
    g = G()
    a, _ = matmul_attention(g, g.rms("x"))
    r = g.op("Add", ["x", a])
    g.outputs.append(helper.make_tensor_value_info(a, TensorProto.FLOAT, ["b", "s", E]))
    model = finish(g, g.op("Add", [r, g.mlp(g.rms(r))]))
    m = only(model)
    assert not m.ok and m.failure.anchor == "residual"
    assert m.failure.reason == f"attention output path forks at {a}: also used by a graph output before it joins " \
        f"the stream at Add '{node_of(model, r).name}'"


def test_first_match_reports_the_form_that_matched():
    trace: list[str] = []

    def fails():
        raise MatchFailure("x", "no")

    assert first_match("x", [("a", fails), ("b", lambda: 3)], trace) == ("b", 3)
    assert trace == ["x: b (after a: no)"]
    with pytest.raises(MatchFailure) as exc:
        first_match("x", [("a", fails), ("b", fails)], [])
    assert exc.value.reason == "a: no; b: no"


def test_scale_computed_from_shapes():
    """TorchScript's SDPA scales q and K^T by sqrt(1 / sqrt(D)) computed from Shape(q): still attention, and the
    query is the unscaled one; a scale read from another tensor's data is not."""
    def shape_scale(g: G, q: str) -> str:
        d = g.op("Cast", [g.op("Gather", [g.op("Shape", [q]), g.const(np.array(-1))], axis=0)], to=1)
        return g.op("Sqrt", [g.op("Div", [g.const(np.array(1.0, np.float32)), g.op("Sqrt", [d])])])

    for data_scale in (False, True):
        g = G(2)
        h = g.rms("x")
        q = g.heads(g.linear(h, H * D), H)
        pk = g.output("present.0.key", g.op("Concat", ["past_key_values.0.key", g.heads(g.linear(h, 2 * D), 2)],
                                            axis=2), ["b", 2, "t", D])
        pv = g.output("present.0.value", g.op("Concat", ["past_key_values.0.value", g.heads(g.linear(h, 2 * D), 2)],
                                              axis=2), ["b", 2, "t", D])
        scale = g.op("ReduceMean", ["x"], keepdims=0) if data_scale else shape_scale(g, q)
        kt = g.op("Mul", [g.op("Transpose", [pk], perm=[0, 1, 3, 2]), scale])
        scores = g.op("MatMul", [g.op("Mul", [q, scale]), kt])
        att = g.op("MatMul", [g.op("Softmax", [scores], axis=-1), pv])
        r = g.op("Add", ["x", g.linear(g.merge(att), E)])
        m = only(finish(g, g.op("Add", [r, g.mlp(g.rms(r))])))
        if data_scale:
            assert not m.ok and m.failure.anchor == "attention"
        else:
            assert m.ok, m.failure and m.failure.reason
            assert m.attention.q.name == q
