"""Rotary fusion: the exporters' rotate-half RoPE -> one `com.microsoft.RotaryEmbedding` per query/key.

transformers' `q * cos + rotate_half(q) * sin` exports as Slice, Slice, Neg, Concat, Mul, Mul, Add (ORT turns
the two Slices into a Split): six or seven kernel launches for q and again for k in every layer, where
genai's graph rotates inside GroupQueryAttention.

The caches are the graph's own cos/sin, not a table rebuilt from the rotary constants: the export computes
cos = Cos(Concat(f, f)) [B, S, D] once per step from position_ids; its first half, viewed as [B * S, D / 2],
is a cache whose row b * S + s holds exactly the angle of token (b, s), and position_ids = that row index.
So every position the original accepts works (no max-length table, nothing to choose), left padding keeps
its per-row positions, and the values are the export's bit for bit. Only the equal-halves form is claimed:
the cos/sin fed to the Muls must come from Cos/Sin of Concat(f, f) (through Unsqueeze, Cast or a constant
scale); a rotary whose halves could differ stays as exported.

Runs before discovery, which then finds the query behind a RotaryEmbedding op (the gate's `rope` query is the
op's output, `raw` its input: the values the Add and x were). onnxscript's `ort_fusions.rotary_embedding` +
`cos_sin_cache` rules match the same Mul/Add shape but build the cache from inv_freq up to a max position
(a table every step when position_ids are dynamic, as they are in a decoder), hence this matcher.
"""

from __future__ import annotations

import itertools

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from fastcar_compile.core import contract
from fastcar_compile.passes import build
from fastcar_compile.passes import graph_utils as gu
from fastcar_compile.passes.context import CompileContext

MS = contract.MS_DOMAIN


def _half(node: ir.Node | None, x: ir.Value, dim: int) -> str | None:
    """'lo' / 'hi' when `node` slices x[..., :dim/2] / x[..., dim/2:] on the last axis (4-D x), else None."""
    if node is None or node.op_type != "Slice" or node.inputs[0] is not x or len(node.inputs) < 4:
        return None
    starts, ends, axes = (gu.const_ints(node.inputs[i]) for i in (1, 2, 3))
    steps = gu.const_ints(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] is not None else [1]
    if starts is None or ends is None or axes not in ([3], [-1]) or steps != [1]:
        return None
    half = dim // 2
    if starts == [0] and ends == [half]:
        return "lo"
    if starts == [half] and ends[0] >= dim:
        return "hi"
    return None


def _rotated(value: ir.Value, x: ir.Value, dim: int) -> bool:
    """value = Concat(-x[..., D/2:], x[..., :D/2]) on the last axis."""
    node = value.producer()
    if node is None or node.op_type != "Concat" or len(node.inputs) != 2 or \
            node.attributes.get_int("axis", 0) not in (-1, 3):
        return False
    neg, lo = (i.producer() for i in node.inputs)
    return neg is not None and neg.op_type == "Neg" and _half(neg.inputs[0].producer(), x, dim) == "hi" and \
        _half(lo, x, dim) == "lo"


def _same_dim(a, b) -> bool:
    """Two dims known to be equal: equal ints, or symbolic dims of the same name (unknown never matches)."""
    if isinstance(a, int) or isinstance(b, int):
        return a == b
    return a is not None and b is not None and a.value is not None and a.value == b.value


def _per_row(table: ir.Value, x_shape) -> bool:
    """The cos/sin table is [B, S, D] with x's batch and sequence: the caches are built per (row, token), so a
    table broadcast over the batch ([1, S, D]) would give every row after the first the wrong positions."""
    shape = table.shape
    return shape is not None and len(shape) == 3 and _same_dim(shape[0], x_shape[0]) and \
        _same_dim(shape[1], x_shape[2]) and _same_dim(shape[2], x_shape[3])


def _equal_halves_source(value: ir.Value, trig: str) -> ir.Value | None:
    """The [B, S, D] cos (sin) tensor under Unsqueeze(1) when it is trig(Concat(f, f)) (through Cast or a
    constant scale), else None."""
    node = value.producer()
    if node is None or node.op_type != "Unsqueeze" or gu.const_ints(node.inputs[1]) != [1]:
        return None
    table, walk = node.inputs[0], node.inputs[0]
    for _ in range(4):
        p = walk.producer()
        if p is None:
            return None
        if p.op_type == trig:
            cat = p.inputs[0].producer()
            ok = cat is not None and cat.op_type == "Concat" and len(cat.inputs) == 2 and \
                cat.inputs[0] is cat.inputs[1] and cat.attributes.get_int("axis", 0) in (-1, 2)
            return table if ok else None
        if p.op_type == "Cast" or (p.op_type == "Mul" and any(gu.scalar_const(i) is not None for i in p.inputs)):
            walk = next(i for i in p.inputs if gu.scalar_const(i) is None)
            continue
        return None
    return None


def match_rotate_half(add: ir.Node) -> tuple[ir.Value, ir.Value, ir.Value] | None:
    """(x [B, H, S, D], cos [B, S, D], sin [B, S, D]) when add = x * cos + rotate_half(x) * sin."""
    if add.op_type != "Add" or add.domain != "" or len(add.inputs) != 2:
        return None
    muls = [i.producer() for i in add.inputs]
    if not all(m is not None and m.op_type == "Mul" and len(m.inputs) == 2 for m in muls):
        return None
    for m_cos, m_sin in ((muls[0], muls[1]), (muls[1], muls[0])):
        for x, cos4 in (m_cos.inputs, reversed(m_cos.inputs)):
            shape = x.shape
            if shape is None or len(shape) != 4 or not isinstance(shape[1], int) or not isinstance(shape[3], int) \
                    or shape[3] % 2 or x.dtype != ir.DataType.FLOAT:
                continue
            for rot, sin4 in (m_sin.inputs, reversed(m_sin.inputs)):
                if not _rotated(rot, x, shape[3]):
                    continue
                cos, sin = _equal_halves_source(cos4, "Cos"), _equal_halves_source(sin4, "Sin")
                if cos is not None and sin is not None and all(_per_row(t, shape) for t in (cos, sin)):
                    return x, cos, sin
    return None


class RotaryFusionPass(ir.passes.InPlacePass):
    """x * cos + rotate_half(x) * sin -> com.microsoft.RotaryEmbedding with the graph's own cos/sin as caches."""

    def __init__(self, ctx: CompileContext):
        super().__init__()
        self.ctx = ctx

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        matches = [(node, found) for node in graph if not node.outputs[0].is_graph_output()
                   and (found := match_rotate_half(node)) is not None]
        if not matches:
            return ir.passes.PassResult(model, modified=False)
        caches: dict[tuple[ir.Value, ir.Value], tuple[ir.Value, ir.Value, ir.Value]] = {}
        ids = itertools.count()
        for add, (x, cos, sin) in matches:
            if (cos, sin) not in caches:
                caches[(cos, sin)] = self._caches(graph, cos, sin, x.shape[3], ids)
            pos, cos_cache, sin_cache = caches[(cos, sin)]
            node = ir.node("RotaryEmbedding", [x, pos, cos_cache, sin_cache],
                           {"interleaved": 0, "num_heads": int(x.shape[1])}, domain=MS,
                           name=f"{add.name or 'rotary'}/fused_rotary")
            graph.insert_before(add, node)
            gu.take_over(add.outputs[0], node.outputs[0])
        model.opset_imports.setdefault(MS, 1)
        RemoveUnusedNodesPass()(model)
        self.ctx.notes.append(f"fused {len(matches)} rotate-half RoPEs into RotaryEmbedding")
        return ir.passes.PassResult(model, modified=True)

    @staticmethod
    def _caches(graph: ir.Graph, cos: ir.Value, sin: ir.Value, dim: int, ids) -> tuple[ir.Value, ...]:
        """position_ids = arange(B * S) as [B, S]; caches = the first halves of cos/sin as [B * S, D / 2]."""
        nodes: list[ir.Node] = []
        b = build.Builder(0, nodes, ids, graph=graph, namespace="rotary")
        k = f"fastcar.rope{next(ids)}"
        c = lambda name, arr: build.const(graph, f"{k}.{name}", np.array(arr, np.int64))  # noqa: E731
        halves = []
        for table in (cos, sin):
            first = b("Slice", [table, c("zero", [0]), c("half", [dim // 2]), c("last", [-1])], part="rotary")
            halves.append(b("Reshape", [first, c("rows", [-1, dim // 2])], part="rotary"))
        bs = b("Shape", [cos], {"start": 0, "end": 2}, part="rotary")
        count = b("Div", [b("Size", [cos], part="rotary"), c("dim", dim)], part="rotary")  # B * S
        rows = b("Range", [c("start", 0), count, c("step", 1)], part="rotary")
        pos = b("Reshape", [rows, bs], part="rotary")
        for node in nodes:  # shared by every layer whose RoPE reads these tables
            node.metadata_props.clear()
        later = max((v.producer() for v in (cos, sin)), key=lambda n: list(graph).index(n))
        graph.insert_after(later, nodes)
        return pos, halves[0], halves[1]
