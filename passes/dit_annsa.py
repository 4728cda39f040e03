"""AnnSA compiled into a DiT step graph (`fastcar-compile dit.onnx -o fast.onnx --annsa lsh|int8`): the chunk's
queries attend to the chunk, the sink frames and the `annsa_local` most recent cached frames densely, and to any
other cached slot only where query and key share a bucket in one of T tables (the eager runtime's AnnSA,
dit/fastar.attend_cache).

Two forms (contract.ANNSA_KERNELS, recorded in the metadata): with the native library (the default when it
builds; `--native-attention off` asks for the graph) one ai.fastcar AnnSAAttention node per block
(native_context), whose kernel walks each query's buckets and scores only the selected slots; otherwise the
block-sparse ONNX ops below, which run in any ONNX Runtime with nothing to build but pad every bucket's
queries and keys to the fullest (one 4-bit LSH bucket can hold nearly all of a chunk's queries).

The ONNX-op form, per block N (B rows, H heads, Q chunk queries, d head size, T tables):
    codes    = the queries' bucket ids [B, H, Q, T] (dit_annca.bucket_codes: fastar's reference hashers as
               nodes, in float64 as they compute); also the output `annsa_codes.N`
    dense    = the cache slots `annsa_dense` [Nd] (sinks + local frames, the runtime's ring positions) gathered
               once and multiplied with every query
    blocks   = per table, the runtime's key blocks: the occupied buckets `annsa_buckets.N` [B, H, T, K] and
               their slots `annsa_keys.N` [B, H, T, K, M] (padding: `annsa_bias.N` -inf). Each block's queries are
               found in-graph (one-hot over the K buckets, rank by CumSum, sorted by TopK, padded to the fullest
               bucket Mq), gathered, and multiplied with the block's gathered keys: [K, Mq, d] x [K, d, M] per
               (row, head, table); a pair that met in an earlier table is masked (`annsa_kcodes.N`, the block
               keys' codes in every table), so it counts once
    softmax  = one softmax over [dense | chunk | each query's T block rows] (the block logits gathered back to
               their queries), the block probabilities gathered into block layout again and multiplied with the
               gathered values
The runtime (dit/annsa_index.AnnIndex) codes each key once when its frame is written and rebuilds the blocks
once per chunk; within a chunk every denoising step reuses them.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from fastcar_compile.core import contract
from fastcar_compile.core.contract import ANNSA_DENSE, ANNSA_INPUTS, ANNSA_NATIVE, AnnSARecord, annsa_io
from fastcar_compile.fastar.config import hasher_of
from fastcar_compile.passes.dit_annca import bucket_codes
from fastcar_compile.passes.dit_discover import SelfAttention


def add_inputs(graph: ir.Graph, layer: int, a: SelfAttention, tables: int) -> dict[str, ir.Value]:
    """Block `layer`'s AnnSA graph inputs (contract.annsa_io), with the shared `annsa_dense` (add_dense_input)."""
    names = annsa_io(layer)
    k, m = f"buckets_{layer}", f"bucket_keys_{layer}"  # per block: each has its own occupancy
    shapes = {"buckets": (ir.DataType.INT64, ["batch", a.heads, tables, k]),
              "keys": (ir.DataType.INT64, ["batch", a.heads, tables, k, m]),
              "bias": (ir.DataType.FLOAT, ["batch", a.heads, tables, k, m]),
              "kcodes": (ir.DataType.INT64, ["batch", a.heads, tables, tables, k, m])}
    out = {}
    for kind, (dtype, shape) in shapes.items():
        v = ir.Value(name=names[kind], type=ir.TensorType(dtype), shape=ir.Shape(shape))
        graph.inputs.append(v)
        out[kind] = v
    out["dense"] = next(v for v in graph.inputs if v.name == ANNSA_DENSE)
    return out


def _codes_output(b, graph: ir.Graph, layer: int, a: SelfAttention, h) -> ir.Value:
    """The chunk's query ids [B, H, Q, T] (AnnCA's nodes for the reference hashers), also the output
    `annsa_codes.N` (the runtime counts the executed pairs from them)."""
    codes = bucket_codes(graph, b, a.query, h, "sa")
    codes = b("Identity", [codes], part="annsa", names=[annsa_io(layer)["codes"]])
    codes.type, codes.shape = ir.TensorType(ir.DataType.INT64), ir.Shape(["batch", a.heads, None, h.tables])
    graph.outputs.append(codes)
    return codes


def native_context(b, graph: ir.Graph, layer: int, a: SelfAttention, q: ir.Value, key: ir.Value, value: ir.Value,
                   pkey: ir.Value, pvalue: ir.Value, mode: AnnSARecord, head_dim: int) -> ir.Value:
    """Block `layer`'s whole self-attention context [B, H, Q, d] as one AnnSAAttention node over the cache and
    the chunk's own keys (`q` scaled as the scores use it), with the native form's inputs (contract.annsa_io)."""
    h = hasher_of(mode, head_dim)
    names = annsa_io(layer)
    shapes = {"key_codes": ["batch", a.heads, "capacity", h.tables],
              "sorted_codes": ["batch", a.heads, h.tables, f"bucketed_{layer}"],
              "sorted_slots": ["batch", a.heads, h.tables, f"bucketed_{layer}"]}
    ins = []
    for kind in ANNSA_INPUTS[ANNSA_NATIVE]:
        v = ir.Value(name=names[kind], type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape(shapes[kind]))
        graph.inputs.append(v)
        ins.append(v)
    codes = _codes_output(b, graph, layer, a, h)
    dense = next(v for v in graph.inputs if v.name == ANNSA_DENSE)
    return b(contract.ANNSA_ATTENTION, [q, key, value, pkey, pvalue, dense, codes, *ins], domain=contract.DOMAIN,
             part="annsa")


def add_dense_input(graph: ir.Graph) -> None:
    """`annsa_dense` [Nd]: the cache positions every block attends densely (one input for all blocks)."""
    graph.inputs.append(ir.Value(name=ANNSA_DENSE, type=ir.TensorType(ir.DataType.INT64),
                                 shape=ir.Shape(["dense_tokens"])))


def cache_scores(b, graph: ir.Graph, layer: int, a: SelfAttention, q: ir.Value, pkey: ir.Value, pvalue: ir.Value,
                 mode: AnnSARecord, head_dim: int):
    """The cache's part of block `layer`'s attention (module docstring): returns (scores [B, H, Q, n] to join
    before the chunk's own, context(probs of those n columns) -> [B, H, Q, d]). `q` is the query as the scores
    use it (the export's key scale applied); its codes are taken from the unscaled query (a positive scale
    changes no bucket, and the reference hashes the unscaled one)."""
    h = hasher_of(mode, head_dim)
    T = h.tables

    def c(name, array):
        from fastcar_compile.passes.build import const

        return const(graph, f"fastcar.dit.annsa.{mode.kind}.{name}", np.asarray(array))

    ins = add_inputs(graph, layer, a, T)
    i64 = {"to": ir.DataType.INT64}
    codes = _codes_output(b, graph, layer, a, h)
    # dense part: sinks + local frames, gathered once per step
    kd = b("Gather", [pkey, ins["dense"]], {"axis": 2}, part="annsa")
    vd = b("Gather", [pvalue, ins["dense"]], {"axis": 2}, part="annsa")
    ld = b("FusedMatMul", [q, kd], {"transB": 1, "alpha": 1.0}, domain=contract.MS_DOMAIN, part="annsa")
    # each query's bucket among the K occupied ones, per table: one-hot [B, H, T, Q, K]
    qc = b("Transpose", [codes], {"perm": [0, 1, 3, 2]}, part="annsa")  # [B, H, T, Q]
    onehot = b("Equal", [b("Unsqueeze", [qc, c("ax4", np.array([4], np.int64))], part="annsa"),
                         b("Unsqueeze", [ins["buckets"], c("ax3", np.array([3], np.int64))], part="annsa")],
               part="annsa")
    oh = b("Cast", [onehot], i64, part="annsa")
    inb = b("Cast", [b("ReduceMax", [oh, c("last", np.array([-1], np.int64))], {"keepdims": 0}, part="annsa")],
            {"to": ir.DataType.BOOL}, part="annsa")  # [B, H, T, Q]: its bucket holds keys
    slot = b("ArgMax", [oh], {"axis": -1, "keepdims": 0}, part="annsa")  # [B, H, T, Q]
    rank = b("Sub", [b("ReduceSum", [b("Mul", [b("CumSum", [oh, c("ax3_s", np.array(3, np.int64))], part="annsa"),
                                                oh], part="annsa"), c("last", np.array([-1], np.int64))],
                       {"keepdims": 0}, part="annsa"), c("one", np.array(1, np.int64))], part="annsa")
    rank = b("Max", [rank, c("zero", np.array(0, np.int64))], part="annsa")
    count = b("ReduceSum", [oh, c("ax3", np.array([3], np.int64))], {"keepdims": 0}, part="annsa")  # [B, H, T, K]
    mq = b("Max", [b("ReduceMax", [count], {"keepdims": 0}, part="annsa"), c("one", np.array(1, np.int64))],
           part="annsa")  # the fullest bucket's queries (>= 1)
    # the queries of each bucket in order: sort by (bucket, query), take Mq from each bucket's start
    nq = b("Shape", [qc], {"start": 3, "end": 4}, part="annsa")  # [1]: Q
    qidx = b("Range", [c("zero", np.array(0, np.int64)), b("Squeeze", [nq], part="annsa"),
                       c("one", np.array(1, np.int64))], part="annsa")
    nk = b("Shape", [ins["buckets"]], {"start": 3, "end": 4}, part="annsa")  # [1]: K
    sort_slot = b("Where", [inb, slot, nk], part="annsa")  # queries in no occupied bucket sort last
    key = b("Cast", [b("Add", [b("Mul", [sort_slot, nq], part="annsa"), qidx], part="annsa")],
            {"to": ir.DataType.FLOAT}, part="annsa")
    _, order = b("TopK", [b("Neg", [key], part="annsa"), nq], {"axis": -1}, outputs=2, part="annsa")
    start = b("Sub", [b("CumSum", [count, c("ax3_s", np.array(3, np.int64))], part="annsa"), count], part="annsa")
    pos = b("Add", [b("Unsqueeze", [start, c("last", np.array([-1], np.int64))], part="annsa"),
                    b("Range", [c("zero", np.array(0, np.int64)), mq, c("one", np.array(1, np.int64))], part="annsa")],
            part="annsa")  # [B, H, T, K, Mq]
    pos = b("Min", [pos, b("Sub", [nq, c("one", np.array(1, np.int64))], part="annsa")], part="annsa")
    qtab = b("GatherND", [order, b("Unsqueeze", [pos, c("last", np.array([-1], np.int64))], part="annsa")],
             {"batch_dims": 3}, part="annsa")  # [B, H, T, K, Mq]: query per block row (garbage past the count)
    qtab1 = b("Unsqueeze", [qtab, c("last", np.array([-1], np.int64))], part="annsa")
    qb = b("GatherND", [q, qtab1], {"batch_dims": 2}, part="annsa")  # [B, H, T, K, Mq, d]
    keys1 = b("Unsqueeze", [ins["keys"], c("last", np.array([-1], np.int64))], part="annsa")
    kb = b("GatherND", [pkey, keys1], {"batch_dims": 2}, part="annsa")  # [B, H, T, K, M, d]
    vb = b("GatherND", [pvalue, keys1], {"batch_dims": 2}, part="annsa")
    lb = b("FusedMatMul", [qb, kb], {"transB": 1, "alpha": 1.0}, domain=contract.MS_DOMAIN, part="annsa")
    lb = b("Add", [lb, b("Unsqueeze", [ins["bias"], c("ax4", np.array([4], np.int64))], part="annsa")], part="annsa")
    minus_inf = c("minus_inf", np.array(-np.inf, np.float32))
    if T > 1:  # a pair sharing a bucket in an earlier table was counted there: per table t > 0, per u < t
        qcb = b("GatherND", [codes, qtab1], {"batch_dims": 2}, part="annsa")  # [B, H, T, K, Mq, T]
        split = {"axis": 2, "num_outputs": T}
        lbs = b("Split", [lb], split, outputs=T, part="annsa")  # [B, H, 1, K, Mq, M] each
        qs = b("Split", [qcb], split, outputs=T, part="annsa")  # [B, H, 1, K, Mq, T]
        ks = b("Split", [ins["kcodes"]], split, outputs=T, part="annsa")  # [B, H, 1, T, K, M]
        pieces = [lbs[0]]
        for t in range(1, T):
            dup = None
            for u in range(t):
                u_ = c(f"table{u}", np.array(u, np.int64))
                qu = b("Unsqueeze", [b("Gather", [qs[t], u_], {"axis": 5}, part="annsa"), c("last", np.array([-1], np.int64))],
                       part="annsa")  # [B, H, 1, K, Mq, 1]
                ku = b("Unsqueeze", [b("Gather", [ks[t], u_], {"axis": 3}, part="annsa"),
                                     c("ax4", np.array([4], np.int64))], part="annsa")  # [B, H, 1, K, 1, M]
                eq = b("Equal", [qu, ku], part="annsa")
                dup = eq if dup is None else b("Or", [dup, eq], part="annsa")
            pieces.append(b("Where", [dup, minus_inf, lbs[t]], part="annsa"))
        lb = b("Concat", pieces, {"axis": 2}, part="annsa")
    # each query's row of its block, per table: (bucket, rank); queries in no occupied bucket get -inf
    at = b("Concat", [b("Unsqueeze", [slot, c("last", np.array([-1], np.int64))], part="annsa"),
                      b("Unsqueeze", [rank, c("last", np.array([-1], np.int64))], part="annsa")], {"axis": -1},
           part="annsa")  # [B, H, T, Q, 2]
    inb1 = b("Unsqueeze", [inb, c("last", np.array([-1], np.int64))], part="annsa")
    lq = b("Where", [inb1, b("GatherND", [lb, at], {"batch_dims": 3}, part="annsa"), minus_inf], part="annsa")
    lq = b("Reshape", [b("Transpose", [lq], {"perm": [0, 1, 3, 2, 4]}, part="annsa"),
                       c("merge", np.array([0, 0, 0, -1], np.int64))], part="annsa")  # [B, H, Q, T * M]
    scores = b("Concat", [ld, lq], {"axis": -1}, part="annsa")
    n_dense = b("Shape", [ins["dense"]], part="annsa")
    zero1 = c("zero1", np.array([0], np.int64))
    end = c("end", np.array([np.iinfo(np.int64).max], np.int64))
    last = c("last", np.array([-1], np.int64))

    def context(b2, probs: ir.Value) -> ir.Value:
        pd = b2("Slice", [probs, zero1, n_dense, last], part="annsa")
        pq = b2("Slice", [probs, n_dense, end, last], part="annsa")  # [B, H, Q, T * M]
        m = b2("Shape", [ins["keys"]], {"start": 4, "end": 5}, part="annsa")
        shape = b2("Concat", [c("split_head", np.array([0, 0, 0, T], np.int64)), m], {"axis": 0}, part="annsa")
        pq = b2("Transpose", [b2("Reshape", [pq, shape], part="annsa")], {"perm": [0, 1, 3, 2, 4]},
                part="annsa")  # [B, H, T, Q, M]
        pb = b2("GatherND", [pq, qtab1], {"batch_dims": 3}, part="annsa")  # [B, H, T, K, Mq, M]
        ob = b2("MatMul", [pb, vb], part="annsa")  # [B, H, T, K, Mq, d]
        oq = b2("Where", [inb1, b2("GatherND", [ob, at], {"batch_dims": 3}, part="annsa"),
                          c("zero_f", np.array(0.0, np.float32))], part="annsa")  # [B, H, T, Q, d]
        total = b2("ReduceSum", [oq, c("ax2", np.array([2], np.int64))], {"keepdims": 0}, part="annsa")
        return b2("Add", [b2("MatMul", [pd, vd], part="annsa"), total], part="annsa")

    return scores, context
