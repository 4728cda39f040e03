"""The FastCar replay rewrite, part 1: the temporal gate of each rewritten layer.

    replay, tas, slot, write = ai.fastcar.TemporalGate(q, present_key, past_mlp_age, tau, video_start)

(in the form the layer needs, contract.GateForm: positions from total_len, aligned keys of a compressed cache;
onnxruntime-genai's GroupQueryAttention layers on packed QKV or rotating inside get the packed form, which also
rebuilds the query from the op's query input and reads the cached rows and the branch conditions.) The pass adds the model-level inputs (`video_start`, `fastcar_threshold`: initializers with their defaults, not graph inputs, contract.OVERRIDABLE), the
`ai.fastcar` functions, each layer's state inputs (cache_state.declare_state), brings the query into
[B, H, S, D] and emits the gate, once, in its final form: the plan's, for a fused layer whose attention op reads
[B, S, H*D] q/k/v or a packed QKV the packed form on the query the attention emission recorded (ctx.packed_queries).
No later pass rewrites it. Attention nodes are tagged for the FPGA partitioner.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from fastcar_compile.core import contract
from fastcar_compile.passes import build, fastcar_ops, window
from fastcar_compile.passes import graph_utils as gu
from fastcar_compile.passes.cache_state import declare_state
from fastcar_compile.passes.context import CompileContext, LayerRewrite, PackedQuery


class GatePass(ir.passes.InPlacePass):
    """Per layer: state inputs and ai.fastcar.TemporalGate (replay, tas, slot, write), once, in its final form."""

    def __init__(self, ctx: CompileContext):
        super().__init__()
        self.ctx = ctx

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        ctx, opts, graph = self.ctx, self.ctx.options, model.graph
        self.model = model
        fastcar_ops.add_functions(model, model.opset_imports.get("", 17))
        ctx.batch = build.batch_dim(graph)
        plain = opts.required_video_inputs  # no defaults: the caller feeds both every run
        ctx.video_start = build.video_start_input(graph, opts.video_start_default)
        if opts.per_layer_threshold:
            taus = np.asarray(opts.threshold, np.float32).reshape(-1)
            if taus.size == 1:
                taus = np.full(len(ctx.selected), taus[0], np.float32)
            ctx.threshold = build.overridable(graph, contract.THRESHOLD, ir.DataType.FLOAT, [len(ctx.selected)],
                                              None if plain else taus)
        else:
            ctx.threshold = build.overridable(graph, contract.THRESHOLD, ir.DataType.FLOAT, [],
                                              None if plain else np.array(opts.threshold[0], np.float32))
        for k, match in enumerate(ctx.selected):
            lr = declare_state(graph, ctx, match, k)
            ctx.layers.append(lr)
            self._gate(graph, lr)
        return ir.passes.PassResult(model, modified=True)

    def _gate(self, graph: ir.Graph, lr: LayerRewrite) -> None:
        opts, att, n = self.ctx.options, lr.match.attention, lr.layer
        assert att is not None and lr.match.mlp is not None
        tag_attention(att, n)
        b = build.Builder(n, lr.nodes, lr.ids, graph=graph)
        names = [contract.replay_mask_output(n), contract.tas_output(n), f"fastcar.{n}.slot", f"fastcar.{n}.write"]
        keys = window.gate_keys(graph, b, att, opts.frame_tokens)  # the present key, or a window padded
        attrs = {"frame_tokens": opts.frame_tokens, "max_replay": opts.max_replay, **self.ctx.age_attrs}
        packed = self.ctx.packed_queries.get(n)  # a fused layer's query kept packed by the attention passes
        if att.packed_query is not None or packed is not None:  # packed QKV (genai's GroupQueryAttention): one node
            self._packed_gate(b, lr, keys, attrs, names, packed)
        else:
            q = query_bhsd(graph, b, att, opts.tas_query)
            tau = self.ctx.threshold
            if opts.per_layer_threshold:
                tau = b("Gather", [tau, build.const(graph, f"fastcar.index.{lr.index}",
                                                    np.array(lr.index, np.int64))], {"axis": 0})
            inputs = {"q": q, "key": keys, "past_mlp_age": lr.past_age, "threshold": tau,
                      "video_start": self.ctx.video_start}
            form = self.ctx.plan[n].gate  # the plan's form (passes/plan.py)
            if form.use_total_len:  # the key buffer may be preallocated (shared): positions from total_len
                inputs["total_len"] = att.total_len
            if form.aligned_keys:
                # a compressed KV cache holds slots, not positions: the op gathered each token's aligned key
                inputs["key"] = att.core_node.outputs[4]
            lr.replay, lr.tas, lr.slot, lr.write = self._emit(b, form, inputs, attrs, names)
        graph.insert_before(lr.match.mlp.closing, lr.nodes)
        lr.nodes = []

    def _packed_gate(self, b: build.Builder, lr: LayerRewrite, keys: ir.Value, attrs: dict, names: list[str],
                     fused: PackedQuery | None) -> None:
        """The packed gate (packed_qkv, do_rotary for `rope`): query rebuild, gate, cached rows, the branch conditions
        and (shared layout) the MLP's computing rows in one node (each node on the main graph costs a kernel launch
        every step, replayed or not). `fused`: a fused layer's packed query (else genai's GroupQueryAttention's)."""
        opts, att, n = self.ctx.options, lr.match.attention, lr.layer
        mlp = lr.match.mlp
        # packed_qkv; do_rotary for `rope` (no rotary: rope = raw) or where RoPE moved into the fused op; select_rows
        form = self.ctx.plan[n].gate
        if fused is None:
            src = att.packed_query
            assert opts.tas_query != contract.TAS_ROPE or att.rope_refusal is None  # SelectLayersPass refused it
            query, total = src.qkv, src.total_len
            rope = (src.cos_cache, src.sin_cache, src.rotary_dim, int(src.interleaved)) if form.do_rotary else None
        else:  # the fused op's [B, S, H*D] q, or its QKV projection with the op's rotary table
            assert form.packed_qkv and form.do_rotary == (fused.rope is not None), (n, form)
            query, total = fused.value, att.total_len
            rope = (*fused.rope, 0) if fused.rope is not None else None
        inputs = {"q": query, "key": keys, "past_mlp_age": lr.past_age, "past_mlp_cache": lr.past_cache,
                  "threshold": self.ctx.threshold, "video_start": self.ctx.video_start, "total_len": total}
        attrs = {**attrs, "num_heads": att.num_heads, "threshold_index": lr.index if opts.per_layer_threshold else 0}
        if rope is not None:
            inputs |= {"cos_cache": rope[0], "sin_cache": rope[1]}
            attrs |= {"rotary_embedding_dim": rope[2], "interleaved": rope[3]}
        rows = form.select_rows
        if rows:
            inputs["mlp_input"] = mlp.entry
        outs = self._emit(b, form, inputs, attrs,
                          [*names, f"fastcar.{n}.cached", f"fastcar.{n}.compute_all", f"fastcar.{n}.compute_some",
                           *([f"fastcar.{n}.rows"] if rows else [])])
        lr.replay, lr.tas, lr.slot, lr.write, lr.cached, compute_all, compute_some = outs[:7]
        if rows:  # the MLP's computing rows and the If condition, for BranchPass
            lr.rows = (outs[7], compute_some)
        lr.conditions = (compute_all, compute_some)

    def _emit(self, b: build.Builder, form: contract.GateForm, inputs: dict[str, ir.Value],
              attrs: dict, names: list[str]) -> tuple[ir.Value, ...]:
        """One TemporalGate node of `form` (its body registered), appended to the layer's nodes."""
        values, attributes = fastcar_ops.gate_args(self.model, form, inputs, attrs)
        return b(contract.TEMPORAL_GATE, values, attributes, domain=contract.DOMAIN, outputs=form.num_outputs,
                 names=names, overload=form.overload)


def tag_attention(att, layer: int) -> None:
    """Tag the layer's norm and attention nodes (the FPGA partitioner assigns weights by these tags)."""
    for node in att.nodes():
        build.tag([node], layer, "norm" if node.op_type in gu.NORM_OPS else "attention")


def query_bhsd(graph: ir.Graph, b: build.Builder, att, tas_query: str) -> ir.Value:
    """The query TAS uses (after or before RoPE), brought into [B, H, S, D]."""
    q, layout = (att.q, att.q_layout) if tas_query == contract.TAS_ROPE else (att.q_raw, att.q_raw_layout)
    if layout == "BSE":
        q = b("Reshape", [q, build.const(graph, f"fastcar.shape.0_0_{att.num_heads}_{att.head_dim}",
                                         np.array([0, 0, att.num_heads, att.head_dim], np.int64))])
        layout = "BSHD"
    if layout == "BSHD":
        q = b("Transpose", [q], {"perm": [0, 2, 1, 3]})
    return q
