"""Find the blocks of a chunk-causal video DiT step graph from dataflow alone (what `--inspect` explains).

Per block N, anchors searched in order (a failure names the anchor, what was expected and where the search
stopped, as the decoder's discovery does, passes/discover.py):
1. `kv`: graph inputs `past.N.key|value`, `cross.N.key|value` and outputs `present.N.key|value`.
2. `self-attention`: `Concat(past.N.key, present.N.key)` on the key axis, read through layout ops and
   scalar scale factors by a MatMul -> Softmax -> MatMul with `Concat(past.N.value, present.N.value)`.
3. `rotary`: the key (and the query) rotated by cos/sin tables (Cos/Sin of angles); the angles a Concat of
   3 parts = 3D RoPE over (frame, h, w).
4. `q/k norm`: an RMSNorm (x * rsqrt(mean(x^2) + eps) * w, or a fused norm op) between the projection and
   the rotary, on both the query and the key.
5. `cross-attention`: `cross.N.key` read by a MatMul -> Softmax -> MatMul with `cross.N.value`.
6. `ffn`: MatMul -> GELU -> MatMul after the cross-attention.
7. `modulation`: AdaLN: the self-attention's input is a LayerNorm scaled and shifted by values computed from
   the `timestep` input.
Weight names and module paths are never used. The discovery of decoder layers is passes/discover.py; this is
the DiT target's (DiTDiscoverPass): the emission passes (dit_cache, dit_replay, dit_annca) build on the nodes it
found, never matching the graph again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx_ir as ir

from fastcar_compile.passes import graph_utils as gu
from fastcar_compile.passes.context import DiTContext
from fastcar_compile.passes.match_base import MatchFailure

GELU_OPS = frozenset({"Gelu", "FastGelu", "BiasGelu"})
_SCALE_OPS = frozenset({"Mul", "Div"})


@dataclass
class SelfAttention:
    key_concat: ir.Node  # Concat(past.N.key, present.N.key)
    value_concat: ir.Node
    scores: ir.Node  # MatMul(query, keys^T)
    softmax: ir.Node
    context: ir.Node  # MatMul(probs, values)
    query: ir.Value  # the scores' left operand (scaled, rotated query [B, H, S, d])
    key_factors: list[ir.Value]  # scalar factors applied to the keys between the concat and the scores
    heads: int
    head_dim: int


@dataclass(frozen=True)
class CrossAttention:
    """The block's attention to the prompt's K/V `cross.N.key|value` (what AnnCA replaces)."""

    key: ir.Value
    value: ir.Value
    scores: ir.Node  # MatMul(query, keys^T): its left operand is the scaled query
    context: ir.Node  # MatMul(probs, values)
    key_factors: list[ir.Value]  # scalar factors applied to the keys before the scores


@dataclass
class DiTBlockMatch:
    layer: int
    attention: SelfAttention | None = None
    rope: str = ""
    qk_norm: str = ""
    cross: str = ""
    cross_attention: CrossAttention | None = None
    ffn: str = ""
    ffn_io: tuple[ir.Node, ir.Value] | None = None  # (the FFN's first MatMul, its output after the bias)
    key_pre: ir.Value | None = None  # the key before the rotary [B, S, heads * d] (TempCache compares those)
    modulation: str = ""
    failure: MatchFailure | None = None
    trace: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.failure is None and self.attention is not None

    def summary(self) -> str:
        if self.failure is not None:
            where = f" (search stopped at {self.failure.where})" if self.failure.where else ""
            return f"missing anchor '{self.failure.anchor}': {self.failure.reason}{where}"
        a = self.attention
        return (f"self-attention over the cache {a.heads}x{a.head_dim} ({self.qk_norm}, {self.rope}); "
                f"{self.cross}; {self.ffn}; {self.modulation}")


def _names(graph: ir.Graph) -> tuple[dict[str, ir.Value], dict[str, ir.Value]]:
    return {v.name: v for v in graph.inputs}, {v.name: v for v in graph.outputs}


def block_layers(graph: ir.Graph) -> list[int]:
    """The block indices the graph's `past.N.key` inputs name, in order."""
    out = []
    for v in graph.inputs:
        parts = (v.name or "").split(".")
        if len(parts) == 3 and parts[0] == "past" and parts[2] == "key" and parts[1].isdigit():
            out.append(int(parts[1]))
    return sorted(out)


def discover(model: ir.Model) -> list[DiTBlockMatch]:
    """One DiTBlockMatch per `past.N.key` input, matched or with the reason it was not."""
    ins, outs = _names(model.graph)
    timestep = ins.get("timestep")
    matches = []
    for layer in block_layers(model.graph):
        m = DiTBlockMatch(layer)
        try:
            _match_block(m, ins, outs, timestep)
        except MatchFailure as exc:
            m.failure = exc
        matches.append(m)
    return matches


def _match_block(m: DiTBlockMatch, ins: dict[str, ir.Value], outs: dict[str, ir.Value],
                 timestep: ir.Value | None) -> None:
    i = m.layer
    need = {f"past.{i}.key": ins, f"past.{i}.value": ins, f"cross.{i}.key": ins, f"cross.{i}.value": ins,
            f"present.{i}.key": outs, f"present.{i}.value": outs}
    missing = [n for n, where in need.items() if n not in where]
    if missing:
        raise MatchFailure("kv", f"{missing[0]} is not a graph {'input' if need[missing[0]] is ins else 'output'}",
                           "graph I/O")
    attn = self_attention(ins[f"past.{i}.key"], ins[f"past.{i}.value"], outs[f"present.{i}.key"],
                          outs[f"present.{i}.value"])
    m.trace.append(f"self-attention: {gu.describe(attn.key_concat)} -> {gu.describe(attn.scores)} -> "
                   f"{gu.describe(attn.softmax)} -> {gu.describe(attn.context)} with {gu.describe(attn.value_concat)}")
    m.trace.append(f"query {attn.query.name}: heads {attn.heads}, head dim {attn.head_dim}; key scale factors "
                   f"{[f.name for f in attn.key_factors]}")
    k_rot, k_rope = rotary(outs[f"present.{i}.key"], "key")
    q_rot, q_rope = rotary(attn.query, "query")
    if q_rope != k_rope:
        raise MatchFailure("rotary", f"the query is rotated by {q_rope}, the key by {k_rope}", attn.query.name)
    m.rope = k_rope
    m.trace.append(f"rotary: {k_rope} on the query and the key")
    q_in, k_in = rms_norm(q_rot, "query"), rms_norm(k_rot, "key")
    m.key_pre = k_rot
    m.qk_norm = "q/k RMSNorm"
    m.trace.append(f"q/k norm: RMSNorm of {q_in.name} and of {k_in.name}")
    m.cross_attention, m.cross, where = cross_attention(ins[f"cross.{i}.key"], ins[f"cross.{i}.value"])
    m.trace.append(f"{m.cross}: {where}")
    m.ffn, m.ffn_io = ffn(m.cross_attention.context.outputs[0])
    m.trace.append(m.ffn)
    m.modulation = modulation(projection(q_in, "query"), timestep)
    m.trace.append(m.modulation)
    m.attention = attn


def _forward_to_matmul(value: ir.Value, what: str) -> tuple[ir.Node, list[ir.Value], int]:
    """From `value` forward through layout ops and scalar scale factors to the MatMul that reads it:
    (matmul, factors, operand index)."""
    factors: list[ir.Value] = []
    for _ in range(16):
        users = _data_users(value)
        if len(users) != 1:
            raise MatchFailure("self-attention", f"{what} (at {value.name}) has {len(users)} consumers ({', '.join(n.op_type for n in users)}); "
                               "expected one path to the attention MatMul", value.name)
        node = users[0]
        if node.op_type == "MatMul":
            return node, factors, list(node.inputs).index(value)
        if node.op_type in _SCALE_OPS and node.inputs[0] is value and is_scalar(node.inputs[1]):
            factors.append(node.inputs[1])
        elif node.op_type not in gu.LAYOUT_OPS or node.inputs[0] is not value:
            raise MatchFailure("self-attention", f"{what} goes through {gu.describe(node)}, not layout ops and a "
                               "scale into a MatMul", gu.describe(node))
        value = node.outputs[0]
    raise MatchFailure("self-attention", f"{what}: no MatMul within 16 ops", value.name)


def _data_users(value: ir.Value) -> list[ir.Node]:
    """Consumers that read the values (not a Shape, not CastLike's dtype operand)."""
    return [n for n in gu.real_consumers(value) if not (n.op_type == "CastLike" and n.inputs[0] is not value)]


def is_scalar(value: ir.Value | None) -> bool:
    """A value with one element (a scale factor), by shape or as a constant."""
    if value is None:
        return False
    if gu.scalar_const(value) is not None:
        return True
    dims = gu.static_dims(value)
    if dims is not None and all(d == 1 for d in dims):
        return True
    return _from_shapes(value)


def _const_ints(value: ir.Value | None) -> list[int] | None:
    """gu.const_ints, plus a Constant node's value_int / value_ints (TorchScript and dynamo write both)."""
    got = gu.const_ints(value)
    p = value.producer() if value is not None else None
    if got is None and p is not None and p.op_type == "Constant":
        for name in ("value_int", "value_ints"):
            if name in p.attributes:
                v = p.attributes[name].value
                got = [int(x) for x in (v if isinstance(v, (list, tuple)) else [v])]
    return got


def _from_shapes(value: ir.Value, limit: int = 32) -> bool:
    """Computed from constants and tensor shapes only (SDPA's 1/sqrt(head_dim) from the query's shape), and
    reduced to one element (a Gather of one dim)."""
    stack, seen, one = [value], set(), False
    while stack:
        v = stack.pop()
        node = v.producer()
        if node is None:
            if v.const_value is None:
                return False
            continue
        if node in seen:
            continue
        seen.add(node)
        if len(seen) > limit:
            return False
        if node.op_type == "Shape":
            continue
        if node.op_type == "Gather":
            one = one or len(_const_ints(node.inputs[1]) or [0, 0]) == 1
        if node.op_type == "CastLike":
            stack.append(node.inputs[0])
            continue
        stack.extend(i for i in node.inputs if i is not None)
    return one


def attention_chain(key_in: ir.Value, value_in: ir.Value, anchor: str) -> tuple[ir.Node, ir.Node, ir.Node, list]:
    """keys -> MatMul (as its right operand) -> Softmax -> MatMul(probs, values): the three nodes and the
    keys' scale factors."""
    try:
        scores, factors, idx = _forward_to_matmul(key_in, f"the keys {key_in.name}")
    except MatchFailure as exc:
        raise MatchFailure(anchor, exc.reason, exc.where) from None
    if idx != 1:
        raise MatchFailure(anchor, f"the keys are the left operand of {gu.describe(scores)}", gu.describe(scores))
    users = _data_users(scores.outputs[0])
    if len(users) != 1 or users[0].op_type != "Softmax":
        raise MatchFailure(anchor, f"the scores of {gu.describe(scores)} go to "
                           f"{', '.join(gu.describe(n) for n in users) or 'nothing'}, not one Softmax",
                           gu.describe(scores))
    softmax = users[0]
    users = _data_users(softmax.outputs[0])
    if len(users) != 1 or users[0].op_type != "MatMul" or users[0].inputs[0] is not softmax.outputs[0]:
        raise MatchFailure(anchor, f"the probabilities of {gu.describe(softmax)} are not the left operand of one "
                           "MatMul", gu.describe(softmax))
    context = users[0]
    if not gu.depends_on(context.inputs[1], value_in, limit=16):
        raise MatchFailure(anchor, f"{gu.describe(context)} does not read the values {value_in.name}",
                           gu.describe(context))
    return scores, softmax, context, factors


def self_attention(pkey: ir.Value, pvalue: ir.Value, key: ir.Value, value: ir.Value) -> SelfAttention:
    """The block's attention over [cache; chunk]: the key/value concats and the scores/softmax/context nodes."""
    concats = {}
    for past, new, kind in ((pkey, key, "key"), (pvalue, value, "value")):
        users = gu.real_consumers(past)
        cat = next((n for n in users if n.op_type == "Concat" and list(n.inputs) == [past, new]), None)
        if cat is None:
            raise MatchFailure("self-attention", f"{past.name} is not concatenated with {new.name} "
                               f"(its consumers: {', '.join(gu.describe(n) for n in users) or 'none'}); the "
                               "chunk must attend to the cache and to itself", past.name)
        axis = cat.attributes["axis"].value if "axis" in cat.attributes else None
        if axis not in (2, -2):
            raise MatchFailure("self-attention", f"{gu.describe(cat)} joins on axis {axis}, not the token axis "
                               "of [B, heads, tokens, d]", gu.describe(cat))
        concats[kind] = cat
    scores, softmax, context, factors = attention_chain(concats["key"].outputs[0], concats["value"].outputs[0],
                                                         "self-attention")
    if context.inputs[1] is not concats["value"].outputs[0]:
        raise MatchFailure("self-attention", f"{gu.describe(context)} reads the values through "
                           f"{gu.describe(context.inputs[1].producer())}, not the cache concat itself",
                           gu.describe(context))
    dims = gu.static_dims(pkey)
    if dims is None or len(dims) != 4 or dims[1] is None or dims[3] is None:
        raise MatchFailure("kv", f"{pkey.name} must be [batch, heads, tokens, head_dim] with static heads and "
                           f"head_dim, got {pkey.shape}", pkey.name)
    return SelfAttention(concats["key"], concats["value"], scores, softmax, context, scores.inputs[0], factors,
                         int(dims[1]), int(dims[3]))


def _back_through_layout(value: ir.Value, scales: bool = True) -> ir.Value:
    for _ in range(16):
        node = value.producer()
        if node is None:
            break
        if node.op_type in gu.LAYOUT_OPS or (scales and node.op_type in _SCALE_OPS and is_scalar(node.inputs[1])):
            value = node.inputs[0]
        else:
            break
    return value


def _table(value: ir.Value) -> ir.Node | None:
    """The Cos/Sin node `value` is (behind layout ops), else None."""
    p = _back_through_layout(value, scales=False).producer()
    return p if p is not None and p.op_type in ("Cos", "Sin") else None


def rotary(value: ir.Value, what: str) -> tuple[ir.Value, str]:
    """The value rotated into `value` (before the rotary) and the rotary's description: x0 cos - x1 sin,
    x0 sin + x1 cos of adjacent pairs stacked back (Wan's real form of its complex rotation); the angles'
    parts (3: frame, h, w)."""
    out = _back_through_layout(value)
    node = out.producer()
    if node is None or node.op_type != "Concat":
        raise MatchFailure("rotary", f"the {what} {value.name} comes from {gu.describe(node)}, not the stacked "
                           "pairs of a rotary (x0 cos - x1 sin, x0 sin + x1 cos)", gu.describe(node))
    halves = [_back_through_layout(v, scales=False).producer() for v in node.inputs]
    if len(halves) != 2 or [h.op_type if h else None for h in halves] != ["Sub", "Add"]:
        raise MatchFailure("rotary", f"the {what}'s {gu.describe(node)} does not stack a Sub and an Add "
                           "(x0 cos - x1 sin, x0 sin + x1 cos)", gu.describe(node))
    tables: list[ir.Node] = []
    raws: set[ir.Value] = set()
    for half in halves:
        for mul in (v.producer() for v in half.inputs):
            if mul is None or mul.op_type != "Mul":
                raise MatchFailure("rotary", f"{gu.describe(half)} does not subtract/add products with cos/sin",
                                   gu.describe(half))
            found = [t for t in map(_table, mul.inputs) if t is not None]
            if len(found) != 1:
                raise MatchFailure("rotary", f"{gu.describe(mul)} multiplies by {len(found)} Cos/Sin tables, not "
                                   "one", gu.describe(mul))
            tables += found
            x = next(v for v in mul.inputs if _table(v) is None)
            pick = _back_through_layout(x, scales=False).producer()  # x0 / x1: one element of each pair
            raws.add(_back_through_layout(pick.inputs[0], scales=False) if pick is not None
                     and pick.op_type in ("Gather", "Slice", "Split") else x)
    kinds = {t.op_type for t in tables}
    if kinds != {"Cos", "Sin"}:
        raise MatchFailure("rotary", f"the {what}'s rotary reads {sorted(kinds)} tables, not Cos and Sin of the "
                           "angles", gu.describe(node))
    if len(raws) != 1:
        raise MatchFailure("rotary", f"the {what}'s rotary pairs come from {len(raws)} tensors, not one",
                           gu.describe(node))
    parts = set()
    for t in tables:
        p = _back_through_layout(t.inputs[0], scales=False).producer()
        parts.add(len(p.inputs) if p is not None and p.op_type == "Concat" else 1)
    n = max(parts)
    desc = {3: "3D RoPE over frame/h/w", 1: "1D RoPE"}.get(n, f"RoPE over {n} axes")
    return raws.pop(), desc


def rms_norm(value: ir.Value, what: str) -> ir.Value:
    """The input x of the RMSNorm whose output is `value` (after layout ops): x * rsqrt(mean(x^2) + eps) [* w]
    as exported, or a fused RMSNormalization / SimplifiedLayerNormalization."""
    v = _back_through_layout(value, scales=False)
    node = v.producer()
    if node is not None and node.op_type in ("RMSNormalization", "SimplifiedLayerNormalization"):
        return node.inputs[0]
    for _ in range(2):  # the weight's Mul, then x * rsqrt(...)
        if node is None or node.op_type != "Mul":
            break
        for x, other in (node.inputs, reversed(node.inputs)):
            p = other.producer() if other is not None else None
            if p is not None and p.op_type == "Reciprocal":
                p = p.inputs[0].producer()
            if p is not None and p.op_type == "Sqrt":
                p = p.inputs[0].producer()
            if p is not None and p.op_type == "Add":
                p = next((i.producer() for i in p.inputs if i is not None and i.producer() is not None
                          and i.producer().op_type == "ReduceMean"), None)
            if p is not None and p.op_type == "ReduceMean":
                sq = p.inputs[0].producer()
                if sq is not None and sq.inputs[0] is x and (
                        sq.op_type == "Pow" and gu.scalar_const(sq.inputs[1]) == 2.0
                        or sq.op_type == "Mul" and sq.inputs[1] is x):
                    return x
        node = next((i.producer() for i in node.inputs if i is not None and i.producer() is not None
                     and i.producer().op_type == "Mul"), None)
    raise MatchFailure("q/k norm", f"the {what} before the rotary ({v.name}) is not RMSNorm'ed (x * rsqrt(mean(x^2) "
                       "+ eps) * w, RMSNormalization or SimplifiedLayerNormalization)", gu.describe(v.producer()))


def cross_attention(ckey: ir.Value, cvalue: ir.Value) -> tuple[CrossAttention, str, str]:
    """The attention to the prompt's K/V: its nodes, a description and where they are."""
    scores, softmax, context, factors = attention_chain(ckey, cvalue, "cross-attention")
    dims = gu.static_dims(ckey) or [None] * 4
    return (CrossAttention(ckey, cvalue, scores, context, factors), f"cross-attention to the prompt ({dims[1]} heads)",
            f"{gu.describe(scores)} -> {gu.describe(softmax)} -> {gu.describe(context)}")


def _linear_dims(matmul: ir.Node) -> tuple[int, int] | None:
    shape = gu.weight_shape(matmul.inputs[1])
    if shape is None or len(shape) != 2:
        return None
    t = matmul.inputs[1].producer()
    flipped = t is not None and t.op_type == "Transpose"
    return (shape[1], shape[0]) if flipped else (shape[0], shape[1])


def ffn(after: ir.Value, limit: int = 80) -> tuple[str, tuple[ir.Node, ir.Value]]:
    """MatMul -> GELU -> MatMul downstream of the cross-attention (breadth-first, `limit` nodes): its
    description, and (the first MatMul, the output after the second's bias) for FastCar's row replay."""
    seen: set[ir.Node] = set()
    queue = list(after.consumers())
    while queue and len(seen) < limit:
        node = queue.pop(0)
        if node in seen:
            continue
        seen.add(node)
        if node.op_type in GELU_OPS:
            up = _back_through_layout(node.inputs[0], scales=False).producer()
            if up is not None and up.op_type == "Add":
                up = next((i.producer() for i in up.inputs if i is not None and i.producer() is not None
                           and i.producer().op_type == "MatMul"), up)
            down = [n for n in gu.real_consumers(node.outputs[0]) if n.op_type == "MatMul"]
            if up is None or up.op_type != "MatMul" or not down:
                raise MatchFailure("ffn", f"{gu.describe(node)} is not between two MatMuls", gu.describe(node))
            d1, d2 = _linear_dims(up), _linear_dims(down[0])
            approx = node.attributes["approximate"].value if "approximate" in node.attributes else "none"
            sizes = f"{d1[0]} -> {d1[1]} -> {d2[1]}" if d1 and d2 else "?"
            out = down[0].outputs[0]
            bias = [n for n in gu.real_consumers(out) if n.op_type == "Add" and any(gu.is_static(i) for i in n.inputs)]
            return f"FFN {sizes} (GELU {approx})", (up, bias[0].outputs[0] if len(bias) == 1 else out)
        for out in node.outputs:
            queue.extend(out.consumers())
    raise MatchFailure("ffn", f"no MatMul -> GELU -> MatMul within {limit} ops after the cross-attention",
                       after.name)


def projection(x: ir.Value, what: str) -> ir.Node:
    """The MatMul (+ bias Add) that produced `x`."""
    node = _back_through_layout(x, scales=False).producer()
    if node is not None and node.op_type == "Add" and any(gu.is_static(i) for i in node.inputs):
        node = next((i.producer() for i in node.inputs if not gu.is_static(i)), None)
    if node is None or node.op_type not in gu.MATMUL_OPS:
        raise MatchFailure("modulation", f"the {what} {x.name} comes from {gu.describe(node)}, not a projection "
                           "MatMul", gu.describe(node))
    return node


def modulation(proj: ir.Node, timestep: ir.Value | None) -> str:
    """AdaLN: the q projection reads LayerNorm(x) * (1 + scale) + shift with scale/shift from the timestep."""
    if timestep is None:
        raise MatchFailure("modulation", "the graph has no timestep input", "graph inputs")
    x = _back_through_layout(proj.inputs[0], scales=False)
    shift = x.producer()
    if shift is None or shift.op_type != "Add":
        raise MatchFailure("modulation", f"the self-attention's input {x.name} is {gu.describe(shift)}, not "
                           "norm(x) * (1 + scale) + shift", gu.describe(shift))
    scaled = next((i for i in shift.inputs if i is not None and i.producer() is not None
                   and i.producer().op_type == "Mul"), None)
    if scaled is None:
        raise MatchFailure("modulation", f"{gu.describe(shift)} adds no scaled norm", gu.describe(shift))
    mul = scaled.producer()
    normed = [_back_through_layout(i, scales=False).producer() for i in mul.inputs]
    norm = next((n for n in normed if n is not None and n.op_type in gu.NORM_OPS), None)
    if norm is None:
        raise MatchFailure("modulation", f"{gu.describe(mul)} scales no LayerNorm output", gu.describe(mul))
    timed = [i for i in (*mul.inputs, *shift.inputs) if i is not None and i is not scaled
             and gu.depends_on(i, timestep, limit=400)]
    if len(timed) < 2:
        raise MatchFailure("modulation", f"the scale/shift around {gu.describe(norm)} do not come from the timestep "
                           "input (not AdaLN)", gu.describe(mul))
    return f"AdaLN ({norm.op_type} scaled and shifted by the timestep)"


class DiTDiscoverPass(ir.passes.InPlacePass):
    """Find every DiT block (self-attention over the cache, rotary, q/k norm, cross-attention, FFN, AdaLN)."""

    def __init__(self, ctx: DiTContext):
        super().__init__()
        self.ctx = ctx

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.ctx.matches = discover(model)
        return ir.passes.PassResult(model, modified=False)
