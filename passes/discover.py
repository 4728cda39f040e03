"""Find decoder layers in an exported graph from dataflow alone.

Anchors, in the order they are searched (each failure names the anchor and where the search stopped):
1. `kv`: the graph outputs `present.N.key` / `present.N.value` (the exporter I/O convention).
2. `attention`: the op that consumes the key cache (MatMul of Q.K^T, or an Attention/MultiHeadAttention/
   GroupQueryAttention op), reached through layout ops (GQA Unsqueeze/Expand/Reshape, Transpose, scaling).
3. `query`: the other operand (as attention uses it: after RoPE), and behind a rotary (Add of two Muls with
   rotate-half, or a RotaryEmbedding op) the raw query.
4. `residual`: following the attention output forward to the Add (or fused Skip*Norm) that joins the stream.
5. `mlp`: the consumer of that residual which closes a branch depending on it: the MLP branch is every node
   between the branch entry (the residual, or the fused norm's output) and the closing input.
Weight names and module paths are never used: exporters rename and merge them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import onnx_ir as ir

from fastcar_compile.passes import genai_gqa
from fastcar_compile.passes import graph_utils as gu

_KV_NAME = re.compile(r"^present[._](\d+)[._](key|value)$")


class MatchFailure(Exception):
    """A layer did not match; `anchor` is what was missing, `where` where the search stopped."""

    def __init__(self, anchor: str, reason: str, where: str = ""):
        super().__init__(reason)
        self.anchor = anchor
        self.reason = reason
        self.where = where


@dataclass
class AttentionBlock:
    present_key: ir.Value
    present_value: ir.Value
    core_node: ir.Node
    core_output: ir.Value
    q: ir.Value
    q_layout: str  # BHSD | BSHD | BSE
    q_raw: ir.Value
    q_raw_layout: str
    rope: str  # what rotary was found ("none" for learned/absolute positions)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    join: ir.Node | None = None  # the Add / Skip*Norm that adds the attention output to the stream
    packed_query: genai_gqa.PackedQuery | None = None  # GroupQueryAttention on packed QKV: q built by the rewrite
    # GroupQueryAttention's total_sequence_length: its key buffer may be preallocated (longer than the tokens)
    total_len: ir.Value | None = None

    def nodes(self) -> set[ir.Node]:
        """Norm, projections, rotary, KV concat and attention: nodes between the incoming stream and the join."""
        if self.join is None:
            return set()
        attn_in = [i for i in self.join.inputs[:2] if i is not None and gu.depends_on(i, self.core_output)]
        stream_in = [i for i in self.join.inputs[:2] if i is not None and i not in attn_in]
        if len(attn_in) != 1 or len(stream_in) != 1:
            return set()
        back = gu.ancestors_until(attn_in, set(stream_in))
        sources = [stream_in[0]]
        producer = stream_in[0].producer()
        if producer is not None and producer.op_type in gu.SKIP_NORM_OPS:  # fused: its normed output feeds q/k/v
            sources = [o for o in producer.outputs if o is not None]
        found: set[ir.Node] = set()
        for source in sources:
            found |= gu.descendants(source, back)
        return found


@dataclass
class MLPBlock:
    entry: ir.Value  # per-token input of the branch ([B, S, hidden])
    output: ir.Value  # branch output, added to the residual by `closing`
    residual: ir.Value  # the stream value the branch output is added to
    closing: ir.Node
    nodes: list[ir.Node]
    weights: list[tuple[int, ...]]
    hidden: int
    fused_norm: bool  # the norm feeding the branch is fused with the attention residual Add
    # Shape tensors computed outside the branch (dynamo's shared symbolic sizes) that the branch's
    # Reshapes read, with their length: row compaction must rebuild them for the compacted row count.
    external_shapes: dict[ir.Value, int] = field(default_factory=dict)


@dataclass
class LayerMatch:
    layer: int
    attention: AttentionBlock | None = None
    mlp: MLPBlock | None = None
    failure: MatchFailure | None = None
    trace: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.failure is None and self.attention is not None and self.mlp is not None


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
    matches = []
    for layer, kv in kv_outputs(graph).items():
        match = LayerMatch(layer)
        try:
            if "key" not in kv or "value" not in kv:
                raise MatchFailure("kv", f"present.{layer}.key/value: only {sorted(kv)} found", "graph outputs")
            match.attention = _find_attention(kv["key"], kv["value"], match.trace)
            match.mlp = _find_mlp(graph, match.attention, match.trace)
        except MatchFailure as exc:
            match.failure = exc
        matches.append(match)
    return matches


# --- attention -------------------------------------------------------------------------------------------


def _walk_forward_to_consumer(value: ir.Value, trace: list[str]) -> tuple[ir.Node, int]:
    """From a cache tensor, through layout/scale ops, to the node that computes with it."""
    frontier = [value]
    seen: set[ir.Node] = set()
    last = "the graph output"
    while frontier:
        v = frontier.pop(0)
        for node in gu.real_consumers(v):
            if node in seen:
                continue
            seen.add(node)
            last = gu.describe(node)
            idx = next(i for i, x in enumerate(node.inputs) if x is v)
            if node.op_type in gu.ATTENTION_OPS or node.op_type == "MatMul":
                trace.append(f"{value.name} -> {gu.describe(node)} (input {idx})")
                return node, idx
            if node.op_type in gu.LAYOUT_OPS and idx == 0:
                frontier.append(node.outputs[0])
            elif node.op_type in ("Mul", "Div") and gu.scalar_const(node.inputs[1 - idx]) is not None:
                frontier.append(node.outputs[0])
    raise MatchFailure("attention", f"no MatMul/Attention op consumes {value.name}", f"stopped after {last}")


def _walk_back_scale(value: ir.Value) -> ir.Value:
    """Skip the scaling (Mul/Div by a constant) and casts applied to q right before the score MatMul."""
    while True:
        node = value.producer()
        if node is None:
            return value
        if node.op_type in ("Mul", "Div") and gu.scalar_const(node.inputs[1]) is not None:
            value = node.inputs[0]
        elif node.op_type == "Mul" and gu.scalar_const(node.inputs[0]) is not None:
            value = node.inputs[1]
        elif node.op_type in ("Cast", "Identity"):
            value = node.inputs[0]
        else:
            return value


def _walk_back_transpose(value: ir.Value) -> tuple[ir.Value, bool]:
    """Undo K^T-style transposes on the q side: returns (value, was_transposed_last_two)."""
    node = value.producer()
    if node is not None and node.op_type == "Transpose":
        perm = list(node.attributes["perm"].value) if "perm" in node.attributes else None
        if perm is not None and len(perm) >= 2 and perm[-2:] == [len(perm) - 1, len(perm) - 2]:
            return node.inputs[0], True
    return value, False


def _rope_input(q: ir.Value, depth: int = 0) -> tuple[ir.Value, str]:
    """The query before positional rotation, and what rotary was found.

    Looks through head-layout ops too: fused attention (MultiHeadAttention) takes the rotated query
    re-laid out as [B, S, H*D], so the rotary sits behind a Transpose/Reshape.
    """
    node = q.producer()
    if node is None:
        return q, "none"
    if node.op_type in ("Reshape", "Transpose") and depth < 3:
        inner, kind = _rope_input(node.inputs[0], depth + 1)
        if kind != "none":
            return inner, kind
    if node.op_type in gu.ROTARY_OPS:
        return node.inputs[0], f"{node.domain or 'onnx'}::RotaryEmbedding"
    if node.op_type == "Concat" and len(node.inputs) == 2:  # partial rotary: concat(rope(x[..:r]), x[r:])
        rot, passthrough = node.inputs
        inner, kind = _rope_input(rot)
        pnode = passthrough.producer()
        if kind != "none" and pnode is not None and pnode.op_type in ("Slice", "Split"):
            return pnode.inputs[0], f"partial {kind}"
    if node.op_type == "Add" and len(node.inputs) == 2:
        muls = [i.producer() for i in node.inputs]
        if all(m is not None and m.op_type == "Mul" for m in muls):
            # x*cos + rotate_half(x)*sin: x is the Mul operand that the other product also derives from.
            for a, b in ((muls[0], muls[1]), (muls[1], muls[0])):
                for cand in a.inputs:
                    if cand is None or gu.is_static(cand):
                        continue
                    if any(gu.depends_on(other, cand, limit=64) for other in b.inputs if other is not None):
                        src = cand.producer()
                        if src is not None and src.op_type in ("Slice", "Split"):  # partial rotary
                            pass
                        return cand, "rotate-half (Mul/Add)"
    return q, "none"


def _layout(value: ir.Value, heads: int, head_dim: int) -> str | None:
    dims = gu.static_dims(value)
    if dims is None:
        return None
    if len(dims) == 3 and dims[2] == heads * head_dim:
        return "BSE"
    if len(dims) == 4 and dims[3] == head_dim:
        if dims[1] == heads:
            return "BHSD"
        if dims[2] == heads:
            return "BSHD"
    return None


def _infer_layout_structurally(value: ir.Value) -> str | None:
    node = value.producer()
    if node is not None and node.op_type == "Transpose" and "perm" in node.attributes:
        if list(node.attributes["perm"].value) == [0, 2, 1, 3]:
            return "BHSD"
    if node is not None and node.op_type in gu.ROTARY_OPS:
        return _infer_layout_structurally(node.inputs[0])
    return None


def _find_attention(pkey: ir.Value, pvalue: ir.Value, trace: list[str]) -> AttentionBlock:
    kdims = gu.static_dims(pkey)
    producer = pkey.producer()
    if producer is not None and producer.op_type in gu.ATTENTION_OPS:  # fused op writes the cache itself
        core, kidx = producer, None
    else:
        core, kidx = _walk_forward_to_consumer(pkey, trace)
    packed = genai_gqa.match(core)
    if packed is not None:  # onnxruntime-genai: packed QKV, fused rotary, symbolic head size
        src, heads, num_kv, head_dim = packed
        trace.append(f"{gu.describe(core)} on packed QKV {src.qkv.name}: heads {heads}, kv heads {num_kv}, "
                     f"head dim {head_dim} (output projection), rotary dim {src.rotary_dim}")
        return AttentionBlock(pkey, pvalue, core, core.outputs[0], src.qkv, "QKV", src.qkv, "QKV",
                              "GroupQueryAttention do_rotary" if src.cos_cache is not None else "none",
                              heads, num_kv, head_dim, packed_query=src, total_len=src.total_len)
    if kdims is not None and len(kdims) == 4 and kdims[3] is None:  # symbolic head size (genai's builder)
        kdims[3] = _head_dim_from_core(core)
    if kdims is None or len(kdims) != 4 or kdims[1] is None or kdims[3] is None:
        raise MatchFailure("kv", f"{pkey.name} must be [batch, kv_heads, seq, head_dim] with static heads/dims",
                           f"shape {pkey.shape}")
    num_kv, head_dim = int(kdims[1]), int(kdims[3])

    if core.op_type == "MatMul":
        q_side = core.inputs[1 - kidx]
        q_side, _ = _walk_back_transpose(q_side)
        q = _walk_back_scale(q_side)
        vcore, _ = _walk_forward_to_consumer(pvalue, trace)
        if vcore.op_type != "MatMul":
            raise MatchFailure("attention", f"value cache feeds {gu.describe(vcore)}, expected MatMul", gu.describe(vcore))
        core_out = vcore.outputs[0]
    else:
        q = core.inputs[0]
        if q is None:
            raise MatchFailure("query", f"{gu.describe(core)} has no query input", gu.describe(core))
        q = _walk_back_scale(q)
        core_out = core.outputs[0]

    heads = None
    qdims = gu.static_dims(q)
    for attr in ("q_num_heads", "num_heads"):
        if attr in core.attributes:
            heads = int(core.attributes[attr].value)
    if heads is None and qdims is not None and len(qdims) == 4 and qdims[3] == head_dim:
        heads = qdims[1] if _infer_layout_structurally(q) == "BHSD" or qdims[2] is None else qdims[2]
    if heads is None and qdims is not None and len(qdims) == 3 and qdims[2] is not None:
        heads = qdims[2] // head_dim
    if heads is None:
        heads = _heads_from_output_projection(core_out, head_dim)
    if heads is None:
        raise MatchFailure("query", f"cannot tell the number of query heads of {q.name} (shape {q.shape})",
                           gu.describe(q.producer()))
    q_raw, rope = _rope_input(q)
    raw_layout = _layout(q_raw, heads, head_dim) or _infer_layout_structurally(q_raw)
    # A rotary is elementwise over the head layout, so q keeps the layout of the raw query.
    layout = _layout(q, heads, head_dim) or _infer_layout_structurally(q) or raw_layout
    raw_layout = raw_layout or layout
    if layout is None:
        raise MatchFailure("query", f"unknown layout of query {q.name} (shape {q.shape})", gu.describe(q.producer()))
    trace.append(f"query {q.name} [{layout}], raw {q_raw.name} [{raw_layout}], rotary: {rope}")
    trace.append(f"heads {heads}, kv heads {num_kv}, head dim {head_dim}")
    if heads % num_kv:
        raise MatchFailure("query", f"{heads} query heads do not group over {num_kv} kv heads", q.name)
    total_len = core.inputs[6] if core.op_type == "GroupQueryAttention" and len(core.inputs) > 6 else None
    return AttentionBlock(pkey, pvalue, core, core_out, q, layout, q_raw, raw_layout, rope, heads, num_kv, head_dim,
                          total_len=total_len)


def _head_dim_from_core(core: ir.Node) -> int | None:
    """Head size of an attention op with a `num_heads` attribute, from its output projection's fan-in."""
    if "num_heads" not in core.attributes:
        return None
    heads = int(core.attributes["num_heads"].value)
    fan_in = _heads_from_output_projection(core.outputs[0], 1)
    return fan_in // heads if fan_in and fan_in % heads == 0 else None


def _heads_from_output_projection(core_out: ir.Value, head_dim: int) -> int | None:
    """Query heads from the output projection's weight ([heads * head_dim, hidden]) after the attention."""
    v = core_out
    for _ in range(16):
        cons = gu.real_consumers(v)
        if len(cons) != 1:
            return None
        node = cons[0]
        if node.op_type == "MatMulNBits" and "K" in node.attributes:
            fan_in = int(node.attributes["K"].value)
            return fan_in // head_dim if fan_in % head_dim == 0 else None
        if node.op_type in ("MatMul", "Gemm"):
            shape = gu.weight_shape(node.inputs[1])
            if shape is None or len(shape) != 2:
                return None
            trans_b = node.op_type == "Gemm" and "transB" in node.attributes and node.attributes["transB"].value
            fan_in = shape[1] if trans_b else shape[0]
            return fan_in // head_dim if fan_in % head_dim == 0 else None
        v = node.outputs[0]
    return None


# --- residual and MLP ------------------------------------------------------------------------------------


def _find_residual_join(core_out: ir.Value, trace: list[str]) -> tuple[ir.Node, ir.Value, ir.Value, bool]:
    """Follow the attention output to the op adding it to the residual stream.

    Returns (join node, residual after the join, branch entry, fused): fused when a Skip*Norm both closes
    the attention residual and normalises the MLP input.
    """
    v = core_out
    for _ in range(64):
        cons = gu.real_consumers(v)
        if len(cons) != 1:
            raise MatchFailure("residual", f"attention output path forks at {v.name} ({len(cons)} consumers)",
                               ", ".join(gu.describe(n) for n in cons) or "no consumer")
        node = cons[0]
        if node.op_type in gu.SKIP_NORM_OPS and len(node.outputs) >= 4 and node.outputs[3] is not None:
            trace.append(f"attention residual: {gu.describe(node)} (fused norm)")
            return node, node.outputs[3], node.outputs[0], True
        if node.op_type == "Add":
            other = node.inputs[1] if node.inputs[0] is v else node.inputs[0]
            if other is not None and not gu.is_static(other):
                trace.append(f"attention residual: {gu.describe(node)}")
                return node, node.outputs[0], node.outputs[0], False
        v = node.outputs[0]
    raise MatchFailure("residual", "no residual Add after the attention output", gu.describe(v.producer()))


def _find_mlp(graph: ir.Graph, attn: AttentionBlock, trace: list[str]) -> MLPBlock:
    join, residual, entry, fused = _find_residual_join(attn.core_output, trace)
    attn.join = join
    closing, branch_out = None, None
    # Exporters may route the stream through no-op Casts/Identities (TorchScript: RMSNorm's .to(float32)).
    aliases = [residual]
    for alias in aliases:
        aliases.extend(n.outputs[0] for n in alias.consumers() if n.op_type in ("Cast", "Identity"))
    for alias in aliases:
        for node in alias.consumers():
            # Skip*Norm sums input and skip: the stream may be either (genai's builder puts it first).
            if node.op_type == "Add" or (node.op_type in gu.SKIP_NORM_OPS and alias in node.inputs[:2]):
                others = [i for i in node.inputs[:2] if i is not None and i is not alias]
                if len(others) == 1 and gu.depends_on(others[0], entry):
                    closing, branch_out = node, others[0]
                    residual = alias
                    entry = entry if fused else alias
                    break
        if closing is not None:
            break
    if closing is None:
        raise MatchFailure("mlp", f"no Add closes a branch that starts at {residual.name}",
                           ", ".join(gu.describe(n) for n in residual.consumers()))
    candidates = gu.ancestors_until([branch_out], {entry})
    nodes_set = gu.descendants(entry, candidates)
    nodes = gu.in_graph_order(graph, nodes_set)
    produced = {o for n in nodes for o in n.outputs}
    memo: dict = {}
    external_shapes: dict[ir.Value, int] = {}
    for node in nodes:
        for pos, inp in enumerate(node.inputs):
            if inp is None or inp is entry or inp in produced or gu.is_static(inp, memo):
                continue
            dims = gu.static_dims(inp)
            if node.op_type == "Reshape" and pos == 1 and dims is not None and len(dims) == 1 and dims[0]:
                external_shapes[inp] = int(dims[0])
                continue
            raise MatchFailure("mlp", f"MLP branch reads {inp.name} from outside the branch "
                               f"(produced by {gu.describe(inp.producer())}); cannot isolate it", gu.describe(node))
        for out in node.outputs:
            if out is branch_out:
                continue
            outside = [c for c in out.consumers() if c not in nodes_set]
            if outside or out.is_graph_output():
                raise MatchFailure("mlp", f"MLP value {out.name} is also used outside the branch",
                                   ", ".join(gu.describe(c) for c in outside) or "graph output")
    weights = []
    for node in nodes:
        if node.op_type == "MatMulNBits":  # packed 4-bit blocks: the logical shape is in the attributes
            weights.append((int(node.attributes["K"].value), int(node.attributes["N"].value)))
        elif node.op_type in gu.MATMUL_OPS:
            shape = gu.weight_shape(node.inputs[1])
            if shape is not None:
                weights.append(shape)
    if not weights:
        raise MatchFailure("mlp", "branch has no MatMul with a weight initializer", gu.describe(closing))
    edims = gu.static_dims(entry)
    hidden = edims[-1] if edims and edims[-1] is not None else weights[0][0]
    trace.append(f"MLP branch: {len(nodes)} nodes, weights {weights}, closed by {gu.describe(closing)}")
    return MLPBlock(entry, branch_out, residual, closing, nodes, weights, int(hidden), fused, external_shapes)
