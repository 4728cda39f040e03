"""Decode layout fusion for `--fused-attention fastcar`: no layout ops around the attention, one gate node.

After the rotary fusion a fused layer still runs, per step, Reshape + Transpose for each of q, k and v (the
exporter's head split, [B, S, H*D] -> [B, H, S, D]) and, for FastCar, TemporalGate (on total_len), MLPCacheRead, Cast,
ReduceSum, Equal, Size, Less and the per-layer tau Gather: 16 launches onnxruntime-genai's step does not have
(each costs its thread-pool hand-off at 2 threads, whatever the kernel time). This pass

- feeds RotaryEmbedding (which takes [B, S, H*D] with `num_heads`) and CompressedAttention (`qkv_perm`
  [0, 2, 1, 3]) the projections' [B, S, H*D] outputs, so the Reshape/Transpose pairs go;
- replaces the gate's nodes by the packed `ai.fastcar.TemporalGate` on that [B, S, H*D] query (post-RoPE for TAS
  `rope`, the projection for `raw`): the op onnxruntime-genai graphs use, whose "first H*D channels of the
  packed projection" is then the whole query. Same decision, cached rows and If conditions, one launch.

Exact: the same arithmetic on the same values, only the memory layout of the inputs differs. Only plain
CompressedAttention nodes (no compressed KV cache) whose q/k/v come from the exporter's head split are
touched; a layer whose query has any other consumer stays as it is.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from fastcar_compile.core import contract
from fastcar_compile.passes import fastcar_ops
from fastcar_compile.passes import graph_utils as gu
from fastcar_compile.passes.context import CompileContext

MS = contract.MS_DOMAIN
AT_FORM = contract.GateForm(use_total_len=True)  # the gate GatePass emits on CompressedAttention's total_len
BSHD_PERM = [0, 2, 1, 3]


def _ints(node: ir.Node, name: str) -> list[int] | None:
    attr = node.attributes.get(name)
    return None if attr is None else list(attr.as_ints())


def head_split_source(value: ir.Value, heads: int) -> ir.Value | None:
    """x [B, S, heads*D] when value = Transpose(Reshape(x, [B, S, heads, D]), perm 0,2,1,3), else None."""
    t = value.producer()
    if t is None or t.op_type != "Transpose" or t.domain != "" or _ints(t, "perm") != BSHD_PERM:
        return None
    r = t.inputs[0].producer()
    if r is None or r.op_type != "Reshape" or r.domain != "":
        return None
    x, out = r.inputs[0], r.outputs[0]
    xs, rs = x.shape, out.shape
    if xs is None or rs is None or len(xs) != 3 or len(rs) != 4 or rs[2] != heads or not isinstance(rs[3], int) \
            or xs[2] != heads * rs[3] or x.dtype != ir.DataType.FLOAT:
        return None
    return x


def only_consumers(value: ir.Value, allowed: set[ir.Node]) -> bool:
    """True when only `allowed` nodes read `value` and it is no graph output (so a rewrite may drop it)."""
    return not value.is_graph_output() and all(n in allowed for n in value.consumers())


def _single(value: ir.Value, op: str) -> ir.Node | None:
    nodes = [n for n in value.consumers() if n.op_type == op]
    return nodes[0] if len(nodes) == 1 else None


@dataclass
class GateChain:
    """A TemporalGate on total_len and the nodes BranchPass built from it (cached rows, the two If conditions)."""

    node: ir.Node
    cache: ir.Value  # past_mlp_cache
    conditions: list[ir.Value]  # MLPCacheRead's rows, compute_all, compute_some ([] in the shared layout)
    threshold: ir.Value
    index: int

    @staticmethod
    def find(node: ir.Node) -> GateChain | None:
        replay, slot = node.outputs[0], node.outputs[2]
        merge = _single(slot, contract.MLP_CACHE_MERGE)  # BranchPass's shared layout: no cache read, no conditions
        if merge is not None and merge.inputs[4] is slot and merge.inputs[3] is replay:
            return GateChain._tau(node, merge.inputs[0], [])
        read = _single(slot, contract.MLP_CACHE_READ)
        cast = _single(replay, "Cast")
        count = _single(cast.outputs[0], "ReduceSum") if cast is not None else None
        if read is None or read.inputs[1] is not slot or count is None or \
                cast.attributes.get_int("to", 0) != ir.DataType.INT64:
            return None
        equal, less = _single(count.outputs[0], "Equal"), _single(count.outputs[0], "Less")
        if equal is None or less is None or less.inputs[0] is not count.outputs[0] or \
                len(count.outputs[0].consumers()) != 2 or len(cast.outputs[0].consumers()) != 1:
            return None
        size = less.inputs[1].producer()  # tokens = Size(input_ids) = B * S, what the packed gate counts
        if gu.scalar_const(equal.inputs[1]) != 0.0 or size is None or size.op_type != "Size":
            return None
        return GateChain._tau(node, read.inputs[0], [read.outputs[0], equal.outputs[0], less.outputs[0]])

    @staticmethod
    def _tau(node: ir.Node, cache: ir.Value, conditions: list[ir.Value]) -> GateChain | None:
        tau, index = node.inputs[3], 0
        g = tau.producer()
        if g is not None and g.op_type == "Gather" and g.attributes.get_int("axis", 0) == 0 and \
                g.inputs[1].const_value is not None and g.inputs[1].const_value.size == 1:
            tau, index = g.inputs[0], int(g.inputs[1].const_value.numpy().reshape(-1)[0])
        elif tau.shape is None or len(tau.shape) != 0:
            return None
        return GateChain(node, cache, conditions, tau, index)


class FusedLayoutPass(ir.passes.InPlacePass):
    """[B, S, H*D] q/k/v into RotaryEmbedding + CompressedAttention; the gate as one packed TemporalGate."""

    def __init__(self, ctx: CompileContext):
        super().__init__()
        self.ctx = ctx

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        layouts = gates = 0
        for ca in [n for n in graph if n.domain == contract.DOMAIN and n.op_type == contract.COMPRESSED_ATTENTION]:
            fused = self._fuse(model, ca)
            if fused is not None:
                layouts += 1
                gates += fused
        if not layouts:
            return ir.passes.PassResult(model, modified=False)
        RemoveUnusedNodesPass()(model)
        self.ctx.notes.append(f"q/k/v kept [B, S, H*D] into the fused attention in {layouts} layers; "
                              f"one-node gate (packed TemporalGate) in {gates}")
        return ir.passes.PassResult(model, modified=True)

    def _fuse(self, model: ir.Model, ca: ir.Node) -> int | None:
        """Rewrite one layer; None when it does not have the expected form (then it is left alone)."""
        attrs = ca.attributes
        if attrs.get_int("budget", 0) or "qkv_perm" in attrs or len(ca.inputs) > 7 or len(ca.outputs) > 3:
            return None
        heads, kv_heads = attrs.get_int("num_heads", 0), attrs.get_int("kv_num_heads", 0)
        q, k, v = ca.inputs[0], ca.inputs[1], ca.inputs[2]
        rq, rk = q.producer(), k.producer()
        if any(r is None or r.op_type != "RotaryEmbedding" or r.domain != MS for r in (rq, rk)):
            return None
        xq, xk = head_split_source(rq.inputs[0], heads), head_split_source(rk.inputs[0], kv_heads)
        xv = head_split_source(v, kv_heads)
        if xq is None or xk is None or xv is None or len({rq.inputs[0], rk.inputs[0], v}) != 3:
            return None
        # the queries' readers: the attention and (rewritten layers) the gate, on q (`rope`) or its input (`raw`)
        tga = [n for val in (q, rq.inputs[0]) for n in val.consumers()
               if fastcar_ops.gate_form(n) == AT_FORM and n.inputs[0] is val]
        gates = [g for n in tga if (g := GateChain.find(n)) is not None]
        allowed = {ca, *tga}
        if len(gates) != len(tga) or len(tga) > 1 or not only_consumers(q, allowed) or \
                not only_consumers(rq.inputs[0], {rq, *tga}) or not only_consumers(k, {ca}) or \
                not only_consumers(rk.inputs[0], {rk}) or not only_consumers(v, {ca}):
            return None
        for r, x, n in ((rq, xq, heads), (rk, xk, kv_heads)):
            r.replace_input_with(0, x)
            r.attributes["num_heads"] = ir.AttrInt64("num_heads", n)
            r.outputs[0].shape = x.shape
        ca.replace_input_with(2, xv)
        ca.attributes["qkv_perm"] = ir.AttrInt64s("qkv_perm", BSHD_PERM)
        for g in gates:
            self.packed_gate(model, g, q if g.node.inputs[0] is q else xq, heads)
        return len(gates)

    @staticmethod
    def packed_gate(model: ir.Model, g: GateChain, query: ir.Value, heads: int,
                    rope: tuple[ir.Value, ir.Value, int] | None = None) -> None:
        """g's nodes -> one packed TemporalGate on `query` ([B, S, >= H*D]); with rope = (cos, sin, rotary dim)
        do_rotary, which rotates the query slice itself (passes/pack_qkv.py)."""
        graph, old = model.graph, g.node
        inputs = fastcar_ops.gate_inputs(old) | {"q": query, "past_mlp_cache": g.cache, "threshold": g.threshold}
        attrs = fastcar_ops.gate_attributes(old) | {"num_heads": heads, "threshold_index": g.index}
        if rope is not None:
            inputs |= {"cos_cache": rope[0], "sin_cache": rope[1]}
            attrs |= {"rotary_embedding_dim": rope[2], "interleaved": 0}
        form = contract.GateForm(use_total_len=True, packed_qkv=True, do_rotary=rope is not None)
        node = fastcar_ops.gate_node(model, form, inputs, attrs, name=f"{old.name or 'gate'}/packed",
                                     metadata_props=dict(old.metadata_props))
        graph.insert_before(old, node)
        olds = [*old.outputs, *g.conditions]
        for before, after in zip(olds, node.outputs[:len(olds)], strict=True):
            gu.take_over(before, after, graph_outputs=True)
