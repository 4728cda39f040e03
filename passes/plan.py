"""The compile plan: per block, the forms discovery found and the decisions the emission builds from.

Discovery (passes/discover.py) matches the export once; `plan_blocks` turns its matches and the options into one
frozen `DecoderLayerPlan` per KV-cache layer, whose decisions are typed fields: the op the attention becomes and,
when fused, what the op reads (`attention_form.Fusion`) and the form of its inputs (layout, packed QKV with its
rotary table), the KV cache's settings (fastar.KVCompressConfig, None: dense), the TemporalGate form, the query TAS
reads, the layer's tau and where the MLP rows are selected. The emission passes read these fields (never the
ai.fastcar nodes an earlier pass built), and `--inspect -v` / `--verbose` print them (`shown`).

A new block kind is a new frozen dataclass deriving from `BlockPlan` with its own fields (the DiT target's is
passes/dit_plan.DiTBlockPlan): `BlockPlan.lines` prints every field, or what the subclass's `shown` says.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import onnx_ir as ir

from fastcar_compile.core import contract
from fastcar_compile.passes import native_gqa
from fastcar_compile.passes.attention_form import NONE, AttentionForm, Fusion
from fastcar_compile.passes.layer_match import LayerMatch

if TYPE_CHECKING:
    from fastcar_compile.fastar.config import KVCompressConfig

CompileOptions = Any  # passes/context.py's CompileOptions (which imports this module for the Plan it holds)

# What the attention becomes (`attention_op`).
AS_EXPORTED = "as exported"
FASTCAR_ATTENTION = f"{contract.DOMAIN}.{contract.COMPRESSED_ATTENTION}"
MS_GQA = f"{contract.MS_DOMAIN}.{contract.GROUP_QUERY_ATTENTION}"
FASTCAR_GQA = f"{contract.DOMAIN}.{contract.GROUP_QUERY_ATTENTION}"


class Rows(enum.Enum):
    """Where a rewritten layer's MLP rows that compute are selected (the value is what the plan prints)."""

    IN_GATE = "in the gate (select_rows)"  # the packed TemporalGate selects them (GateForm.select_rows)
    SELECT_ROWS = "SelectRows, one MLP under an If"  # the shared MLP layout
    NESTED = "nested If (older layout)"  # shared_mlp=False


@dataclass(frozen=True)
class KvPlan:
    """How a block's KV cache prints: `dense` (every position kept) or `compressed` with its settings."""

    mode: str = "dense"
    settings: str = ""

    def __str__(self) -> str:
        return f"{self.mode} ({self.settings})" if self.settings else self.mode


def kv_text(cfg: KVCompressConfig) -> str:
    """A compressed cache's settings (fastar.KVCompressConfig) in one line: the plan's `kv` and the compile's notes."""
    parts = [f"budget {cfg.budget}, sinks {cfg.sinks}, window {cfg.window}, eviction {cfg.eviction}"]
    if cfg.tempcache_sim is not None:
        parts.append(f"TempCache {cfg.tempcache_sim:g}")
    if cfg.lsh_bits:
        parts.append(f"AnnSA lsh {cfg.lsh_bits}x{cfg.lsh_tables}")
    if cfg.int8_dirs:
        parts.append(f"AnnSA int8 {cfg.int8_dirs}x{cfg.int8_tables}")
    if cfg.prune_prompt is not None:
        parts.append(f"prompt pruning {cfg.prune_prompt:g}")
    return ", ".join(parts)


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
    if isinstance(value, Rows):
        return value.value
    return "-" if value is None or value == "" else str(value)


@dataclass(frozen=True)
class DecoderLayerPlan(BlockPlan):
    """A decoder layer: attention (-> KV cache, gate) then a residual MLP branch (-> the replayed rows). `match` is
    discovery's (frozen; its forms are printed), the other fields are the decisions the emission reads."""

    match: LayerMatch | None = field(default=None, compare=False, repr=False)
    attention_op: str = AS_EXPORTED  # what the attention becomes (AS_EXPORTED, FASTCAR_ATTENTION, MS_GQA, ...)
    fusion: Fusion | None = None  # what the fused op reads and replaces (None: the export's attention op stays)
    form: AttentionForm = NONE  # the fused op's inputs: [B, S, H*D] layout, packed QKV with RoPE in the op
    kv: KVCompressConfig | None = None  # the compressed cache's settings (None: dense)
    gate: contract.GateForm | None = None  # the TemporalGate form emitted (None: the layer is not rewritten)
    tas_query: str | None = None  # the query TAS reads: contract.TAS_ROPE (after the rotary) or TAS_RAW
    threshold: float | None = None  # the layer's tau as compiled in
    threshold_index: int | None = None  # its entry of fastcar_threshold (--per-layer-threshold), else None
    rows: Rows | None = None  # where the MLP's computing rows are selected

    def shown(self) -> list[tuple[str, object]]:
        m = self.match if self.matched else None
        att, mlp = (m.attention, m.mlp) if m is not None else (None, None)
        tau = None if self.threshold is None else f"{self.threshold:g}" + (
            "" if self.threshold_index is None else f" ({contract.THRESHOLD}[{self.threshold_index}])")
        return [("attention", _attention_text(att) if att is not None else None),
                ("attention op", self.attention_op),
                ("rotary", att.rope + (f" (rope TAS refused: {att.rope_refusal})" if att.rope_refusal else "")
                 if att is not None else None),
                ("residual", mlp.form if mlp is not None else None),
                ("mlp", f"{len(mlp.nodes)} nodes, hidden {mlp.hidden}, weights {mlp.weights}" +
                 (", norm fused with the residual Add" if mlp.fused_norm else "") if mlp is not None else None),
                ("kv", KvPlan("compressed", kv_text(self.kv)) if self.kv is not None else KvPlan()),
                ("gate", self.gate), ("tas query", _tas_query(self.tas_query, att)), ("threshold", tau),
                ("packing", self._packing()), ("row selection", self.rows)]

    def _packing(self) -> str | None:
        """How q/k/v reach the attention and the gate (fused or rewritten layers)."""
        att = self.match.attention if self.match is not None else None
        if att is None or (self.fusion is None and not self.rewrite):
            return None
        if att.packed_query is not None:
            return "packed QKV " + ("with the rotary in the op" if att.packed_query.cos_cache is not None else
                                    "as exported")
        form = self.form
        left = f" (not packed: {form.left})" if form.left else ""
        if form.packing is not None:
            return (f"one QKV MatMul, RoPE inside the op (cos/sin table of {form.packing.table.positions} "
                    "positions)")
        if form.layout is not None:
            return "[B, S, H*D] q/k/v into the op, no head-split Reshape/Transpose" + left
        return f"separate q/k/v, query as {att.q_layout}" + left


def _tas_query(asked: str | None, att) -> str | None:
    """The query TAS reads (`asked`: the plan's tas_query), as the layer has it: on a layer without a rotary (NoPE,
    learned positions) 'rope' and 'raw' are the same query, and the plan says so instead of naming a rotary the
    layer lacks."""
    if asked is not None and att is not None and att.rope == "none":
        return f"{asked} = raw: no rotary on this layer, TAS reads the query as the attention does"
    return asked


def _attention_text(att) -> str:
    core = att.core_node
    return (f"{att.form or 'matched'}: {core.domain or 'ai.onnx'}.{core.op_type}, heads "
            f"{att.num_heads}/{att.num_kv_heads}x{att.head_dim}" +
            (f", sliding window {att.window or '?'}" if att.sliding_window else ""))


@dataclass(frozen=True)
class Plan:
    """Every block's plan, in layer order."""

    blocks: tuple[BlockPlan, ...] = ()

    def __getitem__(self, layer: int) -> BlockPlan:
        return next(b for b in self.blocks if b.layer == layer)

    def lines(self) -> list[str]:
        return [line for block in self.blocks for line in block.lines()]


@dataclass(frozen=True)
class DecoderPlan(Plan):
    """A decoder's plan: one DecoderLayerPlan per KV-cache layer."""

    blocks: tuple[DecoderLayerPlan, ...] = ()

    def __getitem__(self, layer: int) -> DecoderLayerPlan:
        return next(b for b in self.blocks if b.layer == layer)

    @property
    def fused(self) -> list[DecoderLayerPlan]:
        """The layers whose attention the fused op replaces, in layer order."""
        return [b for b in self.blocks if b.fusion is not None]

    @property
    def compressed(self) -> dict[int, KVCompressConfig]:
        """Layer -> its compressed cache's settings."""
        return {b.layer: b.kv for b in self.blocks if b.kv is not None}

    @property
    def rotary_positions(self) -> int | None:
        """Positions of the rotary table the packed layers rotate with (None: no layer packed)."""
        return next((b.form.packing.table.positions for b in self.blocks if b.form.packing is not None), None)


def fused_op(opts: CompileOptions | None, fusion: Fusion) -> str:
    """The op a fused layer's attention is emitted as (`fusion`: what fused_attention.fusable found for it): the
    fastcar op, or with `--fused-attention gqa` ai.fastcar's GroupQueryAttention (--native-attention on, float32:
    the native kernel's subset, which the emitted form always is otherwise) or com.microsoft's."""
    if opts is not None and opts.fused_attention == "fastcar":
        return FASTCAR_ATTENTION
    native = opts is None or opts.native_attention
    return FASTCAR_GQA if native and fusion.present_k.dtype in (None, ir.DataType.FLOAT) else MS_GQA


def _attention_op(m: LayerMatch, opts: CompileOptions | None, fusion: Fusion | None) -> str:
    att = m.attention
    native = opts is None or opts.native_attention  # NativeGqaPass: the export's com.microsoft op -> ai.fastcar's
    if fusion is not None:
        return fused_op(opts, fusion)
    if att is not None and native_gqa.is_ms_gqa(att.core_node):
        return FASTCAR_GQA if native and native_gqa.unsupported(att.core_node) is None else MS_GQA
    return AS_EXPORTED


def _gate(m: LayerMatch, opts: CompileOptions | None, op: str, kv: KVCompressConfig | None,
          form: AttentionForm) -> contract.GateForm:
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
    if kv is not None:
        return contract.GateForm(use_total_len=True, aligned_keys=True)
    total = att.total_len is not None or op in (FASTCAR_ATTENTION, MS_GQA, FASTCAR_GQA)
    return contract.GateForm(use_total_len=total)


def _threshold(opts: CompileOptions | None, index: int) -> tuple[float | None, int | None]:
    """The compiled-in tau of the rewritten layer at `index` (its position among the rewritten layers) and, with
    per-layer thresholds, its entry of fastcar_threshold."""
    if opts is None:
        return None, None
    if not opts.per_layer_threshold:
        return opts.threshold[0], None
    return opts.threshold[index if len(opts.threshold) > 1 else 0], index


def _rows(gate: contract.GateForm, opts: CompileOptions | None) -> Rows:
    if gate.select_rows:
        return Rows.IN_GATE
    return Rows.SELECT_ROWS if opts is None or opts.shared_mlp else Rows.NESTED


def plan_blocks(matches: list[LayerMatch], selected: list[int], opts: CompileOptions | None,
                fusions: dict[int, Fusion] | None = None, forms: dict[int, AttentionForm] | None = None
                ) -> DecoderPlan:
    """The plan for discovery's `matches`: `selected` layers rewritten, `fusions` layers' attention replaced by the
    fused op (layer -> what fused_attention.fusable found), built in `forms` (attention_form.decide; absent: the
    plain form), with the compressed cache the options give a fused layer (`--fused-attention fastcar`). opts None:
    the defaults."""
    fusions, forms = fusions or {}, forms or {}
    fastcar = opts is not None and opts.fused_attention == "fastcar"
    blocks: list[DecoderLayerPlan] = []
    for m in matches:
        fusion = fusions.get(m.layer)
        kv = opts.kv_config(m.layer) if fastcar and fusion is not None else None
        op = _attention_op(m, opts, fusion)
        form = forms.get(m.layer, NONE)
        if not m.ok or m.attention is None or m.mlp is None:  # an unmatched layer's attention may still be fused
            blocks.append(DecoderLayerPlan(m.layer, False, False, m, op if fusion is not None else AS_EXPORTED,
                                           fusion, form, kv))
            continue
        rewrite = m.layer in selected
        gate = _gate(m, opts, op, kv, form) if rewrite else None
        tau, index = _threshold(opts, selected.index(m.layer)) if rewrite else (None, None)
        blocks.append(DecoderLayerPlan(
            m.layer, True, rewrite, m, attention_op=op, fusion=fusion, form=form, kv=kv, gate=gate,
            tas_query=(opts.tas_query if opts is not None else contract.TAS_ROPE) if rewrite else None,
            threshold=tau, threshold_index=index, rows=_rows(gate, opts) if gate is not None else None))
    return DecoderPlan(tuple(blocks))
