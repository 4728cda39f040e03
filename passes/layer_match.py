"""What discovery hands to the rewrite, per decoder layer: the attention block and the MLP branch it found.

Frozen: discovery builds them once and no later pass assigns into them (tests/test_no_rematch.py checks it). What
the emission builds in their place (the fused attention op, the gate, the MLP's If) is its own record
(passes/context.py: AttentionOp, LayerRewrite), not written into the match.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx_ir as ir

from fastcar_compile.passes import genai_gqa
from fastcar_compile.passes import graph_utils as gu
from fastcar_compile.passes.match_base import MatchFailure


@dataclass(frozen=True)
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
    form: str = ""  # which attention matcher matched
    # The keys attention reads: the present key, or for a sliding-window cache the unsliced keys it was cut from.
    keys: ir.Value | None = None
    stream_in: ir.Value | None = None  # the residual stream value the block starts from (set by the residual form)
    window: int | None = None  # positions a sliding-window cache keeps (None: the whole context, or unknown)
    # GroupQueryAttention on packed QKV or rotating inside: the gate rebuilds q from the op's query input
    packed_query: genai_gqa.PackedQuery | None = None
    rope_refusal: str | None = None  # why `rope` TAS cannot be read in this layer (None: it can)
    # GroupQueryAttention's total_sequence_length: its key buffer may be preallocated (longer than the tokens)
    total_len: ir.Value | None = None

    @property
    def sliding_window(self) -> bool:
        return self.keys is not None and self.keys is not self.present_key

    def nodes(self, output: ir.Value | None = None) -> set[ir.Node]:
        """Norm, projections, rotary, KV concat and attention: nodes between the incoming stream and the join.
        `output`: the attention's output as emitted when an op built in place of the core computes it now."""
        if self.join is None:
            return set()
        out = self.core_output if output is None else output
        attn_in = [i for i in self.join.inputs[:2] if i is not None and gu.depends_on(i, out)]
        stream_in = [i for i in self.join.inputs[:2] if i is not None and i not in attn_in]
        if self.stream_in is not None:
            stream_in = [self.stream_in]
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


@dataclass(frozen=True)
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
    form: str = ""  # which residual matcher matched


@dataclass(frozen=True)
class LayerMatch:
    layer: int
    attention: AttentionBlock | None = None
    mlp: MLPBlock | None = None
    failure: MatchFailure | None = None
    trace: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.failure is None and self.attention is not None and self.mlp is not None
