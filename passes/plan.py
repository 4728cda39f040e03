"""The compile plan: per block, the forms discovery found and what the emission passes build from them.

Discovery (passes/discover.py) matches the export once; `plan_blocks` turns its matches and the options into one
frozen `DecoderLayerPlan` per KV-cache layer: the attention, rotary, residual and MLP forms found, the op the
attention becomes, the KV cache mode and its settings, the TemporalGate form emitted, how the query is packed,
where the MLP rows are selected and the layer's tau. The emission passes decide from it (never from the ai.fastcar nodes an earlier
pass built), and `--inspect -v` / `--verbose` print it.

A new block kind is a new frozen dataclass deriving from `BlockPlan` with its own fields (the DiT target's is
passes/dit_plan.DiTBlockPlan): `BlockPlan.lines` prints every field, or what the subclass's `shown` says.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import onnx_ir as ir

from fastcar_compile.core import contract
from fastcar_compile.passes import native_gqa
from fastcar_compile.passes.attention_form import NONE, AttentionForm, Forms
from fastcar_compile.passes.layer_match import LayerMatch

CompileOptions = Any  # passes/context.py's CompileOptions (which imports this module for the Plan it holds)

# What the attention becomes (`attention_op`).
AS_EXPORTED = "as exported"
FASTCAR_ATTENTION = f"{contract.DOMAIN}.{contract.COMPRESSED_ATTENTION}"
MS_GQA = f"{contract.MS_DOMAIN}.{contract.GROUP_QUERY_ATTENTION}"
FASTCAR_GQA = f"{contract.DOMAIN}.{contract.GROUP_QUERY_ATTENTION}"


@dataclass(frozen=True)
class KvPlan:
    """A layer's KV cache: `dense` (every position kept) or `compressed` with its settings (fastar.KVCompressConfig
    as the fused attention's describe() says it)."""

    mode: str = "dense"
    settings: str = ""

    def __str__(self) -> str:
        return f"{self.mode} ({self.settings})" if self.settings else self.mode


@dataclass(frozen=True)
class BlockPlan:
    """One block of the model: its index, whether discovery matched it, and whether the compile rewrites it."""

    layer: int
    matched: bool
    rewrite: bool

    def shown(self) -> list[tuple[str, object]]:
        """(label, value) of each line under the head: every field (a subclass's new fields print with no change
        here; one whose fields are decisions rather than text says how to show them by overriding this)."""
        return [(f.name.replace("_", " "), getattr(self, f.name)) for f in dataclasses.fields(self)
                if f.name not in ("layer", "matched", "rewrite")]

    def lines(self) -> list[str]:
        """`layer N: rewrite|matched|not matched`, then one line per shown field."""
        head = f"layer {self.layer:>3}: " + ("rewrite" if self.rewrite else "matched" if self.matched else
                                              "not matched")
        return [head] + [f"  {label}: {_text(value)}" for label, value in self.shown()]


def gate_text(form: contract.GateForm) -> str:
    """'TemporalGate [use_total_len, packed_qkv, ...]': the form's variant attributes that are set."""
    on = [f.name for f in dataclasses.fields(form) if getattr(form, f.name)]
    return "TemporalGate" + (f" [{', '.join(on)}]" if on else " [plain]")


def _text(value: object) -> str:
    if isinstance(value, contract.GateForm):
        return gate_text(value)
    return "-" if value is None or value == "" else str(value)


@dataclass(frozen=True)
class DecoderLayerPlan(BlockPlan):
    """A decoder layer: attention (-> KV cache, gate) then a residual MLP branch (-> the replayed rows)."""

    attention: str = ""  # discovery's attention form and op
    attention_op: str = AS_EXPORTED  # what the attention becomes (AS_EXPORTED, FASTCAR_ATTENTION, MS_GQA, ...)
    rotary: str = ""
    residual: str = ""  # how the MLP branch joins the stream (discovery's residual form)
    mlp: str = ""
    kv: KvPlan = KvPlan()
    gate: contract.GateForm | None = None  # the TemporalGate form emitted (None: the layer is not rewritten)
    tas_query: str = ""  # the query TAS reads: rope (after the rotary) or raw
    threshold: str = ""  # the layer's tau as compiled in (its entry of fastcar_threshold with per-layer thresholds)
    packing: str = "-"  # how q/k/v reach the attention and the gate
    row_selection: str = "-"  # where the MLP's computing rows are selected


@dataclass(frozen=True)
class Plan:
    """Every block's plan, in layer order."""

    blocks: tuple[BlockPlan, ...] = ()

    def __getitem__(self, layer: int) -> BlockPlan:
        return next(b for b in self.blocks if b.layer == layer)

    def lines(self) -> list[str]:
        return [line for block in self.blocks for line in block.lines()]


def _tas_query(opts: CompileOptions | None, rope: str) -> str:
    """The query TAS reads, as the layer has it: on a layer without a rotary (NoPE, learned positions) 'rope' and
    'raw' are the same query, and the plan says so instead of naming a rotary the layer lacks."""
    asked = opts.tas_query if opts is not None else contract.TAS_ROPE
    if rope == "none":
        return f"{asked} = raw: no rotary on this layer, TAS reads the query as the attention does"
    return asked


def fused_op(opts: CompileOptions | None, fusion: dict) -> str:
    """The op a fused layer's attention is emitted as (`fusion`: what fused_attention.fusable found for it): the
    fastcar op, or with `--fused-attention gqa` ai.fastcar's GroupQueryAttention (--native-attention on, float32:
    the native kernel's subset, which the emitted form always is otherwise) or com.microsoft's."""
    if opts is not None and opts.fused_attention == "fastcar":
        return FASTCAR_ATTENTION
    native = opts is None or opts.native_attention
    return FASTCAR_GQA if native and fusion["present_k"].dtype in (None, ir.DataType.FLOAT) else MS_GQA


def _attention_op(m: LayerMatch, opts: CompileOptions | None, fused: dict[int, dict]) -> str:
    att = m.attention
    native = opts is None or opts.native_attention  # NativeGqaPass: the export's com.microsoft op -> ai.fastcar's
    if m.layer in fused:
        return fused_op(opts, fused[m.layer])
    if att is not None and native_gqa.is_ms_gqa(att.core_node):
        return FASTCAR_GQA if native and native_gqa.unsupported(att.core_node) is None else MS_GQA
    return AS_EXPORTED


def _gate(m: LayerMatch, opts: CompileOptions | None, op: str, kv: KvPlan, form: AttentionForm) -> contract.GateForm:
    att = m.attention
    assert att is not None
    rows = opts is None or opts.shared_mlp
    if att.packed_query is not None:  # GroupQueryAttention on packed QKV or rotating inside
        rope = (opts is None or opts.tas_query == contract.TAS_ROPE) and att.packed_query.cos_cache is not None
        return contract.GateForm(use_total_len=True, packed_qkv=True, do_rotary=rope, select_rows=rows)
    if form.packed_gate:  # a fused op reading [B, S, H*D] q/k/v: the query packed, rotated by the gate when RoPE
        # moved into the op
        return contract.GateForm(use_total_len=True, packed_qkv=True, do_rotary=form.packing is not None,
                                 select_rows=rows)
    if kv.mode != "dense":
        return contract.GateForm(use_total_len=True, aligned_keys=True)
    total = att.total_len is not None or op in (FASTCAR_ATTENTION, MS_GQA, FASTCAR_GQA)
    return contract.GateForm(use_total_len=total)


def _packing(m: LayerMatch, form: AttentionForm, forms: Forms | None) -> str:
    att = m.attention
    assert att is not None
    if att.packed_query is not None:
        return "packed QKV " + ("with the rotary in the op" if att.packed_query.cos_cache is not None else "as exported")
    left = f" (not packed: {form.left})" if form.left else ""
    if form.packing is not None:
        return f"one QKV MatMul, RoPE inside the op (cos/sin table of {forms.positions} positions)"
    if form.layout is not None:
        return "[B, S, H*D] q/k/v into the op, no head-split Reshape/Transpose" + left
    return f"separate q/k/v, query as {att.q_layout}" + left


def _threshold(opts: CompileOptions | None, index: int) -> str:
    """The compiled-in tau of the rewritten layer at `index` (its position among the rewritten layers)."""
    if opts is None:
        return ""
    if not opts.per_layer_threshold:
        return f"{opts.threshold[0]:g}"
    return f"{opts.threshold[index if len(opts.threshold) > 1 else 0]:g} ({contract.THRESHOLD}[{index}])"


def plan_blocks(matches: list[LayerMatch], selected: list[int], opts: CompileOptions | None,
                fused: dict[int, dict] | None = None, kv: dict[int, str] | None = None,
                forms: Forms | None = None) -> Plan:
    """The plan for discovery's `matches`: `selected` layers rewritten, `fused` layers' attention replaced by the
    fused op (layer -> what fused_attention.fusable found), `kv` = layer -> settings text of its compressed cache,
    `forms` = how each fused op is built (attention_form.decide). opts None: the defaults."""
    blocks: list[BlockPlan] = []
    for m in matches:
        att, mlp = m.attention, m.mlp
        if not m.ok or att is None or mlp is None:
            blocks.append(DecoderLayerPlan(m.layer, False, False))
            continue
        op = _attention_op(m, opts, fused or {})
        cache = KvPlan("compressed", kv[m.layer]) if kv and m.layer in kv else KvPlan()
        rewrite = m.layer in selected
        form = forms[m.layer] if forms is not None else NONE
        gate = _gate(m, opts, op, cache, form) if rewrite else None
        rows = "-" if not rewrite else "in the gate (select_rows)" if gate.select_rows else \
            "SelectRows, one MLP under an If" if opts is None or opts.shared_mlp else "nested If (older layout)"
        mlp_text = (f"{len(mlp.nodes)} nodes, hidden {mlp.hidden}, weights {mlp.weights}" +
                    (", norm fused with the residual Add" if mlp.fused_norm else ""))
        blocks.append(DecoderLayerPlan(
            m.layer, True, rewrite,
            attention=f"{att.form or 'matched'}: {att.core_node.domain or 'ai.onnx'}.{att.core_node.op_type}, heads "
                      f"{att.num_heads}/{att.num_kv_heads}x{att.head_dim}" +
                      (f", sliding window {att.window or '?'}" if att.sliding_window else ""),
            attention_op=op, rotary=att.rope + (f" (rope TAS refused: {att.rope_refusal})" if att.rope_refusal else ""),
            residual=mlp.form, mlp=mlp_text, kv=cache, gate=gate,
            tas_query=_tas_query(opts, att.rope) if rewrite else "",
            threshold=_threshold(opts, selected.index(m.layer)) if rewrite else "",
            packing=_packing(m, form, forms) if m.layer in (fused or {}) or rewrite else "-", row_selection=rows))
    return Plan(tuple(blocks))
