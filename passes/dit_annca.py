"""AnnCA compiled into a DiT step graph (`--annca`): per frame of the chunk, a prompt token enters the
cross-attention only if a query of that frame shares a bucket with it in at least one table, and the frame's
queries attend to its kept tokens only. The eager runtime's mode (dit/fastar.cross_attend), as graph nodes.

Per block N planned with AnnCA (AnnCAPass), on the cross-attention discovery found (passes/dit_discover.py):
    codes      = the bucket ids [.., tables] of the query, and of the prompt keys once per prompt (the prompt
                 graph's outputs `cross.N.codes`, the step graph's inputs): the reference hashers of
                 fastar/lsh.py and fastar/int8.py as nodes, in float64 as they compute
    occupied   = per (row, head, frame, table) a bitmap over the buckets: ScatterElements of the frame's
                 query codes (the frame's queries meet the prompt through it, never query by query)
    kept       = per (row, head, frame) and prompt token: occupied at its code in any table (GatherElements,
                 ReduceMax); output `annca.N` [B, heads, F, L] (the runtime counts the executed pairs)
    attention  = per frame, the kept tokens' K/V gathered first (a stable partition of the mask: kept ones in
                 prompt order, padded to the frame keeping most, the padding's logit -inf), the frame's queries
                 times them, softmax, times their values; a frame that keeps nothing attends to nothing (output
                 0). For a short prompt (the config's text_len < GATHER_FROM) gathering costs more than it saves:
                 the frame's queries attend to the whole prompt with the dropped tokens' logits at -inf.
The export's own scores / softmax / context nodes of the cross-attention are then unused and removed.

ONNX ops, no ai.fastcar kernel: every step is a stock op ONNX Runtime runs anywhere (no native library to
load for the step graph), the products stay MLAS MatMuls; the price is a fixed cost of about 40 small nodes per
block and the padding to the widest frame, measured in docs/dit.md (a fused kernel would remove both).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from fastcar_compile.core import contract
from fastcar_compile.core.contract import BucketRecord, DiTConfig, annca_io
from fastcar_compile.fastar.buckets import Buckets
from fastcar_compile.fastar.config import hasher_of
from fastcar_compile.fastar.int8 import SCALE, Int8Buckets
from fastcar_compile.fastar.lsh import SignLSH
from fastcar_compile.passes.build import Builder, const
from fastcar_compile.passes.context import DiTContext
from fastcar_compile.passes.dit_discover import DiTBlockMatch, is_scalar

_DOUBLE = ir.DataType.DOUBLE
GATHER_FROM = 64  # prompt tokens (the config's text_len) from which the kept tokens are gathered, not masked
# (measured: benchmarks/experiments/dit_annca_compiled.py, docs/dit.md)


def n_buckets(hasher: Buckets) -> int:
    """How many bucket ids a table of `hasher` has (the bitmap's size)."""
    return 1 << hasher.bits if isinstance(hasher, SignLSH) else 256


def bucket_codes(graph: ir.Graph, b: Builder, x: ir.Value, hasher: Buckets, tag: str) -> ir.Value:
    """Nodes computing hasher.codes(x): bucket ids [..., tables] (int64) of x [..., d], in float64."""
    t = hasher.tables

    def c(name: str, array) -> ir.Value:
        return const(graph, f"fastcar.dit.annca.{tag}.{name}", np.asarray(array))

    xd = b("Cast", [x], {"to": _DOUBLE}, part="annca")
    planes = hasher.planes.reshape(t * hasher.planes.shape[1], -1).T.astype(np.float64)  # [d, tables * n]
    if isinstance(hasher, SignLSH):
        bits = hasher.bits
        proj = b("MatMul", [xd, c("planes", planes)], part="annca")
        signs = b("Cast", [b("Greater", [proj, c("zero", np.float64(0))], part="annca")], {"to": _DOUBLE},
                  part="annca")
        pack = np.zeros((t * bits, t))
        for i in range(t):
            pack[i * bits:(i + 1) * bits, i] = 1 << np.arange(bits)
    elif isinstance(hasher, Int8Buckets):
        dirs, bits = hasher.dirs, hasher.bits
        norm = b("Sqrt", [b("ReduceSum", [b("Mul", [xd, xd], part="annca"), c("last", np.array([-1], np.int64))],
                            {"keepdims": 1}, part="annca")], part="annca")
        unit = b("Div", [xd, b("Max", [norm, c("tiny", np.float64(1e-300))], part="annca")], part="annca")
        y = b("Mul", [c("sqrt_dim", np.float64(math.sqrt(hasher.dim))),
                      b("MatMul", [unit, c("planes", planes)], part="annca")], part="annca")
        code = b("Clip", [b("Floor", [b("Mul", [c("scale", np.float64(SCALE)), y], part="annca")], part="annca"),
                          c("lo", np.float64(-128)), c("hi", np.float64(127))], part="annca")
        top = b("Floor", [b("Div", [code, c("step", np.float64(1 << (8 - bits)))], part="annca")], part="annca")
        signs = b("Add", [top, c("offset", np.float64(1 << (bits - 1)))], part="annca")
        pack = np.zeros((t * dirs, t))
        for i in range(t):
            pack[i * dirs:(i + 1) * dirs, i] = 1 << (bits * np.arange(dirs))
    else:
        raise TypeError(f"no graph form of {type(hasher).__name__}")
    return b("Cast", [b("MatMul", [signs, c("pack", pack)], part="annca")], {"to": ir.DataType.INT64}, part="annca")


def annca_attention(graph: ir.Graph, b: Builder, query: ir.Value, scaled: ir.Value, ckey: ir.Value,
                    cvalue: ir.Value, frames: int, head_dim: int, hasher: Buckets, gather: bool = True,
                    key_codes: ir.Value | None = None) -> tuple[ir.Value, ir.Value]:
    """AnnCA of `query` [B, H, F*T, d] (bucketed) over the prompt `ckey`, `cvalue` [B, H, L, d]; `scaled` is the
    query as the scores read it (times every scale the export applied to either side); `key_codes` [B, H, L,
    tables] the prompt keys' codes when computed once per prompt (None: here). Returns (context [B, H, F*T, d],
    kept [B, H, F, L] bool)."""
    t = hasher.tables

    def c(name: str, array) -> ir.Value:
        return const(graph, f"fastcar.dit.annca.{name}", np.asarray(array))

    def n(op, inputs, attrs=None, **kw):
        return b(op, inputs, attrs, part="annca", **kw)

    i64 = np.int64
    qshape, kshape = n("Shape", [query]), n("Shape", [ckey])
    rows_heads = n("Slice", [qshape, c("zero", np.array([0], i64)), c("two", np.array([2], i64))])  # [B, H]
    prompt = n("Slice", [kshape, c("two", np.array([2], i64)), c("three", np.array([3], i64))])  # [L]
    # the frame's query codes, as a bitmap over the buckets per (row, head, frame, table)
    qc = n("Transpose", [n("Reshape", [bucket_codes(graph, b, query, hasher, "q"),
                                       c("frames_codes", np.array([0, 0, frames, -1, t], i64))])],
           {"perm": [0, 1, 2, 4, 3]})  # [B, H, F, tables, T]
    occ_shape = n("Concat", [rows_heads, c("frames_tables_buckets", np.array([frames, t, n_buckets(hasher)], i64))],
                  {"axis": 0})
    empty = n("ConstantOfShape", [occ_shape], {"value": ir.tensor(np.zeros(1, np.float32))})
    ones = n("ConstantOfShape", [n("Shape", [qc])], {"value": ir.tensor(np.ones(1, np.float32))})
    occupied = n("ScatterElements", [empty, qc, ones], {"axis": -1})  # duplicates all write 1
    # each prompt token's codes looked up in its frame's bitmap: kept when occupied in any table
    if key_codes is None:
        key_codes = bucket_codes(graph, b, ckey, hasher, "k")
    kc = n("Unsqueeze", [n("Transpose", [key_codes], {"perm": [0, 1, 3, 2]}),
                         c("axis2", np.array([2], i64))])  # [B, H, 1, tables, L]
    kc = n("Expand", [kc, n("Concat", [rows_heads, c("frames_tables", np.array([frames, t], i64)), prompt],
                            {"axis": 0})])
    keptf = n("ReduceMax", [n("GatherElements", [occupied, kc], {"axis": -1}), c("axis3", np.array([3], i64))],
              {"keepdims": 0})  # [B, H, F, L] 1.0 / 0.0
    kept = n("Cast", [keptf], {"to": ir.DataType.BOOL})
    count = n("ReduceSum", [keptf, c("last", np.array([-1], i64))], {"keepdims": 0})  # [B, H, F]
    qf = n("Reshape", [scaled, c("frames_q", np.array([0, 0, frames, -1, head_dim], i64))])  # [B, H, F, T, d]
    if gather:
        keys, values, bias = _gather_kept(n, c, kept, keptf, count, rows_heads, prompt, ckey, cvalue, head_dim)
    else:  # the whole prompt, the dropped tokens' logits -inf: fewer nodes, for prompts too short to gather
        axis2 = c("axis2", np.array([2], i64))
        keys, values = n("Unsqueeze", [ckey, axis2]), n("Unsqueeze", [cvalue, axis2])  # [B, H, 1, L, d]
        bias = n("Where", [kept, c("zero_f", np.float32(0)), c("minus_inf", np.float32(-np.inf))])  # [B, H, F, L]
    scores = n("FusedMatMul", [qf, keys], {"transB": 1, "alpha": 1.0}, domain=contract.MS_DOMAIN)
    scores = n("Add", [scores, n("Unsqueeze", [bias, c("axis3", np.array([3], i64))])])
    ctx = n("MatMul", [n("Softmax", [scores], {"axis": -1}), values])  # [B, H, F, T, d]
    some = n("Unsqueeze", [n("Greater", [count, c("zero_f", np.float32(0))]), c("axes34", np.array([3, 4], i64))])
    ctx = n("Where", [some, ctx, c("zero_f", np.float32(0))])  # a frame keeping nothing: 0, as the eager mode
    return n("Reshape", [ctx, c("tokens_d", np.array([0, 0, -1, head_dim], i64))]), kept


def _gather_kept(n, c, kept, keptf, count, rows_heads, prompt, ckey, cvalue, head_dim: int):
    """Each frame's kept prompt K/V gathered [B, H, F, n, d], kept ones first in prompt order, padded to the
    frame keeping most; and the logit bias [B, H, F, n] (-inf on the padding). The order is a stable partition
    (a kept token's place = the kept ones before it, a dropped one's = count + the dropped ones before it:
    CumSum and one ScatterElements of a permutation, cheaper than TopK's sort)."""
    i64 = np.int64
    last = c("last", np.array([-1], i64))
    widest = n("Reshape", [n("Cast", [n("Max", [n("ReduceMax", [count], {"keepdims": 0}), c("one_f", np.float32(1))])],
                                {"to": ir.DataType.INT64}), c("one_dim", np.array([1], i64))])
    before_kept = n("CumSum", [keptf, last], {"exclusive": 1})
    before_dropped = n("CumSum", [n("Sub", [c("one_f", np.float32(1)), keptf]), last], {"exclusive": 1})
    place = n("Where", [kept, before_kept, n("Add", [n("Unsqueeze", [count, last]), before_dropped])])
    tokens = n("Expand", [n("Range", [c("zero_s", np.array(0, i64)), n("Squeeze", [prompt]), c("one_s", np.array(1, i64))]),
                          n("Shape", [keptf])])
    order = n("ScatterElements", [n("ConstantOfShape", [n("Shape", [keptf])], {"value": ir.tensor(np.zeros(1, i64))}),
                                  n("Cast", [place], {"to": ir.DataType.INT64}), tokens], {"axis": -1})
    idx = n("Slice", [order, c("zero", np.array([0], i64)), widest, last])  # [B, H, F, n]
    slots = n("Range", [c("zero_f", np.float32(0)), n("Cast", [n("Squeeze", [widest])], {"to": ir.DataType.FLOAT}),
                        c("one_f", np.float32(1))])
    bias = n("Where", [n("Less", [slots, n("Unsqueeze", [count, last])]), c("zero_f", np.float32(0)),
                       c("minus_inf", np.float32(-np.inf))])  # [B, H, F, n]
    # flat rows of the prompt's K/V: (row * H + head) * L + token
    groups = n("ReduceProd", [rows_heads], {"keepdims": 0})
    base = n("Range", [c("zero_s", np.array(0, i64)), n("Mul", [groups, n("Squeeze", [prompt])]),
                       n("Squeeze", [prompt])])
    base = n("Reshape", [base, n("Concat", [rows_heads, c("ones2", np.array([1, 1], i64))], {"axis": 0})])
    flat_idx = n("Add", [idx, base])  # [B, H, F, n]
    rows_d = c("rows_d", np.array([-1, head_dim], i64))
    keys = n("Gather", [n("Reshape", [ckey, rows_d]), flat_idx], {"axis": 0})  # [B, H, F, n, d]
    values = n("Gather", [n("Reshape", [cvalue, rows_d]), flat_idx], {"axis": 0})
    return keys, values, bias


def add_annca(model: ir.Model, matches: list[DiTBlockMatch], cfg: DiTConfig, hasher: Buckets) -> None:
    """AnnCA on every block's cross-attention (module docstring); new inputs `cross.N.codes` (the prompt keys'
    codes: `prompt_codes` adds them to the prompt graph) and outputs `annca.N`."""
    graph = model.graph
    model.opset_imports.setdefault(contract.MS_DOMAIN, 1)  # FusedMatMul
    ids = itertools.count()
    for m in matches:
        cross = m.cross_attention
        ckey, cvalue, context, factors = cross.key, cross.value, cross.context, cross.key_factors
        scaled = cross.scores.inputs[0]
        query = scaled  # before its scale factors: the query the eager mode buckets
        while query.producer() is not None and query.producer().op_type in ("Mul", "Div") \
                and is_scalar(query.producer().inputs[1]):
            query = query.producer().inputs[0]
        codes_name, kept_name = annca_io(m.layer)
        codes = ir.Value(name=codes_name, type=ir.TensorType(ir.DataType.INT64),
                         shape=ir.Shape(["batch", cfg.heads, "text", hasher.tables]))
        graph.inputs.append(codes)
        nodes: list[ir.Node] = []
        b = Builder(m.layer, nodes, ids, graph=graph, namespace="annca")
        for f in factors:  # the keys' scale, applied to the query instead (the keys are gathered raw)
            scaled = b("Mul", [scaled, f], part="annca")
        ctx, kept = annca_attention(graph, b, query, scaled, ckey, cvalue, cfg.chunk_frames, cfg.head_dim, hasher,
                                    gather=cfg.text_len >= GATHER_FROM, key_codes=codes)
        kept.name = kept_name
        kept.type, kept.shape = ir.TensorType(ir.DataType.BOOL), ir.Shape(["batch", cfg.heads, cfg.chunk_frames,
                                                                           "text"])
        graph.outputs.append(kept)
        old = context.outputs[0]
        ctx.shape, ctx.type = old.shape, old.type
        ir.convenience.replace_all_uses_with(old, ctx)
        graph.insert_after(context, nodes)
    RemoveUnusedNodesPass()(model)  # the export's scores, softmax and context of the cross-attention


class AnnCAPass(ir.passes.InPlacePass):
    """AnnCA on the cross-attention of every block planned with it (new inputs cross.N.codes, outputs annca.N)."""

    def __init__(self, ctx: DiTContext):
        super().__init__()
        self.ctx = ctx

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        done = False
        for record, blocks in _by_record(self.ctx, "annca"):
            add_annca(model, blocks, self.ctx.cfg, hasher_of(record, self.ctx.cfg.head_dim))
            done = True
        return ir.passes.PassResult(model, modified=done)


def _by_record(ctx: DiTContext, field: str) -> list[tuple[BucketRecord, list[DiTBlockMatch]]]:
    """The matched blocks grouped by their plan's `field` record (blocks planned without it left out)."""
    groups: dict[BucketRecord, list[DiTBlockMatch]] = {}
    for m in ctx.matches:
        record = getattr(ctx.plan[m.layer], field)
        if record is not None:
            groups.setdefault(record, []).append(m)
    return list(groups.items())


def prompt_codes(cfg: DiTConfig, hasher: Buckets) -> ir.Model:
    """The nodes that give the prompt graph its outputs `cross.N.codes` [B, H, L, tables] (int64) from its
    `cross.N.key` outputs: the prompt is fixed for a video, so its keys are hashed once, not every step. A graph
    whose inputs are those keys; the prompt graph's staging (passes/dit_prompt.py) appends its nodes,
    initializers and outputs to the prompt graph's copy."""
    f32 = ir.TensorType(ir.DataType.FLOAT)
    keys = [ir.Value(name=f"cross.{i}.key", type=f32, shape=ir.Shape(["batch", cfg.heads, "text", cfg.head_dim]))
            for i in range(cfg.layers)]
    graph = ir.Graph(keys, [], nodes=[], opset_imports={"": 20})
    nodes: list[ir.Node] = []
    ids = itertools.count()
    for i, key in enumerate(keys):
        codes = bucket_codes(graph, Builder(i, nodes, ids, graph=graph, namespace="annca_prompt"), key, hasher, "k")
        codes.name, codes.type = annca_io(i)[0], ir.TensorType(ir.DataType.INT64)
        codes.shape = ir.Shape(["batch", cfg.heads, "text", hasher.tables])
        graph.outputs.append(codes)
    graph.extend(nodes)
    return ir.Model(graph, ir_version=10)


def standalone(hasher: Buckets, frames: int, head_dim: int, gather: bool = True) -> ir.Model:
    """The op as the step graph runs it, alone (tests and benchmarks): inputs q [B, H, F*T, d] (unscaled), k, v
    [B, H, L, d] and the prompt keys' codes kc [B, H, L, tables] (int64); outputs `ctx` (the attention with the
    1/sqrt(d) scale) and `kept`."""
    f32 = ir.TensorType(ir.DataType.FLOAT)
    q, k, v = (ir.Value(name=name, type=f32, shape=ir.Shape(["batch", "heads", length, head_dim]))
               for name, length in (("q", "tokens"), ("k", "text"), ("v", "text")))
    kc = ir.Value(name="kc", type=ir.TensorType(ir.DataType.INT64),
                  shape=ir.Shape(["batch", "heads", "text", hasher.tables]))
    graph = ir.Graph([q, k, v, kc], [], nodes=[], opset_imports={"": 20, contract.MS_DOMAIN: 1})
    nodes: list[ir.Node] = []
    b = Builder(0, nodes, itertools.count(), graph=graph)
    scaled = b("Mul", [q, const(graph, "scale", np.float32(head_dim ** -0.5))], part="annca")
    ctx, kept = annca_attention(graph, b, q, scaled, k, v, frames, head_dim, hasher, gather=gather, key_codes=kc)
    graph.extend(nodes)
    ctx.name, kept.name = "ctx", "kept"
    graph.outputs.extend([ctx, kept])
    return ir.Model(graph, ir_version=10)
