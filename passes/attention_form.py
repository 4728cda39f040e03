"""How each fused attention is built, decided from the export before anything is emitted: q/k/v layout and packing.

A fused layer's exported attention, after the rotary fusion, still runs per step Reshape + Transpose for each of q,
k and v (the exporter's head split, [B, S, H*D] -> [B, H, S, D]), three q/k/v MatMuls on one normed input and a
RotaryEmbedding on q and one on k: launches onnxruntime-genai's step does not have (each costs its thread-pool
hand-off at 2 threads, whatever the kernel time). `decide` picks, per fused layer, the leanest form the attention
emission (passes/fused_attention.py) then builds in one go:

- layout (`--fused-attention fastcar`, dense cache): RotaryEmbedding (which takes [B, S, H*D] with `num_heads`) and
  CompressedAttention (`qkv_perm` [0, 2, 1, 3]) read the projections' [B, S, H*D] outputs; the head splits go. A
  rewritten layer's gate reads that [B, S, H*D] query (post-RoPE for TAS `rope`, the projection for `raw`): the packed
  TemporalGate onnxruntime-genai graphs use. Exact: the same arithmetic, only the inputs' memory layout differs.
- packing (`--pack-qkv`, default on; both fused ops): one MatMul on the concatenated q/k/v weights (+ bias Add), the
  originals removed (the weights held do not grow), RoPE inside the op (CompressedAttention's `packed_rotary`
  overload, GroupQueryAttention's do_rotary) and inside the gate (packed_qkv + do_rotary), from a cos/sin table.

Rotary positions of the packed form: the op and the gate rotate at KV index total_len - S + i, as
GroupQueryAttention does with seqlens_k = total_len - 1, from a table [positions, D / 2] that is the export's own
rotary subgraph evaluated (ONNX Runtime, at compile time) on position_ids = 0..positions-1 (`--rotary-positions`).
The export rotates at the position_ids fed, which FastCarSession makes the count of real tokens before each one: the
KV index minus the row's left padding, a per-row constant. RoPE scores and TAS depend on q and k positions only
through their difference, so the values are the export's up to float rounding of the angles (the native kernels'
rotation is not ORT's RotaryEmbedding kernel: tests compare within 1e-4). That needs padding only before a row's
first real token: the metadata's `rotary_positions` makes FastCarSession refuse mask zeros after it, other
position_ids and videos past the table; --pack-qkv off runs those. A rotary whose row p depends on more than p
(frequencies switched by the sequence length) is left unpacked. TAS `raw` dots the unrotated query with keys rotated
at their absolute positions, which is not shift invariant: such rewritten layers stay unpacked.

Only float32 layers whose q/k/v come from the exporter's head split, rotated by RotaryFusionPass's RotaryEmbedding
(half-split, the graph's own cos/sin) and projected by float32 MatMuls (+ bias Add) on constant weights are taken,
and only where nothing else reads the values the form drops (checked on the graph as it will be: `gu.live_nodes`);
the notes say in one line why a layer is left. MatMulNBits: not applicable, the torch dynamo path exports float
MatMuls (int4 weights come only from the genai builder, whose QKV is packed already).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import onnx_ir as ir

from fastcar_compile.core import contract
from fastcar_compile.passes import graph_utils as gu

MS = contract.MS_DOMAIN
BSHD_PERM = [0, 2, 1, 3]
PREFIX_CHECK = 64  # positions evaluated alone: their rows must equal the long table's bit for bit
TABLE_PREFIX = "fastcar.rotary"  # initializer names of the cos/sin tables: fastcar.rotaryK.{cos,sin}_table


def _attr(node: ir.Node, name: str, default=None):
    return node.attributes[name].value if name in node.attributes else default


@dataclass(frozen=True)
class Fusion:
    """What a layer's fused attention op reads and replaces, found on the export (fused_attention.fusable): the
    rotated q [B, H, S, D], the new k, v [B, Hkv, S, D], the past key/value inputs, the [B, S, H*D] value the output
    projection reads (`out`), the exported present key/value the op's outputs take over, and the score scale."""

    q: ir.Value
    k: ir.Value
    v: ir.Value
    past_k: ir.Value
    past_v: ir.Value
    out: ir.Value
    scale: float
    present_k: ir.Value
    present_v: ir.Value
    heads: int
    kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class HeadSplit:
    """A layer's q, k rotated by RotaryEmbedding `rq`, `rk` from the exporter's head split of the [B, S, heads*D]
    projections `xq`, `xk`; v the head split of `xv`."""

    rq: ir.Node
    rk: ir.Node
    xq: ir.Value
    xk: ir.Value
    xv: ir.Value


class Projection:
    """y = x @ W (+ b): W a constant [E, N] float32, b a constant [N] (or None)."""

    def __init__(self, out: ir.Value, matmul: ir.Node, weight: np.ndarray, bias: np.ndarray | None):
        self.out, self.matmul, self.weight, self.bias = out, matmul, weight, bias

    @staticmethod
    def match(value: ir.Value) -> Projection | str:
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
        return Projection(value, node, weight, bias)


@dataclass(frozen=True, eq=False)
class RotaryTable:
    """The export's rotary cos/sin evaluated on positions 0..positions-1 ([positions, D / 2] each); `index` numbers
    the tables of one compile (their initializers are fastcar.rotaryK.{cos,sin}_table, layers sharing a rotary share
    one)."""

    index: int
    cos: np.ndarray
    sin: np.ndarray

    @property
    def positions(self) -> int:
        return int(self.cos.shape[0])


@dataclass(frozen=True)
class Packing:
    """One QKV MatMul on the concatenated weights of `projections` (q, k, v), RoPE inside the op and the gate from the
    cos/sin `table`."""

    split: HeadSplit
    projections: tuple[Projection, Projection, Projection]
    head_dim: int
    table: RotaryTable


@dataclass(frozen=True)
class AttentionForm:
    """What one fused layer's attention is built as: `layout` = q/k/v [B, S, H*D] into the op (the head split
    dropped); `packing` = one QKV MatMul with RoPE in the op; `left` = why a leaner form was not taken."""

    layout: HeadSplit | None = None
    packing: Packing | None = None
    left: str = ""

    @property
    def packed_gate(self) -> bool:
        """Whether a rewritten layer's gate reads a [B, S, >= H*D] query (packed_qkv), not [B, H, S, D] heads."""
        return self.layout is not None or self.packing is not None


NONE = AttentionForm()  # a layer whose attention is not fused, or fused in the plain form


def head_split_source(value: ir.Value, heads: int) -> ir.Value | None:
    """x [B, S, heads*D] when value = Transpose(Reshape(x, [B, S, heads, D]), perm 0,2,1,3), else None."""
    t = value.producer()
    if t is None or t.op_type != "Transpose" or t.domain != "" or list(_attr(t, "perm", [])) != BSHD_PERM:
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


def rotary_form(node: ir.Node, heads: int) -> str | None:
    """Why the packed op and gate cannot rotate as RotaryEmbedding `node` does, or None (RotaryFusionPass's form)."""
    if _attr(node, "interleaved", 0) or _attr(node, "num_heads", 0) != heads or _attr(node, "rotary_embedding_dim", 0):
        return f"{node.name}: not RotaryFusionPass's form (half-split, num_heads {heads}, full rotary dim)"
    # the packed op and the gate rotate with the table alone: they have no scale and no packed batching
    if _attr(node, "scale", 1.0) != 1.0 or _attr(node, "is_packed_batching", 0):
        return (f"{node.name}: RotaryEmbedding with scale {_attr(node, 'scale', 1.0)} / is_packed_batching "
                f"{_attr(node, 'is_packed_batching', 0)}, which the packed rotary does not apply (needs 1 / 0)")
    return None


def rotary_table(model: ir.Model, values: tuple[ir.Value, ...], positions: int) -> tuple[np.ndarray, np.ndarray] | str:
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


def _head_split(p: Fusion) -> HeadSplit | str:
    """The layer's q/k rotaries and head splits, or why it has none."""
    rq, rk = p.q.producer(), p.k.producer()
    if any(r is None or r.op_type != "RotaryEmbedding" or r.domain != MS for r in (rq, rk)):
        return "q or k is not a com.microsoft.RotaryEmbedding output"
    xq, xk = head_split_source(rq.inputs[0], p.heads), head_split_source(rk.inputs[0], p.kv_heads)
    xv = head_split_source(p.v, p.kv_heads)
    if xq is None or xk is None or xv is None or len({rq.inputs[0], rk.inputs[0], p.v}) != 3:
        return "q/k/v are not the exporter's head split of [B, S, H*D] projections"
    return HeadSplit(rq, rk, xq, xk, xv)


def _only_read_by(value: ir.Value, allowed: set[ir.Node], live: set[ir.Node]) -> bool:
    """Whether, on the graph as emitted (`live`: its nodes), `value` is no graph output and only `allowed` read it."""
    return not value.is_graph_output() and all(n in allowed for n in value.consumers() if n in live)


def _projections(split: HeadSplit, heads: int, kv_heads: int) -> tuple[tuple[Projection, ...], int] | str:
    """q, k, v = x @ W (+ b) of one x, widths heads x D / kv_heads x D (D even): the projections and D, or why not."""
    projs = [Projection.match(v) for v in (split.xq, split.xk, split.xv)]
    for p in projs:
        if isinstance(p, str):
            return p
    pq, pk, pv = projs
    if len({p.matmul.inputs[0] for p in projs}) != 1 or len({p.matmul for p in projs}) != 3:
        return "q, k and v are not projections of one input"
    if len({p.bias is None for p in projs}) != 1 or len({p.weight.shape[0] for p in projs}) != 1:
        return "q, k and v projections differ in form (bias on some only, or input widths)"
    D = pq.weight.shape[1] // max(heads, 1)
    if pq.weight.shape[1] != heads * D or pk.weight.shape[1] != kv_heads * D or pv.weight.shape[1] != kv_heads * D \
            or D % 2:
        return "the projection widths are not num_heads/kv_num_heads x an even head size"
    return tuple(projs), D


def decide(model: ir.Model, fused: dict[int, Fusion], opts, compressed: set[int], rewritten: set[int],
           notes: list[str]) -> dict[int, AttentionForm]:
    """Each fused layer's form (`fused`: layer -> what fused_attention.fusable found; `compressed`: layers with a
    compressed KV cache, whose kernel reads [B, H, S, D] q/k/v; `rewritten`: layers that get a gate). Checked on the
    export as the emission will change it; the notes say why a layer is left in a plainer form. A fused layer absent
    from the result is built in the plain form (NONE)."""
    forms: dict[int, AttentionForm] = {}
    fastcar = opts.fused_attention == "fastcar"
    if not fused or not opts.fusions or (not fastcar and not opts.pack_qkv):
        return forms
    graph = model.graph
    mask = [v for v in graph.inputs if v.name == "attention_mask"]
    replaced = {v for p in fused.values() for v in (p.out, p.present_k, p.present_v)}
    # the graph once every fused op is built reading the exporter's [B, H, S, D] q/k/v
    plain = gu.live_nodes(graph, replaced, [v for p in fused.values() for v in (p.q, p.k, p.v, p.past_k, p.past_v)]
                          + mask)
    splits: dict[int, HeadSplit] = {}
    left: dict[int, str] = {}
    for n, p in sorted(fused.items()):
        found = _head_split(p) if not (fastcar and n in compressed) else \
            "a compressed KV cache (budget, TempCache, diagnostics): its kernel reads separate q/k/v"
        if isinstance(found, str):
            left[n] = found
        elif not (_only_read_by(p.q, set(), plain) and _only_read_by(found.rq.inputs[0], {found.rq}, plain) and
                  _only_read_by(p.k, set(), plain) and _only_read_by(found.rk.inputs[0], {found.rk}, plain) and
                  _only_read_by(p.v, set(), plain)):
            left[n] = "q, k or v has readers besides the attention and its rotary"
        else:
            splits[n] = found
    # the graph with those layers' q/k/v taken [B, S, H*D] (their rotaries then read the projections)
    laid_out = gu.live_nodes(graph, replaced | {s.rq.outputs[0] for s in splits.values()} |
                             {s.rk.outputs[0] for s in splits.values()},
                             [v for n, s in splits.items() for v in (s.xq, s.xk, s.xv, *s.rq.inputs[1:],
                                                                     *s.rk.inputs[1:], fused[n].past_k,
                                                                     fused[n].past_v)] + mask)
    tables: dict[tuple[ir.Value, ...], RotaryTable | str] = {}
    for n, split in splits.items():
        found = _packable(split, fused[n], opts, n in rewritten, laid_out)
        why, packing = found if isinstance(found, str) else None, None
        if why is None:
            projs, head_dim = found
            table = _table(model, tuple(split.rq.inputs[2:4]), opts.rotary_positions, tables)
            why = table if isinstance(table, str) else None
            if why is None:
                packing = Packing(split, projs, head_dim, table)
        if packing is not None or fastcar:
            forms[n] = AttentionForm(split if fastcar else None, packing, why or "")
        if why is not None and opts.pack_qkv:
            left[n] = why
    for n, why in left.items():
        forms.setdefault(n, AttentionForm(left=why))
    kept = [f"layer {n}: {why}" for n, why in sorted(left.items()) if opts.pack_qkv]
    if kept:
        notes.append("packed QKV: left " + "; ".join(kept))
    return forms


def _table(model: ir.Model, caches: tuple[ir.Value, ...], positions: int,
           tables: dict[tuple[ir.Value, ...], RotaryTable | str]) -> RotaryTable | str:
    """The table of the rotary with these cos/sin caches (evaluated once per caches, numbered in order), or why
    there is none."""
    if caches not in tables:
        found = rotary_table(model, caches, positions)
        index = sum(isinstance(t, RotaryTable) for t in tables.values())
        tables[caches] = found if isinstance(found, str) else RotaryTable(index, *found)
    return tables[caches]


def _packable(split: HeadSplit, p: Fusion, opts, rewritten: bool,
              live: set[ir.Node]) -> tuple[tuple[Projection, ...], int] | str:
    """The q/k/v projections and head size of a layer with q/k/v [B, S, H*D] that can get the packed form, or why
    it cannot."""
    if not opts.pack_qkv:
        return "--pack-qkv off"
    for r, heads in ((split.rq, p.heads), (split.rk, p.kv_heads)):
        why = rotary_form(r, heads)
        if why is not None:
            return why
    if split.rq.inputs[1:] != split.rk.inputs[1:]:
        return "q and k are rotated with different caches"
    found = _projections(split, p.heads, p.kv_heads)
    if isinstance(found, str):
        return found
    if not all(_only_read_by(x, set(), live) for x in (split.xq, split.xk, split.xv)):
        return "q, k or v has readers besides the attention, its rotary and the one-node gate"
    if rewritten and opts.tas_query != contract.TAS_ROPE:
        return ("TAS `raw` dots the unrotated query with keys rotated at their absolute positions, which moving the "
                "rotation to KV indices would shift under left padding")
    return found
