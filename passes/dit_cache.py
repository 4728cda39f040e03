"""The DiT target's cache emission: every block's self-attention reads the runtime's cache buffers in place
(InPlaceCachePass), with TempCache's slot bias and AnnSA's bucketed cache part where the plan has them.

The export's self-attention is `softmax(q [past; k]^T) [past; v]` with `[past; k] = Concat(past.N.key, k)`: per
denoising step and layer, ONNX Runtime copies the whole cache twice (the concats) plus the key transpose and
scale, and the runtime concatenates the resident frames into the step's inputs once per chunk. The rewrite
computes the same attention without touching the cache's bytes except to read them:

    scores = Concat(q' past^T + (0 if slot < past_length else -inf), q k^T)   (q' past^T: FusedMatMul, transB)
    out    = Slice(softmax(scores), :C) past_v + Slice(softmax(scores), C:) v

`past.N.key|value` become the runtime's preallocated buffers [B, heads, C, d] (C slots: sink frames, then a
ring of window frames, cache.RingCache) of which the first `past_length` tokens hold K/V; the chunk's own K/V
stay the `present.N.*` outputs, which the runtime writes into the ring after the chunk's cache pass (the
chunk's bytes only). Keys are stored rotated at their absolute positions and attention is a sum over the
keys, so their order in the buffer does not matter. FastCar's FFN replay is passes/dit_replay.py's;
`--tempcache SIM` adds each slot's log(count) (`past_bias.N`) to the cache's scores and
outputs the pre-RoPE keys (`present_pre.N.key`) for the runtime's merge at write time (cache.RingCache), with
the correspondent `--tempcache-match` names (aligned, or the top-1 match in a bucket: dit/tempcache.py); in its
`slots` form (the native library there) the block's attention is one ai.fastcar SlotAttention node over the
resident slots the runtime lists per (row, head) (`tempcache_slots.N`), so a position a merge left costs nothing;
`--annca` keeps, per frame, the prompt tokens sharing a bucket with a query of the frame (passes/dit_annca.py);
`--annsa lsh|int8` replaces the cache's part by AnnSA's block-sparse attention over buckets (passes/dit_annsa.py).
FAST-AR's other compressed caches are not compiled for DiT blocks yet: asked for, they are refused in one line.
"""

from __future__ import annotations

import itertools

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from fastcar_compile.core import contract
from fastcar_compile.core.contract import (
    ANNSA_NATIVE,
    PAST_LENGTH,
    TEMPCACHE_SLOTS,
    AnnSARecord,
    tempcache_io,
    tempcache_slots_name,
)
from fastcar_compile.core.errors import FastCarError
from fastcar_compile.passes import dit_annsa as annsa_graph
from fastcar_compile.passes.build import Builder, const
from fastcar_compile.passes.context import DiTContext
from fastcar_compile.passes.dit_discover import DiTBlockMatch, SelfAttention
from fastcar_compile.passes.dit_plan import DiTBlockPlan


def _rewrite_block(graph: ir.Graph, m: DiTBlockMatch, bias: ir.Value, capacity: ir.Value, ids,
                   slot_bias: ir.Value | None = None, annsa: AnnSARecord | None = None,
                   slots: ir.Value | None = None) -> list[ir.Node]:
    """The block's attention over (buffer, chunk) as in the module docstring, plus `slot_bias` [B, heads, C]
    (TempCache's log(count) per slot) on the cache's scores when given; with `annsa` the cache's part is
    AnnSA's (passes/dit_annsa.py) instead of the whole buffer; with `slots` (TempCache's resident slots) one
    SlotAttention node over them; returns the new nodes."""
    a: SelfAttention = m.attention
    nodes: list[ir.Node] = []
    b = Builder(m.layer, nodes, ids, graph=graph)
    pkey, key = a.key_concat.inputs
    pvalue, value = a.value_concat.inputs
    # the chunk's own scores: the export's key path, fed the chunk's keys instead of the concat
    ir.convenience.replace_all_uses_with(a.key_concat.outputs[0], key)
    q = a.query
    for f in a.key_factors:  # the scale the export applied to the keys, applied to the query instead
        q = b("Mul", [q, f], part="attention")
    if slots is not None:  # TempCache's slots form: one node over the resident slots (the work follows them)
        ctx = b(contract.SLOT_ATTENTION, [q, key, value, pkey, pvalue, slots, slot_bias], domain=contract.DOMAIN,
                part="cache")
        ir.convenience.replace_all_uses_with(a.context.outputs[0], ctx)
        graph.insert_before(a.softmax, nodes)
        return nodes
    if annsa is not None and annsa.annsa_kernel == ANNSA_NATIVE:  # one node: the whole context
        ab = Builder(m.layer, nodes, ids, graph=graph, namespace="annsa")
        ctx = annsa_graph.native_context(ab, graph, m.layer, a, q, key, value, pkey, pvalue, annsa, a.head_dim)
        ir.convenience.replace_all_uses_with(a.context.outputs[0], ctx)
        graph.insert_before(a.softmax, nodes)
        return nodes
    if annsa is not None:
        ab = Builder(m.layer, nodes, ids, graph=graph, namespace="annsa")  # AnnSA's nodes (and its bucket codes)
        masked, annsa_context = annsa_graph.cache_scores(ab, graph, m.layer, a, q, pkey, pvalue, annsa, a.head_dim)

        def past_context(_, probs):
            return annsa_context(ab, probs)
        width = b("Shape", [masked], {"start": 3, "end": 4}, part="attention")
    else:
        past_scores = b("FusedMatMul", [q, pkey], {"transB": 1, "alpha": 1.0}, domain=contract.MS_DOMAIN,
                        part="attention")
        masked = b("Add", [past_scores, bias], part="attention")  # (ORT's broadcasting Where is 5x slower)
        if slot_bias is not None:
            axis2 = const(graph, "fastcar.dit.axis2", np.array([2], np.int64))
            masked = b("Add", [masked, b("Unsqueeze", [slot_bias, axis2], part="cache")], part="attention")
        width = capacity

        def past_context(b2, probs):
            return b2("MatMul", [probs, pvalue], part="attention")
    self_scores = a.softmax.inputs[0]
    joined = b("Concat", [masked, self_scores], {"axis": -1}, part="attention")
    a.softmax.replace_input_with(0, joined)
    before = len(nodes)
    probs = a.softmax.outputs[0]
    zero = const(graph, "fastcar.dit.zero", np.array([0], np.int64))
    end = const(graph, "fastcar.dit.end", np.array([np.iinfo(np.int64).max], np.int64))
    last = const(graph, "fastcar.dit.last_axis", np.array([-1], np.int64))
    p_past = b("Slice", [probs, zero, width, last], part="attention")
    p_self = b("Slice", [probs, width, end, last], part="attention")
    ctx = b("Add", [past_context(b, p_past), b("MatMul", [p_self, value], part="attention")], part="attention")
    old = a.context.outputs[0]
    ir.convenience.replace_all_uses_with(old, ctx)
    graph.insert_before(a.softmax, nodes[:before])  # the scores, before the softmax reads them
    graph.insert_after(a.softmax, nodes[before:])  # the two slices, the products and their sum
    return nodes


def rewrite(model: ir.Model, matches: list[DiTBlockMatch], plans: list[DiTBlockPlan]) -> None:
    """Every block's attention reads `past.N.*` in place (module docstring); adds the `past_length` input. A block
    planned with TempCache also takes its slots' log(count) (`past_bias.N`) on the cache's scores and outputs the
    chunk's pre-RoPE keys (`present_pre.N.key`) for the runtime's merge; one planned with AnnSA attends to the
    cache through it."""
    graph = model.graph
    if any(v.name == PAST_LENGTH for v in graph.inputs):
        raise FastCarError(f"the step graph already has a {PAST_LENGTH} input: it is compiled; compile the export")
    length = ir.Value(name=PAST_LENGTH, type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([1]))
    graph.inputs.append(length)
    model.opset_imports.setdefault(contract.MS_DOMAIN, 1)  # FusedMatMul
    ids = itertools.count()
    shared: list[ir.Node] = []
    b = Builder(-1, shared, ids, graph=graph)
    first = matches[0].attention.key_concat.inputs[0]
    two = const(graph, "fastcar.dit.two", np.array([2], np.int64))
    three = const(graph, "fastcar.dit.three", np.array([3], np.int64))
    capacity = b("Slice", [b("Shape", [first], part="cache"), two, three], part="cache")  # [1]: C
    slots = b("Range", [const(graph, "fastcar.dit.zero_s", np.array(0, np.int64)),
                        b("Squeeze", [capacity], part="cache"),
                        const(graph, "fastcar.dit.one_s", np.array(1, np.int64))], part="cache")
    mask = b("Less", [slots, length], part="cache")  # [C]: slots holding K/V
    bias = b("Where", [mask, const(graph, "fastcar.dit.zero_f", np.array(0.0, np.float32)),
                       const(graph, "fastcar.dit.minus_inf", np.array(-np.inf, np.float32))], part="cache")
    graph.insert_before(graph[0], shared)
    if any(p.annsa is not None for p in plans):
        annsa_graph.add_dense_input(graph)
    for m, p in zip(matches, plans, strict=True):
        slot_bias = _tempcache_io(graph, m, ids) if p.tempcache is not None else None
        slots = _slots_input(graph, m) if p.tempcache is not None and p.tempcache_kernel == TEMPCACHE_SLOTS else None
        _rewrite_block(graph, m, bias, capacity, ids, slot_bias, p.annsa, slots)
    if any((p.annsa is not None and p.annsa.annsa_kernel == ANNSA_NATIVE) or
           (p.tempcache is not None and p.tempcache_kernel == TEMPCACHE_SLOTS) for p in plans):
        from fastcar_compile.passes import fastcar_ops

        fastcar_ops.add_functions(model, model.opset_imports.get("", 17))  # the op's body: runs without the library
    RemoveUnusedNodesPass()(model)
    for m in matches:
        i = m.layer
        for kind in ("key", "value"):
            v = next(x for x in graph.inputs if x.name == f"past.{i}.{kind}")
            dims = list(v.shape) if v.shape is not None else [None] * 4
            v.shape = ir.Shape([dims[0], dims[1], "capacity", dims[3]])


def _slots_input(graph: ir.Graph, m: DiTBlockMatch) -> ir.Value:
    """Block m's `tempcache_slots.N` input [B, heads, N] int64: the resident slots the runtime lists."""
    v = ir.Value(name=tempcache_slots_name(m.layer), type=ir.TensorType(ir.DataType.INT64),
                 shape=ir.Shape(["batch", m.attention.heads, f"resident_{m.layer}"]))
    graph.inputs.append(v)
    return v


def _tempcache_io(graph: ir.Graph, m: DiTBlockMatch, ids) -> ir.Value:
    """Block m's `past_bias.N` input [B, heads, capacity] and `present_pre.N.key` output [B, heads, S, d] (the
    pre-RoPE key as [B, S, heads * d] reshaped and transposed, after its producer)."""
    a = m.attention
    name_in, name_out = tempcache_io(m.layer)
    slot_bias = ir.Value(name=name_in, type=ir.TensorType(ir.DataType.FLOAT),
                         shape=ir.Shape(["batch", a.heads, "capacity"]))
    graph.inputs.append(slot_bias)
    nodes: list[ir.Node] = []
    b = Builder(m.layer, nodes, ids, graph=graph)
    split = const(graph, "fastcar.dit.heads_shape", np.array([0, 0, a.heads, a.head_dim], np.int64))
    pre = b("Transpose", [b("Reshape", [m.key_pre, split], part="cache")], {"perm": [0, 2, 1, 3]}, part="cache",
            names=[name_out])
    pre.type, pre.shape = ir.TensorType(ir.DataType.FLOAT), ir.Shape(["batch", a.heads, None, a.head_dim])
    graph.insert_after(m.key_pre.producer(), nodes)
    graph.outputs.append(pre)
    return slot_bias


class InPlaceCachePass(ir.passes.InPlacePass):
    """Every DiT block's self-attention reads the cache buffers in place (+ TempCache's bias, AnnSA: the plan's)."""

    def __init__(self, ctx: DiTContext):
        super().__init__()
        self.ctx = ctx

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        rewrite(model, self.ctx.matches, [self.ctx.plan[m.layer] for m in self.ctx.matches])
        return ir.passes.PassResult(model, modified=True)
