"""Attention matchers: from a layer's key cache to the op that computes attention with it, and the query.

Forms, tried in order on the op that reads (or writes) the key cache:
- `fused op`: an `Attention` / `MultiHeadAttention` / `GroupQueryAttention` op (query = its first input);
- `MatMul/Softmax`: the score MatMul q.K^T, whose other operand is the query and whose scores reach the
  value MatMul (through Softmax, masks, soft-capping).
The key cache is found through layout ops (GQA Unsqueeze/Expand/Reshape, Transpose, scaling) and, for a
sliding-window cache, through the Slice that cuts the window off the keys attention reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir

from fastcar_compile.passes import graph_utils as gu
from fastcar_compile.passes.match_base import MatchContext, MatchFailure, first_match

# Ops that cut a cache window off the full keys (sliding-window caches keep the last W - 1 positions).
_WINDOW_OPS = frozenset({"Slice"})


@dataclass
class AttentionCore:
    """What an attention form found: the computing op, its output, the query it reads, the keys it reads."""

    core: ir.Node
    core_output: ir.Value
    q: ir.Value
    keys: ir.Value  # present key, or the unsliced keys when the present key is a sliding window of them


# Ops a softmax scale may be computed with from a tensor's shape (TorchScript: sqrt(1 / sqrt(head_dim))).
_SCALE_OPS = frozenset({"Sqrt", "Cast", "Div", "Mul", "Reciprocal", "Pow", "Gather", "Slice", "Squeeze",
                        "Unsqueeze", "Identity", "Sub", "Add", "Reshape", "Constant"})


def is_scale(value: ir.Value | None, depth: int = 0) -> bool:
    """A constant scalar, or a value computed only from constants and tensor shapes (TorchScript's SDPA
    scales q and K^T by sqrt(1 / sqrt(D)) computed from Shape(q)): never the data of another tensor."""
    if value is None or gu.scalar_const(value) is not None:
        return True
    dims = gu.static_dims(value)
    if depth == 0 and dims is not None and len(dims) > 1:
        return False
    if gu.is_static(value):
        return depth > 0
    node = value.producer()
    if node is None or depth > 12:
        return False
    if node.op_type == "Shape":
        return True
    return node.op_type in _SCALE_OPS and all(is_scale(i, depth + 1) for i in node.inputs if i is not None)


def walk_forward_to_consumer(value: ir.Value, trace: list[str]) -> tuple[ir.Node, int]:
    """From a cache tensor, through layout/scale ops, to the node that computes with it (and the input index)."""
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
            elif node.op_type in ("Mul", "Div") and is_scale(node.inputs[1 - idx]):
                frontier.append(node.outputs[0])
    # `where` is printed as "(search stopped at <where>)": the last op the walk went through.
    raise MatchFailure("attention", f"no MatMul/Attention op consumes {value.name}", last)


def window_source(pkey: ir.Value) -> ir.Value | None:
    """The keys a sliding-window present key was sliced from (None when the present key is not a window)."""
    node = pkey.producer()
    if node is None or node.op_type not in _WINDOW_OPS or gu.real_consumers(pkey):
        return None
    return node.inputs[0]


def window_length(pkey: ir.Value) -> int | None:
    """How many positions a sliding-window present key keeps (the Slice's constant negative start), if known."""
    node = pkey.producer()
    start = gu.scalar_const(node.inputs[1]) if node is not None and len(node.inputs) > 1 else None
    return int(-start) if start is not None and start < 0 else None


def walk_back_scale(value: ir.Value) -> ir.Value:
    """Skip the scaling (Mul/Div by a constant) and casts applied to q right before the score MatMul."""
    while True:
        node = value.producer()
        if node is None:
            return value
        if node.op_type in ("Mul", "Div") and is_scale(node.inputs[1]):
            value = node.inputs[0]
        elif node.op_type == "Mul" and is_scale(node.inputs[0]):
            value = node.inputs[1]
        elif node.op_type in ("Cast", "Identity"):
            value = node.inputs[0]
        else:
            return value


def _walk_back_transpose(value: ir.Value) -> ir.Value:
    """Undo a K^T-style transpose (last two axes swapped) on the q side."""
    node = value.producer()
    if node is not None and node.op_type == "Transpose" and "perm" in node.attributes:
        perm = list(node.attributes["perm"].value)
        if len(perm) >= 2 and perm[-2:] == [len(perm) - 1, len(perm) - 2]:
            return node.inputs[0]
    return value


def _reaches(value: ir.Value, target: ir.Node, limit: int = 64) -> bool:
    """Is `target` among the first `limit` nodes downstream of `value` (scores -> mask, Softmax -> value MatMul)?"""
    seen: set[ir.Node] = set()
    frontier = [value]
    while frontier and len(seen) < limit:
        for node in frontier.pop(0).consumers():
            if node is target:
                return True
            if node not in seen:
                seen.add(node)
                frontier.extend(o for o in node.outputs if o is not None)
    return False


# --- forms --------------------------------------------------------------------------------------------------


def fused_op(core: ir.Node, keys: ir.Value) -> AttentionCore:
    """An ONNX/contrib attention op: the query is its first input."""
    if core.op_type not in gu.ATTENTION_OPS:
        raise MatchFailure("attention", f"{gu.describe(core)} is not an {'/'.join(sorted(gu.ATTENTION_OPS))} op",
                           gu.describe(core), applies=False)
    q = core.inputs[0]
    if q is None:
        raise MatchFailure("query", f"{gu.describe(core)} has no query input", gu.describe(core))
    return AttentionCore(core, core.outputs[0], walk_back_scale(q), keys)


def matmul_softmax(core: ir.Node, kidx: int | None, keys: ir.Value, pvalue: ir.Value,
                   trace: list[str]) -> AttentionCore:
    """Decomposed attention: scores = MatMul(q, K^T) -> Softmax -> MatMul(., V)."""
    if core.op_type != "MatMul" or kidx is None:
        raise MatchFailure("attention", f"the key cache feeds {gu.describe(core)}, not a score MatMul",
                           gu.describe(core), applies=False)
    q = walk_back_scale(_walk_back_transpose(core.inputs[1 - kidx]))
    vsource = window_source(pvalue) or pvalue
    vcore, vidx = walk_forward_to_consumer(vsource, trace)
    if vcore.op_type != "MatMul":
        raise MatchFailure("attention", f"value cache feeds {gu.describe(vcore)}, expected MatMul", gu.describe(vcore))
    if not _reaches(core.outputs[0], vcore):
        raise MatchFailure("attention", f"{gu.describe(vcore)} does not read the scores of {gu.describe(core)}",
                           gu.describe(vcore))
    return AttentionCore(core, vcore.outputs[0], q, keys)


def cache_consumer(ctx: MatchContext, pkey: ir.Value) -> tuple[ir.Node, int | None, ir.Value]:
    """(op computing with the key cache, the cache's input index or None when the op writes it, keys it reads)."""
    producer = pkey.producer()
    if producer is not None and producer.op_type in gu.ATTENTION_OPS:  # the fused op writes the cache itself
        return producer, None, pkey
    keys = pkey
    window = window_source(pkey)
    if window is not None:
        ctx.trace.append(f"{pkey.name} is a window sliced off {window.name} (sliding-window cache)")
        keys = window
    core, kidx = walk_forward_to_consumer(keys, ctx.trace)
    return core, kidx, keys


def find_core(ctx: MatchContext, core: ir.Node, kidx: int | None, keys: ir.Value,
              pvalue: ir.Value) -> tuple[str, AttentionCore]:
    """Try the attention forms in order on the op that reads (or writes) the key cache."""
    forms = (
        ("fused op", lambda: fused_op(core, keys)),
        ("MatMul/Softmax", lambda: matmul_softmax(core, kidx, keys, pvalue, ctx.trace)),
    )
    return first_match("attention", forms, ctx.trace)


# --- heads and layout -----------------------------------------------------------------------------------------


def layout_of(value: ir.Value, heads: int, head_dim: int) -> str | None:
    """BSE / BHSD / BSHD from static dims, else None."""
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


def layout_from_structure(value: ir.Value) -> str | None:
    """BHSD when the value is the [0, 2, 1, 3] transpose of a head split (possibly behind a rotary op or a
    per-head norm)."""
    node = value.producer()
    if node is not None and node.op_type == "Transpose" and "perm" in node.attributes:
        if list(node.attributes["perm"].value) == [0, 2, 1, 3]:
            return "BHSD"
    if node is not None and (node.op_type in gu.ROTARY_OPS or node.op_type in ("Slice", "Split", "Concat")):
        # Rotary ops, a head-dim chunk (NeoX's fused qkv per head) and a partial rotary's Concat keep the layout.
        return layout_from_structure(node.inputs[0])
    data = per_head_norm_input(node)
    return layout_from_structure(data) if data is not None else None


def per_head_norm_input(node: ir.Node | None) -> ir.Value | None:
    """The head-laid-out input of one step of a norm over the head size, which keeps the layout: a norm op, a
    Cast, or a Mul/Div whose other operand is a weight over the last axis or a scale computed from that input
    (RMSNorm written out). Gemma 3 normalises q/k per head after the head transpose, before RoPE."""
    if node is None or not node.inputs or node.inputs[0] is None:
        return None
    if node.op_type in gu.NORM_OPS - gu.SKIP_NORM_OPS or node.op_type == "Cast":
        return node.inputs[0]
    if node.op_type not in ("Mul", "Div") or len(node.inputs) != 2 or None in node.inputs:
        return None
    for data, other in (node.inputs, node.inputs[::-1]):
        if gu.is_static(data):
            continue
        if gu.is_static(other):
            shape = other.shape if other.shape is not None else getattr(other.const_value, "shape", None)
            if shape is not None and len(shape) <= 1:  # a weight over the head size, or a scalar
                return data
        elif gu.depends_on(other, data, limit=8):  # x * rsqrt(mean(x^2) + eps)
            return data
    return None


def query_heads(found: AttentionCore, head_dim: int) -> int:
    """Number of query heads: op attribute, query shape, or the output projection's fan-in."""
    core, q = found.core, found.q
    heads = None
    for attr in ("q_num_heads", "num_heads"):
        if attr in core.attributes:
            heads = int(core.attributes[attr].value)
    qdims = gu.static_dims(q)
    if heads is None and qdims is not None and len(qdims) == 4 and qdims[3] == head_dim:
        heads = qdims[1] if layout_from_structure(q) == "BHSD" or qdims[2] is None else qdims[2]
    if heads is None and qdims is not None and len(qdims) == 3 and qdims[2] is not None:
        heads = qdims[2] // head_dim
    if heads is None:
        heads = _heads_from_output_projection(found.core_output, head_dim)
    if heads is None:
        raise MatchFailure("query", f"cannot tell the number of query heads of {q.name} (shape {q.shape})",
                           gu.describe(q.producer()))
    return heads


def head_dim_from_core(core: ir.Node) -> int | None:
    """Head size of an attention op with a `num_heads` attribute, from its output projection's fan-in
    (onnxruntime-genai's builder leaves the cache's head size symbolic)."""
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
