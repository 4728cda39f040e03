"""onnxruntime-genai's attention: `com.microsoft.GroupQueryAttention` with the rotary inside it (`do_rotary=1`).

The model builder's graphs (docs/semantics.md section 5) feed the op either one packed projection [B, S, (H + 2 Hkv) D]
as the query with key/value empty, or separate q [B, S, H D] / k / v (Qwen3: after per-head q/k norms), and
let the op rotate q and k itself from the graph's `cos_cache`/`sin_cache`: the post-RoPE query never exists
as a tensor, and the head size is symbolic in the KV I/O. Here: `match` reads heads, KV heads, head size
(off the op and the output projection's weight), the rotary the op applies and where the query comes from:
the gate (ai.fastcar.TemporalGate's packed_qkv form, passes/gate.py) takes the op's query input itself (its first
H*D channels are q in both forms) and rebuilds the query TAS reads: `raw` = those channels, `rope` = those
channels rotated as GroupQueryAttention rotates them, with the same caches at the tokens' positions
`total_sequence_length - S + i` (KV index = position when rows are unpadded; GQA keeps each row's cache
packed from index 0). The token count for the gate is `total_sequence_length` too: with genai's shared
buffer the present key is [B, Hkv, max_length, D], so its length says nothing about the position.

A rotary the gate cannot reproduce is never guessed: `PackedQuery.rope_refusal` says why, and compiling such a
layer for `rope` TAS fails naming `--tas-query raw` / `--layers` (passes/analysis.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir

from fastcar_compile.passes import graph_utils as gu
from fastcar_compile.passes.match_base import MatchFailure
from fastcar_compile.passes.match_rotary import find_rotary

# GroupQueryAttention's inputs (com.microsoft, ORT 1.31 schema).
_COS, _SIN, _POSITION_IDS, _Q_NORM_WEIGHT = 7, 8, 9, 14


@dataclass(frozen=True)
class PackedQuery:
    """Where a GroupQueryAttention's query comes from: the inputs the gate rebuilds it from."""

    qkv: ir.Value  # the op's query input: packed [B, S, (H + 2 Hkv) * D], or q alone [B, S, H * D]
    cos_cache: ir.Value | None  # [max_positions, rotary_dim / 2]; None when the op does not rotate
    sin_cache: ir.Value | None
    total_len: ir.Value  # GQA total_sequence_length: int32 scalar
    interleaved: bool
    rotary_dim: int
    packed: bool = True  # key and value inputs empty: q, k and v are slices of `qkv`
    rotary: str = "none"  # what --inspect prints
    rope_refusal: str | None = None  # why `rope` TAS cannot be rebuilt (None: it can)


def _attr(node: ir.Node, name: str, default=None):
    return node.attributes[name].value if name in node.attributes else default


def _input(node: ir.Node, index: int) -> ir.Value | None:
    return node.inputs[index] if len(node.inputs) > index else None


def _in_features(node: ir.Node) -> int | None:
    if node.op_type == "MatMulNBits":
        return int(_attr(node, "K")) if "K" in node.attributes else None
    shape = gu.weight_shape(node.inputs[1]) if len(node.inputs) > 1 else None
    if shape is None or len(shape) != 2:
        return None
    if node.op_type == "Gemm" and _attr(node, "transB", 0):
        return shape[1]
    return shape[0]


def is_packed(core: ir.Node) -> bool:
    """A GroupQueryAttention fed one packed QKV tensor (key and value inputs empty)."""
    return (core.op_type == "GroupQueryAttention" and len(core.inputs) > 6
            and (len(core.inputs) < 2 or core.inputs[1] is None))


def _head_dim(core: ir.Node, heads: int) -> int | None:
    """Head size from the output projection's fan-in ([H * D, hidden])."""
    head_dim = None
    for cons in gu.real_consumers(core.outputs[0]):
        if cons.op_type in gu.MATMUL_OPS:
            fan_in = _in_features(cons)
            if fan_in is not None and fan_in % heads == 0:
                head_dim = fan_in // heads
    return head_dim


def _inner_rotary(core: ir.Node, head_dim: int) -> tuple[ir.Value | None, ir.Value | None, int, str, str | None]:
    """(cos, sin, rotary dim, description, refusal) of the rotary a do_rotary=1 op applies."""
    interleaved = bool(_attr(core, "rotary_interleaved", 0))
    cos, sin = _input(core, _COS), _input(core, _SIN)
    form = "interleaved" if interleaved else "half-split"
    where = f"in GroupQueryAttention (do_rotary=1, {form}"
    if cos is None or sin is None:
        return None, None, 0, where + ")", f"{core.name} rotates (do_rotary=1) without cos_cache/sin_cache inputs"
    if _input(core, _POSITION_IDS) is not None:
        return None, None, 0, where + ", at position_ids)", (
            f"{core.name} rotates at its position_ids input, not at total_sequence_length - S + i as the gate does")
    shape = gu.weight_shape(cos) or (gu.static_dims(cos) if cos.shape is not None else None)
    if not shape or len(shape) != 2 or shape[-1] is None:
        return None, None, 0, where + ")", f"the shape of {core.name}'s cos_cache {cos.name} is not known"
    rotary_dim = 2 * int(shape[-1])
    dim = f"dim {rotary_dim}" + (f" of {head_dim}" if rotary_dim != head_dim else "")
    if rotary_dim > head_dim:
        return None, None, 0, f"{where}, {dim})", (
            f"{core.name}'s cos_cache rotates {rotary_dim} channels, more than the head size {head_dim}")
    return cos, sin, rotary_dim, f"{where}, {dim})", None


def match(core: ir.Node) -> tuple[PackedQuery, int, int, int] | None:
    """(query source, heads, kv heads, head size) of a GroupQueryAttention whose query the gate rebuilds
    (packed QKV, or separate q/k/v with do_rotary=1), or None (not such an op: the generic matchers, which
    find a rotary applied before the op, take it). Raises MatchFailure for a form FastCar cannot read TAS from
    (q/k norms inside the op, a window-sized KV buffer)."""
    if core.op_type != "GroupQueryAttention" or len(core.inputs) < 7 or core.inputs[0] is None:
        return None
    if _attr(core, "sliding_window_cache", 0):
        raise MatchFailure("kv", f"{core.name} keeps a window-sized KV buffer (sliding_window_cache=1) indexed "
                           "relative to the window; the gate reads the key one frame back by absolute position",
                           gu.describe(core))
    do_rotary = bool(_attr(core, "do_rotary", 0))
    packed = is_packed(core)
    if not packed and not do_rotary:
        return None
    if _input(core, _Q_NORM_WEIGHT) is not None:
        raise MatchFailure("query", f"{core.name} normalises q inside (q_norm_weight input): the query TAS reads "
                           "(normalised, before or after RoPE) is never a tensor", gu.describe(core))
    heads, kv_heads = int(_attr(core, "num_heads", 0)), int(_attr(core, "kv_num_heads", 0))
    if heads <= 0 or kv_heads <= 0:
        return None
    head_dim = _head_dim(core, heads)
    if head_dim is None:
        return None
    query = core.inputs[0]
    cos = sin = None
    rotary_dim, refusal = 0, None
    if do_rotary:
        cos, sin, rotary_dim, rotary, refusal = _inner_rotary(core, head_dim)
    else:  # packed, no rotary inside: one applied to the packed tensor before the op cannot be placed
        _, outer = find_rotary(query)
        rotary = "none"
        if outer != "none":
            rotary = f"{outer} on the packed QKV before {core.name}"
            refusal = f"a {outer} rotates the packed q/k/v tensor {query.name} before {core.name}"
    src = PackedQuery(query, cos, sin, core.inputs[6], bool(_attr(core, "rotary_interleaved", 0)), rotary_dim,
                      packed=packed, rotary=rotary, rope_refusal=refusal)
    return src, heads, kv_heads, head_dim
