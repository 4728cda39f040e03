"""The FastCar replay rewrite, part 1: the temporal gate of each rewritten layer.

    replay, tas, slot, write = ai.fastcar.TemporalGate(q, present_key, past_mlp_age, tau, video_start)

(in the form the layer needs, contract.GateForm: positions from total_len, aligned keys of a compressed cache;
onnxruntime-genai's GroupQueryAttention layers on packed QKV or rotating inside get the packed form, which also
rebuilds the query from the op's query input and reads the cached rows and the branch conditions.) The pass adds the model-level inputs (`video_start`, `fastcar_threshold`: initializers with their defaults, not graph inputs, contract.OVERRIDABLE), the
`ai.fastcar` functions, each layer's state inputs (cache_state.declare_state), brings the query into
[B, H, S, D] and emits the gate. Attention nodes are tagged for the FPGA partitioner.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from fastcar_compile.core import contract
from fastcar_compile.passes import build, fastcar_ops, window
from fastcar_compile.passes import graph_utils as gu
from fastcar_compile.passes.cache_state import declare_state
from fastcar_compile.passes.context import CompileContext, LayerRewrite


class GatePass(ir.passes.InPlacePass):
    """Per layer: state inputs, the query in [B, H, S, D], ai.fastcar.TemporalGate (replay, tas, slot, write)."""

    def __init__(self, ctx: CompileContext):
        super().__init__()
        self.ctx = ctx

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        ctx, opts, graph = self.ctx, self.ctx.options, model.graph
        self.model = model
        fastcar_ops.add_functions(model, model.opset_imports.get("", 17))
        ctx.batch = build.batch_dim(graph)
        plain = opts.required_video_inputs  # no defaults: the caller feeds both every run
        ctx.video_start = build.video_start_input(graph, plain)
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
        b = build.Builder(n, lr.nodes, lr.ids)
        names = [contract.replay_mask_output(n), contract.tas_output(n), f"fastcar.{n}.slot", f"fastcar.{n}.write"]
        keys = window.gate_keys(graph, b, att, opts.frame_tokens)  # the present key, or a window padded
        attrs = {"frame_tokens": opts.frame_tokens, "max_replay": opts.max_replay, **self.ctx.age_attrs}
        if att.packed_query is not None:  # GroupQueryAttention on packed QKV or rotating inside: one fused node
            self._packed_gate(b, lr, keys, attrs, names)
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
            lr.replay, lr.tas, lr.slot, lr.write = self._emit(b, lr, form, inputs, attrs, names)
        graph.insert_before(lr.match.mlp.closing, lr.nodes)
        lr.nodes = []

    def _packed_gate(self, b: build.Builder, lr: LayerRewrite, keys: ir.Value, attrs: dict, names: list[str]) -> None:
        """The packed gate (packed_qkv, do_rotary for `rope`): query rebuild, gate, cached rows and the branch conditions in one node (each
        node on the main graph costs a kernel launch every step, replayed or not)."""
        opts, att, n = self.ctx.options, lr.match.attention, lr.layer
        src = att.packed_query
        assert opts.tas_query != contract.TAS_ROPE or att.rope_refusal is None  # SelectLayersPass refused it
        form = self.ctx.plan[n].gate  # packed_qkv; do_rotary for `rope` (no rotary: rope = raw); select_rows
        mlp = lr.match.mlp
        rows = form.select_rows and mlp.fused_norm  # x is the skip norm's output: no norm to hoist before it
        form = dataclasses.replace(form, select_rows=rows)  # (else RowGatePass folds the SelectRows in later)
        inputs = {"q": src.qkv, "key": keys, "past_mlp_age": lr.past_age, "past_mlp_cache": lr.past_cache,
                  "threshold": self.ctx.threshold, "video_start": self.ctx.video_start, "total_len": src.total_len}
        attrs = {**attrs, "num_heads": att.num_heads, "threshold_index": lr.index if opts.per_layer_threshold else 0}
        if form.do_rotary:
            inputs |= {"cos_cache": src.cos_cache, "sin_cache": src.sin_cache}
            attrs |= {"rotary_embedding_dim": src.rotary_dim, "interleaved": int(src.interleaved)}
        if rows:
            inputs["mlp_input"] = mlp.entry
        outs = self._emit(b, lr, form, inputs, attrs,
                          [*names, f"fastcar.{n}.cached", f"fastcar.{n}.compute_all", f"fastcar.{n}.compute_some",
                           *([f"fastcar.{n}.rows"] if rows else [])])
        lr.replay, lr.tas, lr.slot, lr.write, lr.cached, compute_all, compute_some = outs[:7]
        if rows:  # the MLP's computing rows and the If condition, for BranchPass
            lr.rows = (outs[7], compute_some)
        lr.conditions = (compute_all, compute_some)

    def _emit(self, b: build.Builder, lr: LayerRewrite, form: contract.GateForm, inputs: dict[str, ir.Value],
              attrs: dict, names: list[str]) -> tuple[ir.Value, ...]:
        """One TemporalGate node of `form` (its body registered), appended to the layer's nodes and recorded."""
        values, attributes = fastcar_ops.gate_args(self.model, form, inputs, attrs)
        outs = b(contract.TEMPORAL_GATE, values, attributes, domain=contract.DOMAIN, outputs=form.num_outputs,
                 names=names, overload=form.overload)
        lr.gate, lr.gate_form = outs[0].producer(), form
        lr.gate_attrs = dict(attrs)
        return outs


def replace_gate(model: ir.Model, lr: LayerRewrite, form: contract.GateForm, inputs: dict[str, ir.Value],
                 attrs: dict, *, taken: tuple[ir.Value, ...] = (), at: ir.Node | None = None,
                 name: str | None = None) -> ir.Node:
    """The layer's gate again in `form`, from its inputs and recorded attributes updated by `inputs`/`attrs` (a
    fusion changed what it reads): inserted before `at` (default: the old gate), its outputs take over the old
    gate's and then `taken` (values other nodes computed that it now outputs too); the old gate goes."""
    graph, old = model.graph, lr.gate
    assert old is not None
    # the values it reads now (a pass that replaced an op it reads from rewired them), then the new ones
    current = {k: v for k, v in zip(contract.GATE_INPUTS, old.inputs, strict=False) if v is not None}
    inputs, attrs = current | inputs, lr.gate_attrs | attrs
    node = fastcar_ops.gate_node(model, form, inputs, attrs, name=name or old.name,
                                 metadata_props=dict(old.metadata_props))
    graph.insert_before(at or old, node)
    olds = [*old.outputs, *taken]
    for k, (before, after) in enumerate(zip(olds, node.outputs[:len(olds)], strict=True)):
        if before.name is None:  # an output no pass named (the packed gate's unused conditions)
            before.name = f"{node.name}.out{k}"
        gu.take_over(before, after, graph_outputs=True)
    graph.remove(old, safe=True)
    lr.gate, lr.gate_form, lr.gate_attrs = node, form, attrs
    return node


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
