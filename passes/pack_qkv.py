"""Packed QKV with the rotary inside the attention op: path (b)'s layer as lean as onnxruntime-genai's.

After FusedLayoutPass a dynamo layer still runs three q/k/v MatMuls on the same normed input and a
RotaryEmbedding on q and one on k before `ai.fastcar.CompressedAttention`: four launches per layer genai's graph
does not have (one packed MatMul, RoPE inside GroupQueryAttention). This pass makes the layer

    qkv = MatMul(x, concat(Wq, Wk, Wv))  [+ Add(concat(bq, bk, bv))]
    out, present_key, present_value = CompressedAttention[packed_rotary](qkv, -, -, ..., cos_table, sin_table)
    gate: TemporalGate[packed_qkv, do_rotary](qkv, ..., total_len, ..., cos_table, sin_table)

The concatenated weights replace the three originals (which go), so the weights held do not grow. The gate
(emitted next by GatePass, from the layer's PackedQuery this pass records) is path (a)'s op unchanged: it
rebuilds the post-RoPE query from the packed projection.

Rotary positions: the op and the gate rotate at KV index total_len - S + i, as GroupQueryAttention does with
seqlens_k = total_len - 1, from a cos/sin table [positions, D / 2] that is the export's own rotary subgraph
evaluated (ONNX Runtime, at compile time) on position_ids = 0..positions-1 (`--rotary-positions`). The export
rotates at the position_ids fed, which FastCarSession makes the count of real tokens before each one: the KV
index minus the row's left padding, a per-row constant. RoPE scores and TAS depend on q and k positions only
through their difference, so the values are the export's up to float rounding of the angles (without padding:
the same table rows; the native kernels' rotation is not ORT's RotaryEmbedding kernel: tests compare within 1e-4). That needs padding only before a row's first real token:
the metadata's `rotary_positions` (the table length, written when a layer is packed) makes FastCarSession refuse
mask zeros after it, other position_ids (gaps, restarts) and videos past the table; --pack-qkv off runs those.
A rotary whose row p depends on more than p (frequencies switched by the sequence length) is left unpacked. TAS `raw` dots the unrotated query with
keys rotated at their absolute positions, which is not shift invariant: such layers stay unpacked.

Only plain CompressedAttention layers (no compressed KV cache) whose RoPE came from RotaryFusionPass (half-split,
the graph's own cos/sin) and whose projections are float32 MatMuls (+ bias Add) on constant weights are taken;
the compile report's notes say in one line why a layer is left. MatMulNBits: not
applicable, the torch dynamo path exports float MatMuls (int4 weights come only from the genai builder, path (a),
whose QKV is packed already).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from fastcar_compile.core import contract
from fastcar_compile.passes import build, fastcar_ops
from fastcar_compile.passes import graph_utils as gu
from fastcar_compile.passes.context import CompileContext, PackedQuery
from fastcar_compile.passes.fuse_layout import AT_FORM, BSHD_PERM, MS, head_split_source, only_consumers
from fastcar_compile.passes.fused_attention import core_attributes

PREFIX_CHECK = 64  # positions evaluated alone: their rows must equal the long table's bit for bit
PACKED_ARITY = 14  # q, k, v, past k/v, mask, total_len, slots, k_raw, past_key_raw, past_dense, video_start, cos, sin
TABLE_PREFIX = "fastcar.rotary"  # initializer names of the cos/sin tables: fastcar.rotaryK.{cos,sin}_table


def _attr(node: ir.Node, name: str, default=None):
    return node.attributes[name].value if name in node.attributes else default


class _Projection:
    """y = x @ W (+ b): W a constant [E, N] float32, b a constant [N] (or None)."""

    def __init__(self, out: ir.Value, matmul: ir.Node, weight: np.ndarray, bias: np.ndarray | None):
        self.out, self.matmul, self.weight, self.bias = out, matmul, weight, bias

    @staticmethod
    def match(value: ir.Value) -> _Projection | str:
        node, add, bias = value.producer(), None, None
        if node is not None and node.op_type == "Add" and node.domain == "":
            for i in (0, 1):
                b = gu.const_tensor(node.inputs[1 - i])
                src = node.inputs[i].producer()
                if b is not None and src is not None and src.op_type == "MatMul":
                    add, bias, node = node, b.numpy(), src
                    break
        if node is None or node.op_type != "MatMul" or node.domain != "":
            return f"{value.name} is not a MatMul (+ bias Add) output"
        w = gu.const_tensor(node.inputs[1])
        if w is None or w.dtype != ir.DataType.FLOAT or len(w.shape) != 2:
            return f"{value.name}'s MatMul weight is not a constant float32 matrix"
        weight = w.numpy()
        if bias is not None and (bias.dtype != np.float32 or bias.shape != (weight.shape[1],)):
            return f"{value.name}'s bias is not a float32 vector of the output width"
        if add is not None and len(node.outputs[0].consumers()) != 1:
            return f"{value.name}'s MatMul output has readers besides the bias Add"
        return _Projection(value, node, weight, bias)


def _rotary(value: ir.Value, heads: int) -> ir.Node | str:
    node = value.producer()
    if node is None or node.op_type != "RotaryEmbedding" or node.domain != MS:
        return f"{value.name} is not a com.microsoft.RotaryEmbedding output"
    if _attr(node, "interleaved", 0) or _attr(node, "num_heads", 0) != heads or _attr(node, "rotary_embedding_dim", 0):
        return f"{node.name}: not RotaryFusionPass's form (half-split, num_heads {heads}, full rotary dim)"
    # the packed op and the gate rotate with the table alone: they have no scale and no packed batching
    if _attr(node, "scale", 1.0) != 1.0 or _attr(node, "is_packed_batching", 0):
        return (f"{node.name}: RotaryEmbedding with scale {_attr(node, 'scale', 1.0)} / is_packed_batching "
                f"{_attr(node, 'is_packed_batching', 0)}, which the packed rotary does not apply (needs 1 / 0)")
    return node


def _table(model: ir.Model, values: tuple[ir.Value, ir.Value], positions: int) -> tuple[np.ndarray, np.ndarray] | str:
    """The per-token cos/sin caches [B * S, D / 2] as functions of position_ids alone, evaluated on
    position_ids = [[0, 1, ..., positions - 1]]: the table row p is what the export computes at position p."""
    nodes = gu.ancestors_until(values, set(), limit=200)
    inputs = {v for n in nodes for v in n.inputs if v is not None and v.is_graph_input()}
    if [v.name for v in inputs] != [contract.POSITION_IDS]:
        return f"the rotary cos/sin depend on {sorted(v.name for v in inputs)}, not on position_ids alone"
    import onnxruntime as ort  # compile-time evaluation only

    order = gu.in_graph_order(model.graph, nodes)
    inits = {v.name: v for n in order for v in n.inputs if v is not None and v.const_value is not None
             and not v.is_graph_input() and v.producer() is None}
    graph = onnx.helper.make_graph(
        [ir.serde.serialize_node(n) for n in order], "rotary",
        [onnx.helper.make_tensor_value_info(contract.POSITION_IDS, onnx.TensorProto.INT64, [1, None])],
        [onnx.helper.make_tensor_value_info(v.name, onnx.TensorProto.FLOAT, None) for v in values],
        [ir.serde.serialize_tensor(v.const_value) for v in inits.values()])
    opsets = [onnx.helper.make_opsetid(d, v) for d, v in model.opset_imports.items()]
    proto = onnx.helper.make_model(graph, opset_imports=opsets, ir_version=min(model.ir_version, 10))
    prefix = min(positions, PREFIX_CHECK)
    try:
        sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
        cos, sin = sess.run(None, {contract.POSITION_IDS: np.arange(positions, dtype=np.int64)[None, :]})
        short = sess.run(None, {contract.POSITION_IDS: np.arange(prefix, dtype=np.int64)[None, :]})
    except Exception as exc:  # noqa: BLE001 - any failure means: leave the rotary as exported
        return f"evaluating the rotary cos/sin on positions 0..{positions - 1} failed ({str(exc).splitlines()[0][:120]})"
    if cos.ndim != 2 or cos.shape[0] != positions or sin.shape != cos.shape:
        return f"the rotary cos/sin evaluate to {cos.shape}, not [positions, D/2]"
    # the table assumes row p depends on p alone; RoPE variants that switch frequencies with the sequence length
    # (transformers' dynamic / longrope scaling) give other rows on a short video than in the long batch
    if not all(np.array_equal(a, b[:prefix]) for a, b in zip(short, (cos, sin), strict=True)):
        return (f"the rotary cos/sin depend on the sequence length (positions 0..{prefix - 1} evaluated alone differ "
                "from the same rows of the long table)")
    return np.ascontiguousarray(cos, np.float32), np.ascontiguousarray(sin, np.float32)


class _Layer:
    """One fused CompressedAttention layer in FusedLayoutPass's form, what packing it needs."""

    def __init__(self, ctx: CompileContext, layer: int):
        self.layer, self.ca, self.ctx = layer, ctx.attention_node(layer), ctx
        self.fusion = ctx.fusions[layer]  # what the fused attention was built from (fused_attention.fusable)
        self.heads, self.kv_heads = self.fusion["heads"], self.fusion["kv_heads"]
        self.compressed, self.laid_out = layer in ctx.kv_configs, layer in ctx.layouts

    def match(self) -> str | None:
        """Fill the layer's parts; the reason it cannot be packed, or None."""
        ca = self.ca
        if self.compressed:
            return "a compressed KV cache (budget, TempCache, diagnostics): its kernel reads separate q/k/v"
        if not self.laid_out:
            return "q/k/v are not [B, S, H*D] (FusedLayoutPass did not take the layer)"
        why = self._rotaries(ca.inputs[0], ca.inputs[1])
        if why is not None:
            return why
        rq, rk = self.rq, self.rk
        why = self._projections([rq.inputs[0], rk.inputs[0], ca.inputs[2]])
        if why is not None:
            return why
        # readers: q -> attention; q's projection -> its rotary (the gate, emitted next, reads what FusedLayoutPass
        # recorded: q for TAS `rope`, the projection for `raw`)
        if not only_consumers(rq.outputs[0], {ca}) or not only_consumers(self.pq.out, {rq}) or \
                not only_consumers(rk.outputs[0], {ca}) or not only_consumers(self.pk.out, {rk}) or not only_consumers(self.pv.out, {ca}):
            return "q, k or v has readers besides the attention, its rotary and the one-node gate"
        planned = self.ctx.packed_queries.get(self.layer)
        self.gate = planned is not None
        if planned is not None and planned.value is not rq.outputs[0]:
            return ("TAS `raw` dots the unrotated query with keys rotated at their absolute positions, which moving "
                    "the rotation to KV indices would shift under left padding")
        return None

    def _rotaries(self, q: ir.Value, k: ir.Value) -> str | None:
        """q's and k's RotaryEmbedding nodes (kept as self.rq / self.rk), or why the layer cannot rotate in the op."""
        rq, rk = _rotary(q, self.heads), _rotary(k, self.kv_heads)
        for r in (rq, rk):
            if isinstance(r, str):
                return r
        if rq.inputs[1:] != rk.inputs[1:]:
            return "q and k are rotated with different caches"
        self.rq, self.rk = rq, rk
        return None

    def _projections(self, values: list[ir.Value]) -> str | None:
        """q, k, v = x @ W (+ b) of one x, widths heads x D / kv_heads x D (D even): fill pq, pk, pv, head_dim."""
        projs = [_Projection.match(v) for v in values]
        for p in projs:
            if isinstance(p, str):
                return p
        self.pq, self.pk, self.pv = projs
        if len({p.matmul.inputs[0] for p in projs}) != 1 or len({p.matmul for p in projs}) != 3:
            return "q, k and v are not projections of one input"
        if len({p.bias is None for p in projs}) != 1 or len({p.weight.shape[0] for p in projs}) != 1:
            return "q, k and v projections differ in form (bias on some only, or input widths)"
        D = self.pq.weight.shape[1] // max(self.heads, 1)
        if self.pq.weight.shape[1] != self.heads * D or self.pk.weight.shape[1] != self.kv_heads * D or \
                self.pv.weight.shape[1] != self.kv_heads * D or D % 2:
            return "the projection widths are not num_heads/kv_num_heads x an even head size"
        self.head_dim = D
        return None


def _bhsd_source(value: ir.Value) -> ir.Value | None:
    """y [B, H, S, D] when value = Reshape(Transpose(y, perm [0, 2, 1, 3]), 3-D) (FusedAttentionPass's q/k/v)."""
    r = value.producer()
    if r is None or r.op_type != "Reshape" or r.domain != "":
        return None
    t = r.inputs[0].producer()
    if t is None or t.op_type != "Transpose" or list(_attr(t, "perm", [])) != BSHD_PERM:
        return None
    return t.inputs[0]


class _GqaLayer(_Layer):
    """One `--fused-attention gqa` layer (ai.fastcar or com.microsoft GroupQueryAttention on separate [B, S, H*D]
    q/k/v views of rotated [B, H, S, D] heads): packed QKV with do_rotary, GroupQueryAttention's own form."""

    def match(self) -> str | None:
        node, plan = self.ca, self.ctx.plan[self.layer]
        yq, yk, yv = (_bhsd_source(node.inputs[i]) for i in range(3))
        if yq is None or yk is None or yv is None:
            return "q/k/v are not [B, S, H*D] views of [B, H, S, D] heads"
        why = self._rotaries(yq, yk)
        if why is not None:
            return why
        rq, rk = self.rq, self.rk
        xs = [head_split_source(rq.inputs[0], self.heads), head_split_source(rk.inputs[0], self.kv_heads),
              head_split_source(yv, self.kv_heads)]
        if any(x is None for x in xs):
            return "q/k/v heads are not the exporter's head split of [B, S, H*D] projections"
        why = self._projections(xs)
        if why is not None:
            return why
        # the gate (emitted next) of a rewritten layer: packed with do_rotary for TAS `rope`; TAS `raw` (or a gate of
        # another form) would read the [B, H, S, D] query before RoPE, which packing removes
        unpackable_gate = plan.rewrite and (plan.gate != AT_FORM or self.ctx.options.tas_query != contract.TAS_ROPE)
        # FusedAttentionPass reads S off the rotated query for the bias's shape: Shape(q, start 2, end 3)
        self.s_reads = [n for n in rq.outputs[0].consumers() if n.op_type == "Shape" and
                        (_attr(n, "start", 0), _attr(n, "end", None)) == (2, 3)]
        if unpackable_gate or len(rq.outputs[0].consumers()) - len(self.s_reads) != 1 or any(
                v.is_graph_output() or len(v.consumers()) != 1 for v in (
                *xs, rq.inputs[0], rk.inputs[0], rk.outputs[0], node.inputs[1], node.inputs[2])):
            return ("q, k or v has readers besides the attention, its rotary and a TAS `rope` gate (TAS `raw` dots the "
                    "unrotated query with keys rotated at absolute positions: not shift invariant, left unpacked)")
        self.gate = plan.rewrite
        return None


class PackQkvPass(ir.passes.InPlacePass):
    """q/k/v MatMuls -> one packed MatMul; RoPE into the attention op (CompressedAttention / GQA); the gate (next)
    rotates the packed query itself."""

    def __init__(self, ctx: CompileContext):
        super().__init__()
        self.ctx = ctx

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        positions = self.ctx.options.rotary_positions
        layers, kept = [], []
        gqa = self.ctx.options.fused_attention != "fastcar"
        for n in sorted(self.ctx.fusions):  # the plan's fused layers (genai graphs: packed and rotating already)
            layer = _GqaLayer(self.ctx, n) if gqa else _Layer(self.ctx, n)
            why = layer.match()
            if why is None:
                layers.append(layer)
            else:
                kept.append(f"{layer.ca.name}: {why}")
        tables: dict[tuple[ir.Value, ...], tuple[ir.Value, ir.Value] | str] = {}
        done = 0
        for layer in layers:
            key = tuple(layer.rq.inputs[2:4])
            if key not in tables:
                tables[key] = self._table_values(model, key, positions, len(tables))
            table = tables[key]
            if isinstance(table, str):
                kept.append(f"{layer.ca.name}: {table}")
                continue
            if isinstance(layer, _GqaLayer):
                self._pack_gqa(model, layer, table)
            else:
                self._pack(model, layer, table)
            done += 1
        if kept:
            self.ctx.notes.append("packed QKV: left " + "; ".join(kept))
        if not done:
            return ir.passes.PassResult(model, modified=False)
        RemoveUnusedNodesPass()(model)
        self.ctx.rotary_table = positions  # the metadata says so: FastCarSession checks positions against it
        op = "GroupQueryAttention" if isinstance(layers[0], _GqaLayer) else "CompressedAttention"
        self.ctx.notes.append(f"packed QKV with RoPE inside {op} in {done} layers (rotary table of "
                              f"{positions} positions)")
        return ir.passes.PassResult(model, modified=True)

    @staticmethod
    def _table_values(model: ir.Model, caches: tuple[ir.Value, ...], positions: int, k: int):
        found = _table(model, caches, positions)
        if isinstance(found, str):
            return found
        cos, sin = found
        return (build.const(model.graph, f"{TABLE_PREFIX}{k}.cos_table", cos),
                build.const(model.graph, f"{TABLE_PREFIX}{k}.sin_table", sin))

    def _pack_gqa(self, model: ir.Model, layer: _GqaLayer, table: tuple[ir.Value, ir.Value]) -> None:
        """GroupQueryAttention's own packed form: query = the packed projection, key/value absent, do_rotary with
        the table (ORT's positions: seqlens_k + 1 - S + i = KV index, since seqlens_k = total - 1 here)."""
        graph, old = model.graph, layer.ca
        qkv = self._projection(graph, layer)
        inputs = [qkv, None, None, *old.inputs[3:7], *table, None, *old.inputs[10:11]]
        while inputs[-1] is None:
            inputs.pop()
        attrs = core_attributes(layer.fusion) | {"do_rotary": 1, "rotary_interleaved": 0}
        new = ir.node(old.op_type, inputs, attrs, domain=old.domain, num_outputs=len(old.outputs), name=old.name,
                      metadata_props=dict(old.metadata_props))
        graph.insert_before(old, new)
        for before, after in zip(old.outputs, new.outputs, strict=True):
            gu.take_over(before, after, graph_outputs=True)
        graph.remove(old, safe=True)
        layer.ca = new
        self.ctx.set_attention_node(layer.layer, new, old)
        for shape in layer.s_reads:  # S of [B, H, S, D] = S of the packed [B, S, W]
            shape.replace_input_with(0, qkv)
            shape.attributes["start"], shape.attributes["end"] = ir.AttrInt64("start", 1), ir.AttrInt64("end", 2)
        if layer.gate:
            self.ctx.packed_queries[layer.layer] = PackedQuery(qkv, (*table, layer.head_dim))

    @staticmethod
    def _projection(graph: ir.Graph, layer: _Layer) -> ir.Value:
        """One MatMul (+ bias Add) on the concatenated weights, before the q projection; its [B, S, W] output."""
        projs = (layer.pq, layer.pk, layer.pv)
        base = layer.ca.name.rsplit("/", 1)[0] if "/" in layer.ca.name else layer.ca.name
        weight = build.const(graph, f"{layer.pq.matmul.inputs[1].name}.qkv",
                             np.ascontiguousarray(np.concatenate([p.weight for p in projs], axis=1)))
        x = layer.pq.matmul.inputs[0]
        meta = dict(layer.pq.matmul.metadata_props)
        matmul = ir.node("MatMul", [x, weight], name=f"{base}/qkv_matmul", metadata_props=meta)
        nodes, qkv = [matmul], matmul.outputs[0]
        if layer.pq.bias is not None:
            bias = build.const(graph, f"{layer.pq.matmul.inputs[1].name}.qkv_bias",
                               np.concatenate([p.bias for p in projs]).astype(np.float32))
            add = ir.node("Add", [qkv, bias], name=f"{base}/qkv_bias", metadata_props=meta)
            nodes.append(add)
            qkv = add.outputs[0]
        width = (layer.heads + 2 * layer.kv_heads) * layer.head_dim
        qkv.name, qkv.dtype = f"{base}.qkv", ir.DataType.FLOAT
        qkv.shape = ir.Shape([*(x.shape[:2] if x.shape is not None and len(x.shape) == 3 else [None, None]), width])
        graph.insert_before(layer.pq.matmul, nodes)
        return qkv

    def _pack(self, model: ir.Model, layer: _Layer, table: tuple[ir.Value, ir.Value]) -> None:
        graph, ca = model.graph, layer.ca
        qkv = self._projection(graph, layer)
        none_f, none_i = build.absent(graph), build.absent(graph, np.int64)
        inputs = [qkv, none_f, none_f, *ca.inputs[3:7], none_f, none_f, none_f, none_f, none_i, *table]
        assert len(inputs) == PACKED_ARITY
        attrs = core_attributes(layer.fusion) | {"qkv_perm": BSHD_PERM, "do_rotary": 1, "rotary_interleaved": 0}
        new = ir.node(contract.COMPRESSED_ATTENTION, inputs, attrs, domain=contract.DOMAIN, num_outputs=3,
                      name=ca.name, overload=fastcar_ops.PACKED_ROTARY, metadata_props=dict(ca.metadata_props))
        graph.insert_before(ca, new)
        for old, out in zip(ca.outputs, new.outputs, strict=True):
            gu.take_over(old, out, graph_outputs=True)
        graph.remove(ca, safe=True)
        layer.ca = new
        self.ctx.set_attention_node(layer.layer, new, ca)
        if layer.gate:  # the gate rotates the query slice of the packed projection with the op's table
            self.ctx.packed_queries[layer.layer] = PackedQuery(qkv, (*table, layer.head_dim))
        fastcar_ops.add_overload(model, contract.COMPRESSED_ATTENTION, fastcar_ops.PACKED_ROTARY,
                                 model.opset_imports.get("", 17))
