"""onnxruntime-genai's attention: `com.microsoft.GroupQueryAttention` on a packed QKV with `do_rotary=1`.

The model builder's graphs (SPEC.md section 5) feed one packed projection [B, S, (H + 2 Hkv) D] as the
query and leave key/value empty; the op rotates q and k itself from the graph's `cos_cache`/`sin_cache`,
so the post-RoPE query never exists as a tensor, and the head size is symbolic in the KV I/O. Here:
`match` reads heads, KV heads, head size (off the op and the output projection's weight) and where the query
comes from: the gate (ai.fastcar.TemporalGatePacked[Rope], passes/gate.py) takes the packed input itself and
rebuilds the query TAS reads: `raw` = the q slice, `rope` = that slice rotated as GroupQueryAttention rotates it,
with the same caches at the tokens' positions `total_sequence_length - S + i` (KV index = position when rows
are unpadded; GQA keeps each row's cache packed from index 0). The token count for the gate is
`total_sequence_length` too: with genai's shared buffer the present key is [B, Hkv, max_length, D], so its
length says nothing about the position.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir

from fastcar_compile.passes import graph_utils as gu


@dataclass(frozen=True)
class PackedQuery:
    """Where a GroupQueryAttention's query comes from: the inputs `query` rebuilds it from."""

    qkv: ir.Value  # [B, S, (H + 2 Hkv) * D]
    cos_cache: ir.Value | None  # [max_positions, rotary_dim / 2]; None without do_rotary
    sin_cache: ir.Value | None
    total_len: ir.Value  # GQA total_sequence_length: int32 scalar
    interleaved: bool
    rotary_dim: int


def _attr(node: ir.Node, name: str, default=None):
    return node.attributes[name].value if name in node.attributes else default


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


def match(core: ir.Node) -> tuple[PackedQuery, int, int, int] | None:
    """(query source, heads, kv heads, head size) of a packed GroupQueryAttention, or None."""
    if not is_packed(core):
        return None
    heads, kv_heads = int(_attr(core, "num_heads", 0)), int(_attr(core, "kv_num_heads", 0))
    if heads <= 0 or kv_heads <= 0:
        return None
    head_dim = None
    for cons in gu.real_consumers(core.outputs[0]):  # output projection: [H * D, hidden]
        if cons.op_type in gu.MATMUL_OPS:
            fan_in = _in_features(cons)
            if fan_in is not None and fan_in % heads == 0:
                head_dim = fan_in // heads
    if head_dim is None:
        return None
    do_rotary = bool(_attr(core, "do_rotary", 0))
    cos = core.inputs[7] if do_rotary and len(core.inputs) > 8 else None
    sin = core.inputs[8] if do_rotary and len(core.inputs) > 8 else None
    rotary_dim = 0
    if cos is not None:
        shape = gu.weight_shape(cos) or (gu.static_dims(cos) if cos.shape is not None else None)
        if not shape or shape[-1] is None:
            return None
        rotary_dim = 2 * int(shape[-1])
    src = PackedQuery(core.inputs[0], cos, sin, core.inputs[6], bool(_attr(core, "rotary_interleaved", 0)),
                      rotary_dim)
    return src, heads, kv_heads, head_dim

