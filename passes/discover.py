"""Find decoder layers in an exported graph from dataflow alone, as small matchers tried in order.

Anchors, in the order they are searched (each failure names the anchor, the forms tried and where the
search stopped; `--inspect` prints them per layer):
1. `kv`: the graph outputs `present.N.key` / `present.N.value` (the exporter I/O convention).
2. `attention` (passes/match_attention.py): the op that reads the key cache, as onnxruntime-genai's
   GroupQueryAttention on packed QKV or rotating inside (passes/genai_gqa.py), a fused attention op or a
   MatMul/Softmax pair,
   through layout ops and a sliding-window Slice.
3. `query`: the query that op reads, its heads and layout; `rotary` (passes/match_rotary.py): the raw query
   behind a RotaryEmbedding op, a partial or a rotate-half rotary, or none.
4. `residual` / `mlp` (passes/match_residual.py, match_mlp.py): where the attention output joins the stream,
   then the MLP branch as a fused Skip*Norm, a sequential Add or a parallel residual sum.
Weight names and module paths are never used: exporters rename and merge them.
"""

from __future__ import annotations

import dataclasses
import re

import onnx_ir as ir

from fastcar_compile.core import contract
from fastcar_compile.passes import genai_gqa
from fastcar_compile.passes import graph_utils as gu
from fastcar_compile.passes import match_attention as ma
from fastcar_compile.passes.layer_match import AttentionBlock, LayerMatch, MLPBlock
from fastcar_compile.passes.match_base import MatchContext, MatchFailure
from fastcar_compile.passes.match_residual import find_mlp
from fastcar_compile.passes.match_rotary import find_rotary_path
from fastcar_compile.passes.window import mask_input

__all__ = ["AttentionBlock", "LayerMatch", "MLPBlock", "MatchFailure", "discover", "kv_outputs"]

_KV_NAME = re.compile(r"^present[._](\d+)[._](key|value)$")


def kv_outputs(graph: ir.Graph) -> dict[int, dict[str, ir.Value]]:
    layers: dict[int, dict[str, ir.Value]] = {}
    for out in graph.outputs:
        m = _KV_NAME.match(out.name or "")
        if m:
            layers.setdefault(int(m.group(1)), {})[m.group(2)] = out
    return dict(sorted(layers.items()))


def discover(model: ir.Model) -> list[LayerMatch]:
    """One LayerMatch per KV-cache layer of the model, matched or with the reason it was not."""
    graph = model.graph
    ctx = MatchContext.of(graph)
    matches = []
    for layer, kv in kv_outputs(graph).items():
        matches.append(_match_layer(ctx, layer, kv))
    return matches


def _match_layer(ctx: MatchContext, layer: int, kv: dict[str, ir.Value]) -> LayerMatch:
    """The layer's match (frozen), or the anchor that failed with the blocks found before it."""
    ctx.trace = trace = []
    attention = mlp = None
    try:
        if "key" not in kv or "value" not in kv:
            raise MatchFailure("kv", f"present.{layer}.key/value: only {sorted(kv)} found", "graph outputs")
        attention = find_attention(ctx, kv["key"], kv["value"])
        join, _, mlp = find_mlp(ctx, attention.core_output)
        attention = dataclasses.replace(attention, join=join.node, stream_in=mlp.residual if
                                        mlp.form == "parallel residual" else join.other)
    except MatchFailure as exc:
        return LayerMatch(layer, attention, mlp, exc, trace)
    return LayerMatch(layer, attention, mlp, None, trace)


def find_attention(ctx: MatchContext, pkey: ir.Value, pvalue: ir.Value) -> AttentionBlock:
    """The attention block of one layer: its op, query (and raw query), heads and layout."""
    kdims = gu.static_dims(pkey)
    core_node, kidx, keys = ma.cache_consumer(ctx, pkey)
    packed = genai_gqa.match(core_node)
    if packed is not None:  # onnxruntime-genai: packed QKV or rotary inside the op, symbolic head size
        src, heads, num_kv, head_dim = packed
        inputs = "packed QKV" if src.packed else "separate q/k/v, query"
        ctx.trace.append(f"{gu.describe(core_node)} on {inputs} {src.qkv.name}: heads {heads}, kv heads {num_kv}, "
                         f"head dim {head_dim} (output projection), rotary {src.rotary}")
        if src.rope_refusal is not None:
            ctx.trace.append(f"rope TAS refused: {src.rope_refusal}")
        if heads % num_kv:
            raise MatchFailure("query", f"{heads} query heads do not group over {num_kv} kv heads", src.qkv.name)
        form = "packed-QKV GroupQueryAttention" if src.packed else "GroupQueryAttention (separate q/k/v)"
        return AttentionBlock(pkey, pvalue, core_node, core_node.outputs[0], src.qkv, "QKV", src.qkv, "QKV",
                              src.rotary, heads, num_kv, head_dim, form=form, keys=pkey, packed_query=src,
                              total_len=src.total_len, rope_refusal=src.rope_refusal)
    form, core = ma.find_core(ctx, core_node, kidx, keys, pvalue)
    if kdims is not None and len(kdims) == 4 and kdims[3] is None:  # symbolic head size (genai's builder)
        kdims[3] = ma.head_dim_from_core(core.core)
    if kdims is None or len(kdims) != 4 or kdims[1] is None or kdims[3] is None:
        raise MatchFailure("kv", f"{pkey.name} must be [batch, kv_heads, seq, head_dim] with static heads/dims",
                           f"shape {pkey.shape}")
    num_kv, head_dim = int(kdims[1]), int(kdims[3])
    heads = ma.query_heads(core, head_dim)
    q = core.q
    q_raw, rope, swapped = find_rotary_path(q)
    raw_layout = ma.layout_of(q_raw, heads, head_dim) or ma.layout_from_structure(q_raw)
    # A rotary is elementwise over the head layout, so q keeps the layout of the raw query, unless a head
    # transpose sits between them (GPT-J rotates [B, S, H, D], then permutes).
    flip = {"BHSD": "BSHD", "BSHD": "BHSD"}
    layout = ma.layout_of(q, heads, head_dim) or ma.layout_from_structure(q)
    if layout is None and raw_layout is not None:
        layout = flip.get(raw_layout) if swapped else raw_layout
    if raw_layout is None and layout is not None:
        raw_layout = flip.get(layout) if swapped else layout
    if layout is None:
        raise MatchFailure("query", f"unknown layout of query {q.name} (shape {q.shape})", gu.describe(q.producer()))
    ctx.trace.append(f"attention op: {gu.describe(core.core)}")
    ctx.trace.append(f"query {q.name} [{layout}], raw {q_raw.name} [{raw_layout}], rotary: {rope}")
    ctx.trace.append(f"heads {heads}, kv heads {num_kv}, head dim {head_dim}")
    if heads % num_kv:
        raise MatchFailure("query", f"{heads} query heads do not group over {num_kv} kv heads", q.name)
    window = None
    if core.keys is not pkey:
        if mask_input(ctx.graph) is None:
            raise MatchFailure("kv", f"{pkey.name} is a sliding window of the keys attention reads; FastCar needs "
                               "the attention_mask input (its length is the absolute position) to index them",
                               "graph inputs")
        window = ma.window_length(pkey)
        ctx.trace.append(f"sliding-window cache: keeps {window if window is not None else '?'} positions")
    # GroupQueryAttention's total_sequence_length (input 6)
    gqa = core.core.op_type == contract.GROUP_QUERY_ATTENTION and len(core.core.inputs) > 6
    return AttentionBlock(pkey, pvalue, core.core, core.core_output, q, layout, q_raw, raw_layout, rope, heads,
                          num_kv, head_dim, form=form, keys=core.keys, window=window,
                          total_len=core.core.inputs[6] if gqa else None)
