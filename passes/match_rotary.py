"""Rotary matchers: from the query as attention uses it back to the query before positional rotation.

Forms, tried in order on the producer of the query (looking through up to 3 head-layout Reshape/Transpose
ops, since fused attention takes the rotated query re-laid out as [B, S, H*D]):
- `RotaryEmbedding op` (ONNX opset 23 or com.microsoft): the raw query is its first input;
- `partial`: Concat(rotary(x[..., :r]), x[..., r:]), the pass-through half sliced off the raw query;
- `rotate-half`: x*cos + rotate(x)*sin, an Add of two Muls where one product derives from the other's
  operand (also covers GPT-J's rotate-every-two, which has the same Mul/Add shape);
- `none`: learned or absolute positions (the query is used as projected).
The `raw` TAS variant reads the query this returns, so a rotary that no form recognises must not pass as
`none` silently: only these shapes are claimed, and `--inspect` prints which form matched per layer.
"""

from __future__ import annotations

from collections.abc import Callable

import onnx_ir as ir

from fastcar_compile.passes import graph_utils as gu
from fastcar_compile.passes.match_base import MatchFailure

_LOOK_THROUGH = ("Reshape", "Transpose")
_MAX_DEPTH = 3


def _fail(reason: str, node: ir.Node | None) -> MatchFailure:
    return MatchFailure("rotary", reason, gu.describe(node))


def rotary_op(q: ir.Value) -> tuple[ir.Value, str]:
    node = q.producer()
    if node is None or node.op_type not in gu.ROTARY_OPS:
        raise _fail(f"{q.name} is not produced by a RotaryEmbedding op", node)
    return node.inputs[0], f"{node.domain or 'onnx'}::RotaryEmbedding"


def partial(q: ir.Value) -> tuple[ir.Value, str]:
    node = q.producer()
    if node is None or node.op_type != "Concat" or len(node.inputs) != 2:
        raise _fail(f"{q.name} is not a Concat of a rotated and a pass-through part", node)
    rot, passthrough = node.inputs
    _, kind = find_rotary(rot)
    pnode = passthrough.producer()
    if kind == "none" or pnode is None or pnode.op_type not in ("Slice", "Split"):
        raise _fail(f"{gu.describe(node)} does not concat a rotated part with a slice of the query", node)
    return pnode.inputs[0], f"partial {kind}"


def rotate_half(q: ir.Value) -> tuple[ir.Value, str]:
    node = q.producer()
    if node is None or node.op_type != "Add" or len(node.inputs) != 2:
        raise _fail(f"{q.name} is not an Add (x*cos + rotate(x)*sin)", node)
    muls = [i.producer() for i in node.inputs]
    if not all(m is not None and m.op_type == "Mul" for m in muls):
        raise _fail(f"{gu.describe(node)} does not add two products", node)
    # x*cos + rotate_half(x)*sin: x is the Mul operand that the other product also derives from.
    for a, b in ((muls[0], muls[1]), (muls[1], muls[0])):
        for cand in a.inputs:
            if cand is None or gu.is_static(cand):
                continue
            if any(gu.depends_on(other, cand, limit=64) for other in b.inputs if other is not None):
                return cand, "rotate-half (Mul/Add)"
    raise _fail(f"neither product of {gu.describe(node)} rotates the other's operand", node)


def no_rotary(q: ir.Value) -> tuple[ir.Value, str]:
    return q, "none"


ROTARY_FORMS: tuple[tuple[str, Callable[[ir.Value], tuple[ir.Value, str]]], ...] = (
    ("RotaryEmbedding op", rotary_op),
    ("partial", partial),
    ("rotate-half", rotate_half),
)


def find_rotary(q: ir.Value) -> tuple[ir.Value, str]:
    """(query before rotation, rotary kind); ("none") when no form matches."""
    raw, kind, _ = find_rotary_path(q)
    return raw, kind


def find_rotary_path(q: ir.Value, depth: int = 0) -> tuple[ir.Value, str, bool]:
    """As find_rotary, plus whether a [0, 2, 1, 3] Transpose lies between the rotary and q (GPT-J rotates
    in [B, S, H, D] and then permutes: the raw query's layout is then the transpose of q's)."""
    node = q.producer()
    if node is None:
        return q, "none", False
    if node.op_type in _LOOK_THROUGH and depth < _MAX_DEPTH:
        inner, kind, swapped = find_rotary_path(node.inputs[0], depth + 1)
        if kind != "none":
            heads_swap = node.op_type == "Transpose" and "perm" in node.attributes and \
                list(node.attributes["perm"].value) == [0, 2, 1, 3]
            return inner, kind, swapped != heads_swap
    for _, form in ROTARY_FORMS:
        try:
            raw, kind = form(q)
        except MatchFailure:
            continue
        return raw, kind, False
    raw, kind = no_rotary(q)
    return raw, kind, False
