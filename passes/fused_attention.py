"""Fused attention: an exported attention core becomes GroupQueryAttention or `ai.fastcar` CompressedAttention
(`--fused-attention gqa|fastcar`). The GroupQueryAttention is ai.fastcar's (native dense core, com.microsoft's
inputs, outputs and semantics; passes/native_gqa.py) where the plan says so (`plan.fused_op`: --native-attention on,
float32), else com.microsoft's: built once, as the op it stays.

Exporters write attention as `present.N.key = Concat(past_key, k_new)`, a K transpose, the GQA expand
(Unsqueeze/Expand/Reshape), MatMul/Softmax/MatMul: two O(context) copies of the cache per step (the
concat, the transpose) that replay cannot touch (docs/semantics.md section 5: 37% of a decode step at ctx 1024).
GroupQueryAttention reads the cache in place and, when its past and present are one buffer
(`past_present_share_buffer`, what onnxruntime-genai binds), appends the new key/value without copying.

Per layer the pass takes the rotated q [B, H, S, D] and the new k, v [B, Hkv, S, D] the exporter computed
(RoPE stays the exporter's), feeds them as [B, S, heads * D] with the graph's past key/value, and lets
GroupQueryAttention's output replace the [B, S, H * D] value the output projection reads; its present
key/value become the graph's `present.N.*`. Masking: GQA is causal over KV indices; left padding is an
additive `attention_bias` [B, 1, S, T] (0 for real, dtype-min for pad columns) and every row is treated as
T long (`seqlens_k` = T - 1). The score scale is the product of the constant factors the exporter applied
to q and k. Layers that do not have this shape stay as they were.

`fastcar`: the same replacement by the ai.fastcar CompressedAttention op (passes/fastcar_ops.py, native kernel in
runtime/native/compressed_attention.h): q, k, v stay [B, heads, S, D], the attention_mask goes in as it is (left
padding and causality over KV indices inside the op), so multi-token steps after the prompt work at any batch
(ORT's GQA refuses them at batch > 1); a preallocated KV buffer bound as past and present is written in place.

Each op is built once, in the form the plan decided on the export (passes/attention_form.py): q/k/v [B, S, H*D]
straight from the projections (`qkv_perm`), or one packed QKV MatMul with RoPE inside the op; the query a rewritten
layer's gate reads is recorded for GatePass (`PackedQuery`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from fastcar_compile.core import contract
from fastcar_compile.core.errors import FastCarError
from fastcar_compile.core.limits import check_state_bytes
from fastcar_compile.passes import build, fastcar_ops
from fastcar_compile.passes import discover as disc
from fastcar_compile.passes import graph_utils as gu
from fastcar_compile.passes.attention_form import BSHD_PERM, TABLE_PREFIX, Packing
from fastcar_compile.passes.context import CompileContext, PackedQuery
from fastcar_compile.passes.match_rotary import find_rotary_path
from fastcar_compile.passes.plan import FASTCAR_GQA, fused_op

MS = contract.MS_DOMAIN


def _scaled_source(value: ir.Value, stop: ir.Value | None = None) -> tuple[ir.Value, float]:
    """Walk back through constant Mul/Div (and casts/layout ops when `stop` is given) collecting the factor."""
    factor = 1.0
    for _ in range(32):
        if value is stop:
            break
        node = value.producer()
        if node is None:
            break
        if node.op_type in ("Mul", "Div") and gu.scalar_const(node.inputs[1]) is not None:
            c = gu.scalar_const(node.inputs[1])
            factor *= c if node.op_type == "Mul" else 1.0 / c
            value = node.inputs[0]
        elif node.op_type == "Mul" and gu.scalar_const(node.inputs[0]) is not None:
            factor *= gu.scalar_const(node.inputs[0])
            value = node.inputs[1]
        elif stop is not None and node.op_type in gu.LAYOUT_OPS:
            value = node.inputs[0]
        else:
            break
    return value, factor


def _shape_rank(shape: ir.Value | None) -> int | None:
    """How many dims a Reshape's shape input has: a constant, a known length, or a Concat of scalars."""
    if shape is None:
        return None
    if shape.const_value is not None:
        return int(shape.const_value.shape[0])
    dims = gu.static_dims(shape)
    if dims is not None and len(dims) == 1 and dims[0] is not None:
        return dims[0]
    node = shape.producer()
    if node is not None and node.op_type == "Concat":
        one_each = all(i is not None and ((gu.static_dims(i) or [0]) == [1] or (i.producer() is not None and
                       i.producer().op_type == "Unsqueeze")) for i in node.inputs)
        return len(node.inputs) if one_each else None
    return None


def _projection_input(core_out: ir.Value) -> ir.Value | None:
    """P @ V [B, H, S, D] -> (4-D Reshape) -> Transpose(0, 2, 1, 3) -> 3-D Reshape: that [B, S, H * D] value."""
    cons = gu.real_consumers(core_out)
    if len(cons) == 1 and cons[0].op_type == "Reshape" and _shape_rank(cons[0].inputs[1]) == 4:
        cons = gu.real_consumers(cons[0].outputs[0])
    if len(cons) != 1 or cons[0].op_type != "Transpose" or "perm" not in cons[0].attributes:
        return None
    if list(cons[0].attributes["perm"].value) != [0, 2, 1, 3]:
        return None
    nxt = gu.real_consumers(cons[0].outputs[0])
    if len(nxt) != 1 or nxt[0].op_type != "Reshape" or _shape_rank(nxt[0].inputs[1]) != 3:
        return None  # e.g. straight to [B * S, E] for GPT-2's Gemm
    return nxt[0].outputs[0]


def _score_scale(score: ir.Node) -> tuple[float, ir.Node, list[ir.Value]] | None:
    """The constant factor applied to the scores between the score MatMul and Softmax (the demo's export scales
    q.K^T after the MatMul), that Softmax and the mask values added or selected on the way, or None when anything
    but constant scaling, mask Adds/Where and casts lies there (soft-capping, ...): such a core is not fused."""
    factor, value, masks = 1.0, score.outputs[0], []
    for _ in range(16):
        cons = gu.real_consumers(value)
        if len(cons) != 1:
            return None
        node = cons[0]
        other = [i for i in node.inputs if i is not None and i is not value]
        if node.op_type == "Softmax":
            return factor, node, masks
        const = gu.scalar_const(other[0]) if len(other) == 1 else None
        if node.op_type == "Mul" and const is not None:
            factor *= const
        elif node.op_type == "Div" and node.inputs[0] is value and const is not None:
            factor /= const
        elif node.op_type in ("Add", "Where"):
            masks.extend(other)
        elif node.op_type != "Cast":
            return None
        value = node.outputs[0]
    return None


def _finite(values: list[ir.Value], limit: int = 400) -> bool:
    """Whether every float constant the mask values are computed from is finite (a finite-minimum mask), so a
    query that sees no key still has finite scores and its softmax is no NaN."""
    nodes = gu.ancestors_until(values, set(), limit=limit)
    if len(nodes) >= limit:
        return False
    tensors = [v.const_value for n in nodes for v in n.inputs if v is not None and v.const_value is not None]
    tensors += [v.const_value for v in values if v.const_value is not None]
    tensors += [a.value for n in nodes for a in n.attributes.values() if a.type == ir.AttributeType.TENSOR]
    return all(np.isfinite(t.numpy()).all() for t in tensors if t.dtype.is_floating_point())


def _reads_softmax(core_out: ir.Value, softmax: ir.Node, finite_scores: bool) -> bool:
    """Whether P.V (the node making `core_out`) reads `softmax`'s probabilities as they are. Casts pass, and so does
    the exporters' NaN guard Where(IsNaN(p), 0, p) when the scores are finite (it never fires). GPT-NeoX's
    TorchScript export masks with -inf: there the guard gives a query that sees no key (a left pad) zeros, where
    the fused op averages every value (what finite-minimum masks make softmax do); such a core is not fused."""
    pv = core_out.producer()
    probs = pv.inputs[0] if pv is not None and pv.op_type == "MatMul" else None
    for _ in range(8):
        node = probs.producer() if probs is not None else None
        if node is None or node is softmax:
            break
        if node.op_type == "Cast":
            probs = node.inputs[0]
        elif node.op_type == "Where" and finite_scores and node.inputs[0].producer() is not None and \
                node.inputs[0].producer().op_type == "IsNaN" and node.inputs[0].producer().inputs[0] is node.inputs[2]:
            probs = node.inputs[2]
        else:
            return False
    return probs is not None and probs.producer() is softmax


def _plan(m: disc.LayerMatch) -> dict | None:
    """What one layer's fusion needs, or None when its attention is not the exported MatMul/Softmax core."""
    att = m.attention
    if att is None or att.core_node.op_type != "MatMul" or att.packed_query is not None:
        return None
    kcat, vcat = att.present_key.producer(), att.present_value.producer()
    if kcat is None or vcat is None or kcat.op_type != "Concat" or vcat.op_type != "Concat":
        return None
    if len(kcat.inputs) != 2 or len(vcat.inputs) != 2:
        return None
    past_k, k_new = kcat.inputs
    past_v, v_new = vcat.inputs
    if not (past_k.is_graph_input() and past_v.is_graph_input()) or att.q_layout != "BHSD":
        return None
    score = att.core_node
    kidx = next((i for i, x in enumerate(score.inputs) if gu.depends_on(x, att.present_key, limit=64)), None)
    if kidx is None:
        return None
    q_src, q_scale = _scaled_source(score.inputs[1 - kidx])
    k_src, k_scale = _scaled_source(score.inputs[kidx], stop=att.present_key)
    if k_src is not att.present_key or q_src is not att.q:
        return None
    found = _score_scale(score)
    out_in = _projection_input(att.core_output)
    if out_in is None or found is None or not _reads_softmax(att.core_output, found[1], _finite(found[2])):
        return None
    s_scale = found[0]
    return {"q": att.q, "k": k_new, "v": v_new, "past_k": past_k, "past_v": past_v, "out": out_in,
            "scale": q_scale * k_scale * s_scale, "present_k": att.present_key, "present_v": att.present_value,
            "heads": att.num_heads, "kv_heads": att.num_kv_heads, "head_dim": att.head_dim}


def _bhsd_to_bse(b, graph, x: ir.Value, heads: int, head_dim: int) -> ir.Value:
    t = b("Transpose", [x], {"perm": [0, 2, 1, 3]}, part="attention")
    shape = build.const(graph, f"fastcar.shape.0_0_{heads * head_dim}", np.array([0, 0, heads * head_dim], np.int64))
    out = b("Reshape", [t, shape], part="attention")
    out.shape, out.type = ir.Shape([None, None, heads * head_dim]), x.type  # discovery reads the layout: BSE
    return out


SLOT_FIELDS = 3  # slot record: KV index + 1, count, mass (then one bucket per AnnSA table, then the hit frame
# with prompt pruning); DESIGN.md


def slot_width(cfg) -> int:
    """Fields of one slot record for a fastar.KVCompressConfig (the kernel reads the same layout)."""
    return SLOT_FIELDS + cfg.sparse_tables + (cfg.prune_prompt is not None)


def compressed_attributes(cfg, head_dim: int) -> dict:
    """CompressedAttention's attributes for a fastar.KVCompressConfig (LSH / int8 planes drawn as the reference)."""
    from fastcar_compile.fastar.cache import hasher

    attrs = {"budget": cfg.budget, "sinks": cfg.sinks, "window": cfg.window, "frame_tokens": cfg.frame_tokens,
             "eviction": cfg.eviction}
    if cfg.tempcache_sim is not None:
        attrs["tempcache_sim"] = float(cfg.tempcache_sim)
    planes = hasher(cfg, head_dim)
    if cfg.lsh_bits:
        attrs.update(lsh_bits=cfg.lsh_bits, lsh_tables=cfg.lsh_tables,
                     lsh_planes=[float(x) for x in planes.planes.astype(np.float32).reshape(-1)])
    if cfg.int8_dirs:
        attrs.update(int8_dirs=cfg.int8_dirs, int8_tables=cfg.int8_tables,
                     int8_planes=[float(x) for x in planes.planes.astype(np.float32).reshape(-1)])
    if cfg.prune_prompt is not None:
        attrs["prune_prompt"] = float(cfg.prune_prompt)
    return attrs


def describe(cfg) -> str:
    parts = [f"budget {cfg.budget}, sinks {cfg.sinks}, window {cfg.window}, eviction {cfg.eviction}"]
    if cfg.tempcache_sim is not None:
        parts.append(f"TempCache {cfg.tempcache_sim:g}")
    if cfg.lsh_bits:
        parts.append(f"AnnSA lsh {cfg.lsh_bits}x{cfg.lsh_tables}")
    if cfg.int8_dirs:
        parts.append(f"AnnSA int8 {cfg.int8_dirs}x{cfg.int8_tables}")
    if cfg.prune_prompt is not None:
        parts.append(f"prompt pruning {cfg.prune_prompt:g}")
    return ", ".join(parts)


def _untag(nodes: list[ir.Node]) -> None:
    """The shared inputs of every layer's op belong to no layer."""
    for node in nodes:
        node.metadata_props.clear()


def fusable(model: ir.Model, matches: list[disc.LayerMatch], opts, notes: list[str]) -> dict[int, dict]:
    """Layer -> what its fusion needs, for the layers `--fused-attention` replaces (the plan's decision; {} when
    none). Refuses compressed-KV options this model cannot take and --kv-layer naming a layer left as exported."""
    if not opts.fused_attention:
        return {}
    graph = model.graph
    mask = next((v for v in graph.inputs if v.name == "attention_mask"), None)
    plans = {m.layer: p for m in matches if (p := _plan(m)) is not None} if mask is not None else {}
    dtype = plans[min(plans)]["present_k"].dtype or ir.DataType.FLOAT if plans else None
    compress = opts.kv_compress is not None or any(c is not None for c in opts.kv_layer_configs.values())
    if compress and (not plans or dtype != ir.DataType.FLOAT):
        why = "no attention_mask input" if mask is None else "no exported MatMul/Softmax attention core " \
            "(dynamo / ort_fusions exports of LLaMA-style models)" if not plans else f"a {dtype.name.lower()} model"
        raise FastCarError(f"--kv-budget/--tempcache/--sparse-attention/--prune-prompt need the fastcar attention "
                           f"op, which "
                           f"this model cannot take ({why}; the op is float32); drop those options")
    if mask is None:
        notes.append("fused attention: no attention_mask input; attention left as exported")
        return {}
    if not plans:
        return {}
    if opts.fused_attention == "fastcar":
        if dtype != ir.DataType.FLOAT:  # the op is float32 (kernel and body): other dtypes stay as exported
            notes.append(f"fused attention: {dtype.name.lower()} model; attention left as exported "
                         "(the fastcar op is float32)")
            return {}
        unknown = sorted(set(opts.kv_layer_configs) - set(plans))
        if unknown:
            raise FastCarError(f"--kv-layer names layer {unknown[0]}, but the fastcar attention op replaced only "
                               f"layers {sorted(plans)}; name those")
    return plans


def core_attributes(p: dict) -> dict:
    """The fused op's head counts and score scale for one layer's fusion (`p`: what fusable found), the attributes
    every form of the op (the packed ones too) carries."""
    return {"num_heads": p["heads"], "kv_num_heads": p["kv_heads"], "scale": float(p["scale"])}


def kv_configs(opts, plans: dict[int, dict]) -> dict:
    """Layer -> its compressed-KV settings (fastar.KVCompressConfig) among the fused layers (`fastcar` only)."""
    if opts.fused_attention != "fastcar":
        return {}
    return {n: c for n in sorted(plans) if (c := opts.kv_config(n)) is not None}


class FusedAttentionPass(ir.passes.InPlacePass):
    """Exported attention cores (cache Concat, K transpose, GQA expand, MatMul/Softmax) -> GroupQueryAttention."""

    def __init__(self, ctx: CompileContext):
        super().__init__()
        self.ctx = ctx

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        self.tables: dict[int, tuple[ir.Value, ir.Value]] = {}  # cos/sin table initializers by Forms.tables index
        plans = self.ctx.fusions  # the plan's layers (fusable), matched before this pass
        if not plans:
            return ir.passes.PassResult(model, modified=False)
        mask = next(v for v in graph.inputs if v.name == "attention_mask")
        dtype = plans[min(plans)]["present_k"].dtype or ir.DataType.FLOAT
        shared: list[ir.Node] = []
        b = build.Builder(0, shared, itertools.count(), graph=graph, namespace="gqa_shared")
        if self.ctx.options.fused_attention == "fastcar":
            return self._fastcar(model, plans, mask, shared, b)
        # Shared inputs of every layer's GQA: lengths and the left-padding bias.
        total64 = b("Squeeze", [b("Shape", [mask], {"start": 1, "end": 2}),
                                build.const(graph, "fastcar.axes0", np.array([0], np.int64))])
        total = b("Cast", [total64], {"to": ir.DataType.INT32}, names=["fastcar.gqa.total_len"])
        batch = b("Shape", [mask], {"start": 0, "end": 1})
        seqlens = b("Expand", [b("Sub", [total, build.const(graph, "fastcar.gqa.one_i32", np.array(1, np.int32))]),
                               batch], names=["fastcar.gqa.seqlens_k"])
        lowest = np.array(np.finfo(dtype.numpy()).min, dtype.numpy())
        pad = b("Equal", [mask, build.const(graph, "fastcar.gqa.zero_i64", np.array(0, np.int64))])
        bias2 = b("Where", [pad, build.const(graph, f"fastcar.gqa.lowest_{dtype.name.lower()}", lowest),
                            build.const(graph, f"fastcar.gqa.zero_{dtype.name.lower()}", np.array(0, dtype.numpy()))])
        bias4 = b("Unsqueeze", [bias2, build.const(graph, "fastcar.gqa.axes12", np.array([1, 2], np.int64))])
        _untag(shared)
        graph.insert_before(graph[0], shared)
        ops = {n: fused_op(self.ctx.options, p) for n, p in plans.items()}
        cores = {n: self._fuse(graph, n, p, seqlens, total, bias4, ops[n]) for n, p in sorted(plans.items())}
        model.opset_imports.setdefault(MS, 1)
        native = sorted(n for n, op in ops.items() if op == FASTCAR_GQA)
        if native:
            fastcar_ops.add_functions(model, model.opset_imports.get("", 17))
        RemoveUnusedNodesPass()(model)
        self._record(cores)
        self.ctx.notes.append(f"fused attention (GroupQueryAttention) in layers {sorted(plans)}" +
                              (f"; ai.fastcar's (native dense core) in {native}" if native else ""))
        self._packed_note("GroupQueryAttention", plans)
        return ir.passes.PassResult(model, modified=True)

    def _record(self, cores: dict[int, ir.Node]) -> None:
        """The layer's attention is now the op this pass built (its present key, the keys the gate reads, and the
        total length, input 6 of both ops): the gate, emitted next, reads them from the match, not the graph."""
        for m in self.ctx.matches:
            if m.layer in cores:
                core = cores[m.layer]
                m.attention = dataclasses.replace(
                    m.attention, core_node=core, core_output=core.outputs[0], present_key=core.outputs[1],
                    present_value=core.outputs[2], keys=core.outputs[1], total_len=core.inputs[6], form="fused op")

    def _fastcar(self, model: ir.Model, plans: dict[int, dict], mask: ir.Value, shared: list[ir.Node],
                 b: build.Builder) -> ir.passes.PassResult:
        graph = model.graph
        total64 = b("Shape", [mask], {"start": 1, "end": 2})
        total = b("Cast", [b("Squeeze", [total64, build.const(graph, "fastcar.axes0", np.array([0], np.int64))])],
                  {"to": ir.DataType.INT32}, names=["fastcar.ca.total_len"])
        _untag(shared)
        graph.insert_before(graph[0], shared)
        opts = self.ctx.options
        configs = {n: opts.kv_config(n) for n in plans}
        cores: dict[int, ir.Node] = {}
        for n, p in sorted(plans.items()):
            cfg = configs[n]
            nodes: list[ir.Node] = []
            bl = build.Builder(n, nodes, itertools.count(), graph=graph, namespace="gqa")
            attrs = core_attributes(p)
            inputs = [p["q"], p["k"], p["v"], p["past_k"], p["past_v"], mask, total]
            form, overload = self.ctx.forms[n], ""
            if form.packing is not None:  # one QKV MatMul, RoPE inside the op (overload packed_rotary)
                qkv, table = self._qkv(graph, n, form.packing)
                none_f, none_i = build.absent(graph), build.absent(graph, np.int64)
                inputs = [qkv, none_f, none_f, *inputs[3:], none_f, none_f, none_f, none_f, none_i, *table]
                attrs |= {"qkv_perm": BSHD_PERM, "do_rotary": 1, "rotary_interleaved": 0}
                overload = fastcar_ops.PACKED_ROTARY
                query = PackedQuery(qkv, (*table, form.packing.head_dim))
            elif form.layout is not None:  # the rotaries and the op read the projections' [B, S, H*D] q/k/v
                split = form.layout
                for r, x, h in ((split.rq, split.xq, p["heads"]), (split.rk, split.xk, p["kv_heads"])):
                    r.replace_input_with(0, x)
                    r.attributes["num_heads"] = ir.AttrInt64("num_heads", h)
                    r.outputs[0].shape = x.shape
                inputs[2] = split.xv
                attrs["qkv_perm"] = BSHD_PERM
                query = PackedQuery(p["q"] if opts.tas_query == contract.TAS_ROPE else split.xq)
            if form.packed_gate and self.ctx.plan[n].rewrite:  # the query the layer's gate (emitted next) reads
                self.ctx.packed_queries[n] = query
            if cfg is not None:
                attrs.update(compressed_attributes(cfg, p["head_dim"]))
                inputs += self._slot_state(graph, n, p, cfg)
                # video_start is input 11 (pruning; TempCache merges only when p - L is video): fill the
                # optional inputs before it
                if cfg.prune_prompt is not None or cfg.tempcache_sim is not None:
                    none = build.absent(graph)
                    inputs += [none] * (11 - len(inputs))
                    inputs.append(build.video_start_input(graph, opts.video_start_default))
            diag = opts.kv_diagnostics is not None
            n_out = 3 if cfg is None else 8 if diag else 5 + (cfg.tempcache_sim is not None)
            outs = bl(contract.COMPRESSED_ATTENTION, inputs, attrs, domain=contract.DOMAIN, outputs=n_out,
                      part="attention", overload=overload)
            out, present_k, present_v = outs[:3]
            cores[n] = out.producer()
            if cfg is not None:
                self._slot_outputs(graph, n, outs, inputs[7:])
            out.shape, out.type = ir.Shape([None, None, p["heads"] * p["head_dim"]]), p["out"].type
            graph.insert_before(p["out"].consumers()[0], nodes)
            self._rewire(graph, p, out, present_k, present_v)
        self._check_state_bytes(plans, configs)
        fastcar_ops.add_functions(model, model.opset_imports.get("", 17))
        if self.tables:
            fastcar_ops.add_overload(model, contract.COMPRESSED_ATTENTION, fastcar_ops.PACKED_ROTARY,
                                     model.opset_imports.get("", 17))
        RemoveUnusedNodesPass()(model)
        self.ctx.notes.append(f"fused attention (ai.fastcar CompressedAttention) in layers {sorted(plans)}")
        laid_out = [n for n in plans if self.ctx.forms[n].layout is not None]
        if laid_out:
            gates = sum(self.ctx.plan[n].rewrite for n in laid_out)
            self.ctx.notes.append(f"q/k/v kept [B, S, H*D] into the fused attention in {len(laid_out)} layers; "
                                  f"one-node gate (packed TemporalGate) in {gates}")
        self._packed_note("CompressedAttention", plans)
        self._record(cores)
        for text in dict.fromkeys(describe(c) for c in self.ctx.kv_configs.values()):
            same = [n for n, c in self.ctx.kv_configs.items() if describe(c) == text]
            self.ctx.notes.append(f"compressed KV cache in layers {same}: {text}")
        return ir.passes.PassResult(model, modified=True)

    def _qkv(self, graph: ir.Graph, n: int, packing: Packing) -> tuple[ir.Value, tuple[ir.Value, ir.Value]]:
        """One MatMul (+ bias Add) on the concatenated q/k/v weights, before the q projection (the three originals go
        with the head splits); its [B, S, W] output and the cos/sin table initializers the op and gate rotate with."""
        pq = packing.projections[0]
        if packing.table not in self.tables:
            cos, sin = self.ctx.forms.tables[packing.table]
            k = packing.table
            self.tables[k] = (build.const(graph, f"{TABLE_PREFIX}{k}.cos_table", cos),
                              build.const(graph, f"{TABLE_PREFIX}{k}.sin_table", sin))
        base, meta = f"fastcar/gqa{n}", dict(pq.matmul.metadata_props)
        weight = build.const(graph, f"{pq.matmul.inputs[1].name}.qkv", np.ascontiguousarray(
            np.concatenate([p.weight for p in packing.projections], axis=1)))
        x = pq.matmul.inputs[0]
        matmul = ir.node("MatMul", [x, weight], name=f"{base}/qkv_matmul", metadata_props=meta)
        nodes, qkv = [matmul], matmul.outputs[0]
        if pq.bias is not None:
            bias = build.const(graph, f"{pq.matmul.inputs[1].name}.qkv_bias",
                               np.concatenate([p.bias for p in packing.projections]).astype(np.float32))
            add = ir.node("Add", [qkv, bias], name=f"{base}/qkv_bias", metadata_props=meta)
            nodes.append(add)
            qkv = add.outputs[0]
        width = sum(p.weight.shape[1] for p in packing.projections)
        qkv.name, qkv.dtype = f"{base}.qkv", ir.DataType.FLOAT
        qkv.shape = ir.Shape([*(x.shape[:2] if x.shape is not None and len(x.shape) == 3 else [None, None]), width])
        graph.insert_before(pq.matmul, nodes)
        return qkv, self.tables[packing.table]

    def _packed_note(self, op: str, plans: dict[int, dict]) -> None:
        packed = [n for n in plans if self.ctx.forms[n].packing is not None]
        if packed:  # the metadata says so: FastCarSession checks positions against the table
            self.ctx.rotary_table = self.ctx.forms.positions
            self.ctx.notes.append(f"packed QKV with RoPE inside {op} in {len(packed)} layers (rotary table of "
                                  f"{self.ctx.forms.positions} positions)")

    def _check_state_bytes(self, plans: dict[int, dict], configs: dict) -> None:
        """The fixed state of one video (K/V slots and slot records of every compressed layer) must fit in this
        machine's memory: refused here, naming the budget, rather than as a MemoryError when a session allocates."""
        budgets = {n: c.budget for n, c in configs.items() if c is not None and c.budget is not None}
        if not budgets:
            return
        kv = sum(2 * plans[n]["kv_heads"] * c * plans[n]["head_dim"] * 4 for n, c in budgets.items())
        records = sum(math.prod(int(d) for d in e.shape[1:]) * 4 for e in self.ctx.kv_state)
        big = max(budgets.values())
        flag = "--kv-budget" if self.ctx.options.kv_budget == big else "--kv-layer budget"
        check_state_bytes(flag, big, kv + records, f"{len(budgets)} layers x K/V slots and their records")

    def _slot_state(self, graph: ir.Graph, n: int, p: dict, cfg) -> list[ir.Value]:
        """The layer's slot records (and raw keys for TempCache) as state inputs, recorded for the metadata."""
        batch = p["past_k"].shape[0] if p["past_k"].shape is not None else "batch"
        width = slot_width(cfg)
        diag = self.ctx.options.kv_diagnostics
        pairs = [(contract.kv_slots_input(n), contract.kv_slots_output(n), cfg.budget, width)]
        if cfg.tempcache_sim is not None or diag is not None:  # (diagnostics: inputs after them must not gap)
            pairs.append((contract.kv_rawkey_input(n), contract.kv_rawkey_output(n), cfg.budget, p["head_dim"]))
        if diag is not None:
            pairs.append((contract.kv_dense_input(n), contract.kv_dense_output(n), diag, 2 * p["head_dim"]))
        values = []
        for name, out_name, rows, last in pairs:
            shape = [batch, p["kv_heads"], rows, last]
            values.append(build.graph_input(graph, name, ir.DataType.FLOAT, shape))
            self.ctx.kv_state.append(contract.StateEntry(name, out_name, ("batch", p["kv_heads"], rows, last),
                                                         "float", 0))
        if len(pairs) > 1:
            k_raw, _, _ = find_rotary_path(p["k"])
            values.insert(1, k_raw)
        return values

    @staticmethod
    def _slot_outputs(graph: ir.Graph, n: int, outs: tuple[ir.Value, ...], state_in: list[ir.Value]) -> None:
        """present_kv_slots.N (and present_kv_rawkey.N) become graph outputs typed like their inputs."""
        outs[4].name = f"fastcar.{n}.aligned_key"
        pairs = [(outs[3], state_in[0], contract.kv_slots_output(n))]
        if len(outs) > 5:
            pairs.append((outs[5], state_in[2], contract.kv_rawkey_output(n)))
        if len(outs) > 6:
            pairs.append((outs[6], state_in[3], contract.kv_dense_output(n)))
        for value, like, name in pairs:
            value.name, value.type, value.shape = name, like.type, like.shape
            graph.outputs.append(value)
        if len(outs) > 7:
            stats = outs[7]
            stats.name, stats.type = contract.kv_stats_output(n), ir.TensorType(ir.DataType.FLOAT)
            stats.shape = ir.Shape([state_in[0].shape[0], state_in[0].shape[1], 4])
            graph.outputs.append(stats)

    @staticmethod
    def _rewire(graph: ir.Graph, p: dict, out: ir.Value, present_k: ir.Value, present_v: ir.Value) -> None:
        """The fused op's output replaces the projection input; its present key/value become the graph's."""
        ir.convenience.replace_all_uses_with(p["out"], out)
        for old, new in ((p["present_k"], present_k), (p["present_v"], present_v)):
            gu.take_over(old, new, graph_outputs=True)
        if not math.isfinite(p["scale"]) or p["scale"] <= 0:
            raise AssertionError(f"attention scale {p['scale']}")

    def _fuse(self, graph: ir.Graph, n: int, p: dict, seqlens: ir.Value, total: ir.Value, bias4: ir.Value,
              op: str) -> ir.Node:
        """One layer's GroupQueryAttention, built as the plan's `op` (ai.fastcar's or com.microsoft's); returns it."""
        nodes: list[ir.Node] = []
        b = build.Builder(n, nodes, itertools.count(), graph=graph, namespace="gqa")
        heads, kv_heads, head_dim = p["heads"], p["kv_heads"], p["head_dim"]
        packing = self.ctx.forms[n].packing
        qkv, table = self._qkv(graph, n, packing) if packing is not None else (None, None)
        # The score's S axis must match the bias: [B, 1, 1, T] -> [B, 1, S, T] (S of q [B, H, S, D] or qkv [B, S, W]).
        s_len = b("Shape", [p["q"]], {"start": 2, "end": 3}, part="attention") if qkv is None else \
            b("Shape", [qkv], {"start": 1, "end": 2}, part="attention")
        t_len = b("Shape", [bias4], {"start": 3, "end": 4}, part="attention")
        b_len = b("Shape", [bias4], {"start": 0, "end": 1}, part="attention")
        one = build.const(graph, "fastcar.gqa.one_i64", np.array([1], np.int64))
        bias = b("Expand", [bias4, b("Concat", [b_len, one, s_len, t_len], {"axis": 0}, part="attention")],
                 part="attention")
        if packing is not None:  # GroupQueryAttention's own packed form: query = the QKV projection, do_rotary with
            # the table (ORT's positions: seqlens_k + 1 - S + i = KV index, since seqlens_k = total - 1 here)
            inputs = [qkv, None, None, p["past_k"], p["past_v"], seqlens, total, *table, None, bias]
            attrs = {**core_attributes(p), "do_rotary": 1, "rotary_interleaved": 0}
            if self.ctx.plan[n].rewrite:  # the gate (emitted next) rotates the query slice of the projection
                self.ctx.packed_queries[n] = PackedQuery(qkv, (*table, packing.head_dim))
        else:
            q = _bhsd_to_bse(b, graph, p["q"], heads, head_dim)
            k = _bhsd_to_bse(b, graph, p["k"], kv_heads, head_dim)
            v = _bhsd_to_bse(b, graph, p["v"], kv_heads, head_dim)
            inputs = [q, k, v, p["past_k"], p["past_v"], seqlens, total, None, None, None, bias]
            attrs = {**core_attributes(p), "do_rotary": 0}
        # ai.fastcar's op: com.microsoft's inputs, outputs and attributes (its function body is that op)
        domain = contract.DOMAIN if op == FASTCAR_GQA else MS
        out, present_k, present_v = b(contract.GROUP_QUERY_ATTENTION, inputs, attrs, domain=domain, outputs=3,
                                      part="attention")
        out.shape, out.type = ir.Shape([None, None, heads * head_dim]), p["out"].type
        graph.insert_before(p["out"].consumers()[0], nodes)
        self._rewire(graph, p, out, present_k, present_v)
        return out.producer()
