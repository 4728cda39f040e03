"""Decode layout fusion for `--fused-attention fastcar`: no layout ops around the attention, one gate node.

After the rotary fusion a fused layer still runs, per step, Reshape + Transpose for each of q, k and v (the
exporter's head split, [B, S, H*D] -> [B, H, S, D]) and, for FastCar, TemporalGate (on total_len), MLPCacheRead, Cast,
ReduceSum, Equal, Size, Less and the per-layer tau Gather: 16 launches onnxruntime-genai's step does not have
(each costs its thread-pool hand-off at 2 threads, whatever the kernel time). This pass

- feeds RotaryEmbedding (which takes [B, S, H*D] with `num_heads`) and CompressedAttention (`qkv_perm`
  [0, 2, 1, 3]) the projections' [B, S, H*D] outputs, so the Reshape/Transpose pairs go;
- records, for a rewritten layer, the [B, S, H*D] query its gate reads (post-RoPE for TAS `rope`, the projection
  for `raw`): GatePass, which runs next, emits the packed `ai.fastcar.TemporalGate` on it, the op
  onnxruntime-genai graphs use, whose "first H*D channels of the packed projection" is then the whole query.
  Same decision, cached rows and If conditions as the gate on [B, H, S, D], one launch.

Exact: the same arithmetic on the same values, only the memory layout of the inputs differs. Only the plan's
fused layers with a dense cache whose q/k/v come from the exporter's head split are touched (the attention op is
the one the layer's record names); a layer whose query has any other consumer stays as it is.
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from fastcar_compile.core import contract
from fastcar_compile.passes.context import CompileContext, PackedQuery

MS = contract.MS_DOMAIN
AT_FORM = contract.GateForm(use_total_len=True)  # the plan's gate on a fused attention's total_len
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


class FusedLayoutPass(ir.passes.InPlacePass):
    """[B, S, H*D] q/k/v into RotaryEmbedding + CompressedAttention; the gate (next) reads the packed query."""

    def __init__(self, ctx: CompileContext):
        super().__init__()
        self.ctx = ctx

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        ctx = self.ctx
        layouts = gates = 0
        if ctx.options.fused_attention == "fastcar":
            # the plan's fused layers with a dense cache (a compressed one's kernel reads [B, H, S, D] q/k/v)
            for n in sorted(set(ctx.fusions) - set(ctx.kv_configs)):
                fused = self._fuse(model, n, ctx.attention_node(n))
                if fused is not None:
                    ctx.layouts.add(n)
                    layouts += 1
                    gates += fused
        if not layouts:
            return ir.passes.PassResult(model, modified=False)
        RemoveUnusedNodesPass()(model)
        ctx.notes.append(f"q/k/v kept [B, S, H*D] into the fused attention in {layouts} layers; "
                         f"one-node gate (packed TemporalGate) in {gates}")
        return ir.passes.PassResult(model, modified=True)

    def _fuse(self, model: ir.Model, n: int, ca: ir.Node) -> int | None:
        """Rewrite one layer; None when it does not have the expected form (then it is left alone)."""
        p = self.ctx.fusions[n]
        heads, kv_heads = p["heads"], p["kv_heads"]
        q, k, v = ca.inputs[0], ca.inputs[1], ca.inputs[2]
        rq, rk = q.producer(), k.producer()
        if any(r is None or r.op_type != "RotaryEmbedding" or r.domain != MS for r in (rq, rk)):
            return None
        xq, xk = head_split_source(rq.inputs[0], heads), head_split_source(rk.inputs[0], kv_heads)
        xv = head_split_source(v, kv_heads)
        if xq is None or xk is None or xv is None or len({rq.inputs[0], rk.inputs[0], v}) != 3:
            return None
        # a rewritten layer's gate (emitted next) reads q (TAS `rope`) or its input (`raw`): packed, it reads them
        # [B, S, H*D]; a gate of another form would read [B, H, S, D] values this rewrite removes
        plan = self.ctx.plan[n]
        gate = plan.rewrite
        if (gate and plan.gate != AT_FORM) or not only_consumers(q, {ca}) or not only_consumers(rq.inputs[0], {rq}) or \
                not only_consumers(k, {ca}) or not only_consumers(rk.inputs[0], {rk}) or not only_consumers(v, {ca}):
            return None
        for r, x, h in ((rq, xq, heads), (rk, xk, kv_heads)):
            r.replace_input_with(0, x)
            r.attributes["num_heads"] = ir.AttrInt64("num_heads", h)
            r.outputs[0].shape = x.shape
        ca.replace_input_with(2, xv)
        ca.attributes["qkv_perm"] = ir.AttrInt64s("qkv_perm", BSHD_PERM)
        if gate:
            self.ctx.packed_queries[n] = PackedQuery(q if self.ctx.options.tas_query == contract.TAS_ROPE else xq)
        return int(gate)
