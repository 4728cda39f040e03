"""The contract between the compiler, the runtime and the backends, in code (docs/DESIGN.md describes it).

Every name the compiler writes into fast.onnx and every reader needs is defined here once: the exporter's
KV-cache naming, the FastCar state inputs/outputs, the `ai.fastcar` op names and version, the TAS query
variants, the node tags, and the `fastcar.*` metadata schema (`FastCarMetadata`, with symmetric
`to_props`/`from_props`). The compiler writes through it; `runtime/`, `fpga_backend/` and calibration read
through it, so a renamed key cannot leave a reader behind. tests/test_contract.py checks DESIGN.md's tables
against this module.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fastcar_compile.core.errors import FastCarError
from fastcar_compile.core.limits import INT8_DIRS, MAX_ANN_TABLES, MAX_LSH_BITS, UINT32_MAX

# --- exporter I/O (docs/semantics.md section 4) ---------------------------------------------------------
INPUT_IDS, ATTENTION_MASK, POSITION_IDS, LOGITS = "input_ids", "attention_mask", "position_ids", "logits"
KV_KINDS = ("key", "value")
KV_INPUT_RE = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")

# Exporters write present.N.key; some write present_N_key: discovery accepts both separators.
KV_OUTPUT_RE = re.compile(r"^present[._](\d+)[._](key|value)$")


def kv_layer_of(input_name: str) -> int | None:
    """past_key_values.N.key|value -> N (None for other inputs)."""
    m = KV_INPUT_RE.match(input_name)
    return int(m.group(1)) if m else None


def kv_input(layer: int, kind: str) -> str:
    return f"past_key_values.{layer}.{kind}"


def kv_output(layer: int, kind: str) -> str:
    return f"present.{layer}.{kind}"


def io_names(num_layers: int) -> tuple[list[str], list[str]]:
    """Graph input and output names of a decoder with KV cache, as exporters are asked to write them."""
    ins = [INPUT_IDS, ATTENTION_MASK, POSITION_IDS]
    outs = [LOGITS]
    for i in range(num_layers):
        ins += [kv_input(i, k) for k in KV_KINDS]
        outs += [kv_output(i, k) for k in KV_KINDS]
    return ins, outs


# --- what the compiler adds ------------------------------------------------------------------------------------
VIDEO_START = "video_start"
THRESHOLD = "fastcar_threshold"
# Per-run values with a default: stored as initializers that are NOT graph inputs (ONNX Runtime warns on load about
# every initializer listed as an input), so a stock session runs with the defaults; FastCarSession loads them as
# plain inputs and feeds them (runtime/overridable.py). --required-video-inputs makes them plain inputs on disk.
OVERRIDABLE = (VIDEO_START, THRESHOLD)


def aligned_is_video(p: Any, frame_tokens: int, video_start: Any) -> Any:
    """Whether token p's aligned token p - L (the same spatial position one frame back) is a video token, i.e.
    p - L >= video_start (ints or arrays). The one rule for "one frame back" with a prompt prefix (docs/semantics.md
    section 1): the gate replays, TempCache merges and run stats count eligible steps only then (the native
    kernels and the ONNX function bodies state the same comparison)."""
    return p - frame_tokens >= video_start

STATE_INPUT_PREFIX, STATE_OUTPUT_PREFIX = "past_", "present_"
# State names carry no .key/.value suffix on purpose (optimum and onnxruntime-genai treat those as KV cache).


def mlp_cache_input(layer: int) -> str:
    return f"past_mlp_cache.{layer}"


def mlp_cache_output(layer: int) -> str:
    return f"present_mlp_cache.{layer}"


def mlp_age_input(layer: int) -> str:
    return f"past_mlp_age.{layer}"


def mlp_age_output(layer: int) -> str:
    return f"present_mlp_age.{layer}"


def kv_slots_input(layer: int) -> str:
    """Slot records of a compressed KV cache (CompressedAttention with a budget): [batch, kv_heads, C, F]."""
    return f"past_kv_slots.{layer}"


def kv_slots_output(layer: int) -> str:
    return f"present_kv_slots.{layer}"


def kv_rawkey_input(layer: int) -> str:
    """Pre-RoPE keys of a compressed KV cache's slots (TempCache compares them): [batch, kv_heads, C, D]."""
    return f"past_kv_rawkey.{layer}"


def kv_rawkey_output(layer: int) -> str:
    return f"present_kv_rawkey.{layer}"


def kv_dense_input(layer: int) -> str:
    """--kv-diagnostics: every token's key and value, dense attention on the side: [batch, kv_heads, M, 2 D]."""
    return f"past_kv_dense.{layer}"


def kv_dense_output(layer: int) -> str:
    return f"present_kv_dense.{layer}"


KV_STATS_PREFIX = "kv_stats."
KV_STATS_FIELDS = ("executed", "dense", "recall_sum", "queries")  # kv_stats.N's last axis, in order


def kv_stats_output(layer: int) -> str:
    """--kv-diagnostics: this step's [executed q.k pairs, dense pairs, recall sum, queries] per row and KV head."""
    return f"{KV_STATS_PREFIX}{layer}"


def replay_mask_output(layer: int) -> str:
    return f"replay_mask.{layer}"


def tas_output(layer: int) -> str:
    return f"tas.{layer}"


def state_output_for(input_name: str) -> str:
    """The output that carries a `past_*` input to the next step: KV pairs by the exporter's rule, FastCar
    state by swapping the prefix (the metadata's `fastcar.state` says the same for compiled models)."""
    m = KV_INPUT_RE.match(input_name)
    if m:
        return kv_output(int(m.group(1)), m.group(2))
    if not input_name.startswith(STATE_INPUT_PREFIX):
        raise ValueError(f"{input_name} is not a state input (no {STATE_INPUT_PREFIX!r} prefix)")
    return STATE_OUTPUT_PREFIX + input_name[len(STATE_INPUT_PREFIX):]


# New-video fill values of the FastCar state (DESIGN.md: caches start at 0, ages at -1 = never written).
CACHE_FILL, AGE_FILL = 0, -1

# The ONNX Runtime execution provider a model is compiled for: cpu (the ai.fastcar ops, native kernels when built) or
# cuda (only ops the CUDA provider runs: the ai.fastcar ops' function bodies inlined, passes/cuda_target.py),
# recorded under PROVIDER_KEY when not cpu.
PROVIDERS = ("cpu", "cuda")
PROVIDER_KEY = "fastcar.provider"

# --- the ai.fastcar ops ---------------------------------------------------------------------------------------
DOMAIN = "ai.fastcar"
MS_DOMAIN = "com.microsoft"  # ONNX Runtime contrib ops the passes emit (GQA, RotaryEmbedding, norms)
OPSET_VERSION = 1
TEMPORAL_GATE, MLP_CACHE_READ, MLP_CACHE_UPDATE = "TemporalGate", "MLPCacheRead", "MLPCacheUpdate"
COMPRESSED_ATTENTION = "CompressedAttention"  # fused in-place attention (+ FAST-AR compressed KV modes)
# com.microsoft.GroupQueryAttention's drop-in with the native dense core (passes/native_gqa.py; body: the original op)
GROUP_QUERY_ATTENTION = "GroupQueryAttention"
# BranchPass's row ops around the one MLP copy (passes/branch.py): the computing tokens' rows and the If condition,
# then the write-back that merges the computed rows with the cached ones and updates the cache (MLPCacheUpdate)
SELECT_ROWS, MLP_CACHE_MERGE = "SelectRows", "MLPCacheMerge"
# AnnSA over a DiT's frame cache, each query scoring only its buckets' slots (passes/dit_annsa.py; body: masked dense)
ANNSA_ATTENTION = "AnnSAAttention"
# Attention over listed cache slots with a per-slot bias (TempCache's resident slots and log(count)): the work follows
# the slots listed, not the buffer's size (runtime/native/slot_attention.h; body: masked dense)
SLOT_ATTENTION = "SlotAttention"
OP_NAMES = (TEMPORAL_GATE, MLP_CACHE_READ, MLP_CACHE_UPDATE, COMPRESSED_ATTENTION, GROUP_QUERY_ATTENTION,
            SELECT_ROWS, MLP_CACHE_MERGE, ANNSA_ATTENTION, SLOT_ATTENTION)

# TemporalGate's inputs and outputs in order; a form uses the first four outputs (seven when packed, eight when it
# selects rows) and the inputs it names (the rest are left empty).
GATE_INPUTS = ("q", "key", "past_mlp_age", "threshold", "video_start", "total_len", "past_mlp_cache", "cos_cache",
               "sin_cache", "mlp_input")
GATE_OUTPUTS = ("replay", "tas", "slot", "write", "cached", "compute_all", "compute_some", "rows")


@dataclass(frozen=True)
class GateForm:
    """Which TemporalGate: one op whose variant attributes (0/1) say what its inputs are and what it also does.

    use_total_len: token positions from total_len (GroupQueryAttention's total_sequence_length), not the key
    buffer's length (onnxruntime-genai's preallocated shared buffer). aligned_keys: `key` holds each new token's
    aligned key already (CompressedAttention's output with a compressed cache, which has no K[p - L] row).
    packed_qkv: the query is the first num_heads * head_dim channels of [B, S, >= H D] (a packed projection or a
    GroupQueryAttention query), taus are indexed by threshold_index, and the op also outputs the slots' cached MLP
    rows and the branch's two If conditions (the layer's whole main-graph gate in one launch). do_rotary: the op
    rotates that query slice (TAS `rope`) at KV index total_len - S + i with cos_cache/sin_cache.
    select_rows: it also outputs SelectRows(mlp_input) on its own decision. The ONNX function body of each form is
    the overload named `overload` (passes/fastcar_ops.py); the native kernel reads the attributes."""

    use_total_len: bool = False
    aligned_keys: bool = False
    packed_qkv: bool = False
    do_rotary: bool = False
    select_rows: bool = False

    def __post_init__(self) -> None:
        if (self.aligned_keys or self.packed_qkv) and not self.use_total_len:
            raise ValueError("internal: aligned_keys and packed_qkv take positions from total_len")
        if (self.do_rotary or self.select_rows) and not self.packed_qkv:
            raise ValueError("internal: do_rotary and select_rows are forms of the packed gate")
        if self.aligned_keys and self.packed_qkv:
            raise ValueError("internal: the packed gate reads K[p - L] from the dense cache")

    @property
    def attributes(self) -> dict[str, int]:
        """The variant attributes a node of this form carries (all of them, 0 or 1)."""
        return {f.name: int(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @property
    def overload(self) -> str:
        """The function overload holding this form's body ("" for the plain form: no IR version 10 needed)."""
        return "_".join(f.name for f in dataclasses.fields(self) if getattr(self, f.name))

    @property
    def num_outputs(self) -> int:
        return 8 if self.select_rows else 7 if self.packed_qkv else 4

    @classmethod
    def of(cls, attributes: Mapping[str, Any]) -> GateForm:
        """The form a node's attributes name (`attributes`: name -> int; absent = 0)."""
        return cls(**{f.name: bool(attributes.get(f.name, 0)) for f in dataclasses.fields(cls)})


GATE_FORM_ATTRIBUTES = tuple(f.name for f in dataclasses.fields(GateForm))
GATE_FORMS = (GateForm(), GateForm(use_total_len=True), GateForm(use_total_len=True, aligned_keys=True),
              *(GateForm(use_total_len=True, packed_qkv=True, do_rotary=r, select_rows=s)
                for r in (False, True) for s in (False, True)))
# The op names models compiled before the one gate op used for its forms, with their inputs in order (TemporalGate
# itself was the plain form, unchanged). The native library registers each onto the one kernel
# (runtime/native/fastcar_ops.cc restates this table), so such models keep loading and run as before.
_PACKED_OLD = ("q", "key", "past_mlp_age", "past_mlp_cache", "threshold", "video_start", "total_len")
LEGACY_GATE_OPS: dict[str, tuple[GateForm, tuple[str, ...]]] = {
    "TemporalGateAt": (GATE_FORMS[1], GATE_INPUTS[:6]),
    "TemporalGateAligned": (GATE_FORMS[2], GATE_INPUTS[:6]),
    "TemporalGatePacked": (GATE_FORMS[3], _PACKED_OLD),
    "TemporalGatePackedRows": (GATE_FORMS[4], (*_PACKED_OLD, "mlp_input")),
    "TemporalGatePackedRope": (GATE_FORMS[5], (*_PACKED_OLD, "cos_cache", "sin_cache")),
    "TemporalGatePackedRopeRows": (GATE_FORMS[6], (*_PACKED_OLD, "cos_cache", "sin_cache", "mlp_input")),
}

# Attributes per op (tests/test_contract.py checks these against DESIGN.md and the function bodies).
# `age_offset` (default 0): the stored age is age + age_offset (onnxruntime-genai zero-fills its recurrent state,
# so genai graphs store age + 1 and 0 means "never written").
OP_ATTRIBUTES: dict[str, tuple[str, ...]] = {
    TEMPORAL_GATE: ("frame_tokens", "max_replay", "age_offset", "num_heads", "threshold_index",
                    "rotary_embedding_dim", "interleaved", *GATE_FORM_ATTRIBUTES),
    MLP_CACHE_READ: (),
    MLP_CACHE_UPDATE: ("age_offset",),
    COMPRESSED_ATTENTION: ("num_heads", "kv_num_heads", "scale", "budget", "sinks", "window", "frame_tokens",
                           "tempcache_sim", "eviction", "lsh_bits", "lsh_tables", "lsh_planes", "int8_dirs",
                           "int8_tables", "int8_planes", "prune_prompt", "qkv_perm", "do_rotary", "rotary_interleaved"),
    GROUP_QUERY_ATTENTION: ("num_heads", "kv_num_heads", "scale", "do_rotary", "rotary_interleaved"),
    SELECT_ROWS: (),
    MLP_CACHE_MERGE: ("age_offset",),
    ANNSA_ATTENTION: (),
    SLOT_ATTENTION: (),
}

# --- TAS variants and node tags -------------------------------------------------------------------------------
TAS_ROPE, TAS_RAW = "rope", "raw"
TAS_QUERIES = (TAS_ROPE, TAS_RAW)  # rope: q as attention uses it (default); raw: before RoPE (released code)
# --- speculative decoding drafts (runtime/speculate.py) --------------------------------------------------------
# temporal: the token at the same position one frame back; ngram: the continuation of the latest earlier match of
# the last tokens (prompt lookup); temporal+ngram: temporal where a previous frame exists, n-gram before it
DRAFT_TEMPORAL, DRAFT_NGRAM, DRAFT_BOTH = "temporal", "ngram", "temporal+ngram"
DRAFT_KINDS = (DRAFT_TEMPORAL, DRAFT_NGRAM, DRAFT_BOTH)
TAG_LAYER, TAG_PART = "fastcar.layer", "fastcar.part"
PARTS = ("attention", "mlp", "norm", "gate", "cache")

META_PREFIX = "fastcar."


def check_tas_query(value: str) -> str:
    if value not in TAS_QUERIES:
        raise FastCarError(f"--tas-query must be one of {TAS_QUERIES}, got {value!r}")
    return value


def check_thresholds(values: Any, what: str = "--threshold") -> np.ndarray:
    """tau as a float64 array (scalar or one per layer): any number or +-inf (TAS > +inf never replays,
    TAS > -inf always replays an eligible token); NaN is refused. The one place tau is validated."""
    try:
        arr = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError):
        raise FastCarError(f"{what} must be a number or a list of numbers, got {values!r}") from None
    if np.isnan(arr).any():
        raise FastCarError(f"{what} is NaN; give a number (TAS > threshold replays; +inf never replays)")
    big = arr[np.isfinite(arr) & (np.abs(arr) > np.finfo(np.float32).max)]
    if big.size:  # the model stores tau as float32: 1e39 would silently become inf while metadata says 1e39
        raise FastCarError(f"{what} {float(big[0]):g} is beyond float32 (|tau| <= 3.4e38), where the model stores "
                           "it; give a smaller number, or inf/-inf")
    return arr


# --- metadata_props schema --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StateEntry:
    """One FastCar state pair; `shape` is symbolic ("batch") or ints, `fill` its new-video value."""

    input: str
    output: str
    shape: tuple[int | str, ...]
    dtype: str
    fill: int

    def to_json(self) -> dict[str, Any]:
        return {"input": self.input, "output": self.output, "shape": list(self.shape), "dtype": self.dtype,
                "fill": self.fill}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> StateEntry:
        return cls(d["input"], d["output"], tuple(d["shape"]), d["dtype"], d.get("fill", 0))


@dataclass(frozen=True)
class KVEntry:
    input: str
    output: str

    def to_json(self) -> dict[str, Any]:
        return {"input": self.input, "output": self.output}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> KVEntry:
        return cls(d["input"], d["output"])


def _doc(text: str, encoding: str = "json") -> dict[str, str]:
    return {"doc": text, "encoding": encoding}


@dataclass
class FastCarMetadata:
    """The `fastcar.<field>` metadata_props of a compiled model (all values strings in the file)."""

    version: str = field(metadata=_doc("compiler version", "str"))
    frame_tokens: int = field(metadata=_doc("L, tokens per video frame"))
    threshold: float | list[float] = field(metadata=_doc("default tau (JSON number, or list with per_layer_threshold)"))
    per_layer_threshold: bool = field(metadata=_doc("`true`/`false`: fastcar_threshold is [num_rewritten_layers]"))
    layers: list[int] = field(metadata=_doc("JSON list of rewritten layer indices"))
    num_layers: int = field(metadata=_doc("decoder layers in the model"))
    tas_query: str = field(metadata=_doc("`rope` or `raw` (query after or before RoPE)", "str"))
    max_replay: int = field(metadata=_doc("K, drift guard (0 = unlimited)"))
    hidden_size: int = field(metadata=_doc("hidden size of the first rewritten layer"))
    num_heads: int = field(metadata=_doc("query heads"))
    num_kv_heads: int = field(metadata=_doc("KV heads"))
    head_dim: int = field(metadata=_doc("head dimension"))
    state: list[StateEntry] = field(metadata=_doc(
        'JSON list of `{"input", "output", "shape" (symbolic: "batch", ints), "dtype", "fill"}` for every '
        "FastCar state pair; fill is the new-video value (0 for caches, -1 for ages)"))
    kv: list[KVEntry] = field(metadata=_doc('JSON list of `{"input", "output"}` KV pairs'))
    diagnostics: bool = field(metadata=_doc("`true`/`false`: replay_mask.N / tas.N outputs present"))
    kv_compress: dict[str, Any] | None = field(default=None, metadata=_doc(
        "compressed KV cache settings (`fastar.KVCompressConfig` as JSON: budget, sinks, window, tempcache_sim, "
        "eviction, lsh_bits, lsh_tables, int8_dirs, int8_tables, prune_prompt, seed) plus `layers` and `diagnostics_tokens`; absent = dense KV. With a budget every KV "
        "input/output of those layers is [batch, kv_heads, budget, head_dim] (slots, not positions). Layers with "
        "different settings (--kv-layer): no top-level settings but `per_layer` {layer: settings}; "
        "read through kv_layer_settings()"))
    multi_token_decode: bool | None = field(default=None, metadata=_doc(
        "`true`: a decode step of 1 < S <= L tokens after the prefill decides replay per token as S single-token "
        "steps would (docs/DESIGN.md \"Semantics\"), so drafts can be verified in one step (docs/speculation.md); "
        "absent: compiled before that rule, its multi-token steps compute every MLP"))
    rotary_positions: int | None = field(default=None, metadata=_doc(
        "packed q/k/v with the rotary inside the attention op (--pack-qkv): those layers rotate at the KV index "
        "(the export's positions plus the row's left padding; RoPE scores and TAS `rope` see only position "
        "differences, so this equals the export's rotation while padding precedes a row's first real token), from a "
        "cos/sin table of this many positions; FastCarSession refuses attention_mask "
        "zeros after a row's first real token, explicit position_ids other than the real-token counts, and videos longer than the "
        "table (--rotary-positions, --pack-qkv off); absent = the export's rotation at the position_ids fed"))

    @staticmethod
    def key(name: str) -> str:
        return META_PREFIX + name

    def to_props(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and f.default is None:  # optional field not in use: absent, as in older models
                continue
            if f.name in ("state", "kv"):
                value = [v.to_json() for v in value]
            elif f.name == "threshold" and isinstance(value, tuple | list):
                value = [float(v) for v in value]
            out[self.key(f.name)] = value if f.metadata["encoding"] == "str" else json.dumps(value)
        return out

    @classmethod
    def from_props(cls, props: Mapping[str, str]) -> FastCarMetadata | None:
        """Parse a model's metadata; None for a model without FastCar metadata (a dense decoder)."""
        if cls.key("version") not in props:
            return None
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            key = cls.key(f.name)
            if key not in props and f.default is not dataclasses.MISSING:
                continue  # a field added later: older models simply lack it
            if key not in props:
                raise FastCarError(f"metadata lacks {key}; the model was compiled by another version, recompile it")
            text = props[key]
            if f.metadata["encoding"] == "str":
                values[f.name] = text
                continue
            try:
                values[f.name] = json.loads(text)
            except json.JSONDecodeError:
                raise FastCarError(f"metadata {key}={text!r} is not valid JSON; recompile the model") from None
        try:
            values["state"] = [StateEntry.from_json(d) for d in values["state"]]
            values["kv"] = [KVEntry.from_json(d) for d in values["kv"]]
            values["layers"] = [int(x) for x in values["layers"]]
            for name in ("frame_tokens", "num_layers", "max_replay", "hidden_size", "num_heads", "num_kv_heads",
                         "head_dim"):
                values[name] = int(values[name])
            if values.get("rotary_positions") is not None:
                values["rotary_positions"] = int(values["rotary_positions"])
        except (KeyError, TypeError, ValueError) as exc:
            raise FastCarError(f"malformed fastcar.* metadata ({exc!r}); recompile the model") from None
        return cls(**values)

    def kv_layer_settings(self) -> dict[int, dict[str, Any]]:
        """Compressed layer -> its KVCompressConfig fields, from either form of `kv_compress` (one setting for
        every layer, as older compilers wrote, or `per_layer`); {} for a dense KV cache."""
        kvc = self.kv_compress
        if not kvc:
            return {}
        try:
            if "per_layer" in kvc:
                return {int(n): _renamed(c) for n, c in kvc["per_layer"].items()}
            shared = {k: v for k, v in kvc.items() if k not in ("layers", "diagnostics_tokens")}
            return {int(n): _renamed(shared) for n in kvc.get("layers", [])}
        except (AttributeError, TypeError, ValueError) as exc:
            raise FastCarError(f"malformed fastcar.kv_compress metadata ({exc!r}); recompile the model") from None

    @property
    def first_threshold(self) -> float:
        t = self.threshold
        return float(t[0] if isinstance(t, list) else t)


def _renamed(settings: Mapping[str, Any]) -> dict[str, Any]:
    """One layer's KVCompressConfig fields as this version names them: models compiled before the rename
    recorded tokens per frame as `frame_len`."""
    out = dict(settings)
    if "frame_len" in out:
        out["frame_tokens"] = out.pop("frame_len")
    return out


def kv_compress_record(per_layer: Mapping[int, Mapping[str, Any]], diagnostics_tokens: int | None
                       ) -> dict[str, Any] | None:
    """The `kv_compress` metadata value: one shared setting written flat (the form older runtimes read), or
    `per_layer` when the layers differ; None when no layer is compressed."""
    if not per_layer:
        return None
    layers = sorted(per_layer)
    record: dict[str, Any] = {"layers": layers, "diagnostics_tokens": diagnostics_tokens}
    first = dict(per_layer[layers[0]])
    if all(dict(per_layer[n]) == first for n in layers):
        return {**first, **record}
    return {**record, "per_layer": {str(n): dict(per_layer[n]) for n in layers}}


META_KEYS = tuple(FastCarMetadata.key(f.name) for f in dataclasses.fields(FastCarMetadata))


def metadata_table() -> str:
    """The metadata_props table of docs/DESIGN.md, generated from FastCarMetadata (a test compares them)."""
    rows = ["| key | value |", "|---|---|"]
    rows += [f"| `{FastCarMetadata.key(f.name)}` | {f.metadata['doc']} |" for f in dataclasses.fields(FastCarMetadata)]
    return "\n".join(rows)


# --- video DiT step graphs (`export --dit`; compiled by the DiT target of passes/pipeline.py) -------------------
# A "frame" is a latent frame (Wan's VAE: 4x temporal, 8x8 spatial compression); the patch (1, 2, 2) makes
# `tokens_per_frame` = (latent_h / 2) * (latent_w / 2) tokens, 1560 for 480x832 video. The config rides in the
# step graph's metadata (DIT_CONFIG_KEY): the compiler and the runtime read the model's shapes from it.
# Upper bounds of a DiT config's sizes, wherever it comes from (a config .json, a step graph's metadata): far above
# any model this runs (Wan2.1-14B: 40 layers, hidden 5120, ffn 13824, text 4096 x 512), far below what overflows the
# allocations derived from them (which are also checked against memory: dit/config.check_stream_memory).
DIT_MAX_SIZES = {"layers": 1024, "hidden": 1 << 16, "heads": 1024, "ffn": 1 << 18, "text_dim": 1 << 16,
                 "in_channels": 4096, "latent_h": 1 << 14, "latent_w": 1 << 14, "freq_dim": 1 << 16,
                 "text_len": 1 << 16, "chunk_frames": 1024, "sink_frames": 1 << 20, "window_frames": 1 << 20}


@dataclass(frozen=True)
class DiTConfig:
    layers: int
    hidden: int
    heads: int
    ffn: int
    text_dim: int
    in_channels: int = 16
    patch: tuple[int, int, int] = (1, 2, 2)
    latent_h: int = 60
    latent_w: int = 104
    freq_dim: int = 256
    text_len: int = 512
    chunk_frames: int = 3  # latent frames denoised together (Self-Forcing's block)
    sink_frames: int = 3  # first frames kept in the cache for ever (attention sinks)
    window_frames: int = 18  # most recent non-sink frames kept; 0 = keep every frame (the cache grows)
    eps: float = 1e-6
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def grid(self) -> tuple[int, int]:
        return self.latent_h // self.patch[1], self.latent_w // self.patch[2]

    @property
    def tokens_per_frame(self) -> int:
        h, w = self.grid
        return h * w

    @property
    def patch_dim(self) -> int:
        p = self.patch
        return self.in_channels * p[0] * p[1] * p[2]

    def check(self, where: str = "the DiT config") -> DiTConfig:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in ("eps", "rope_theta"):
                if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v <= (1.0 if f.name == "eps"
                                                                                            else 1e12):
                    raise FastCarError(f"{where}: {f.name}={v!r} must be a positive number "
                                       f"{'below 1' if f.name == 'eps' else 'up to 1e12'}")
            elif f.name == "patch":
                if len(v) != 3 or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in v):
                    raise FastCarError(f"{where}: patch={list(v)!r} must be three positive integers")
            elif isinstance(v, bool) or not isinstance(v, int) or v < (0 if f.name in (
                    "window_frames", "sink_frames") else 1):
                raise FastCarError(f"{where}: {f.name}={v!r} must be a {'non-negative' if f.name in ('window_frames', 'sink_frames') else 'positive'} integer")
            elif v > DIT_MAX_SIZES[f.name]:
                raise FastCarError(f"{where}: {f.name}={v} is beyond {DIT_MAX_SIZES[f.name]}; check the config")
        if any(x > 64 for x in self.patch):
            raise FastCarError(f"{where}: patch={list(self.patch)!r}: at most 64 pixels a side")
        if self.hidden % self.heads or self.head_dim % 2 or self.head_dim < 6:
            raise FastCarError(f"{where}: hidden {self.hidden} / heads {self.heads} must give an even head size "
                               ">= 6 (3D RoPE splits it over frame, h, w)")
        if self.patch[0] != 1:
            raise FastCarError(f"{where}: patch {list(self.patch)}: only a temporal patch of 1 is supported")
        if self.latent_h % self.patch[1] or self.latent_w % self.patch[2]:
            raise FastCarError(f"{where}: latent {self.latent_h}x{self.latent_w} is not a multiple of the patch "
                               f"{self.patch[1]}x{self.patch[2]}")
        if self.freq_dim % 2:
            raise FastCarError(f"{where}: freq_dim {self.freq_dim} must be even")
        return self

    @property
    def params(self) -> int:
        """Parameter count (for messages and the memory check)."""
        d, f, t = self.hidden, self.ffn, self.text_dim
        block = 8 * d * d + 2 * d * f + 6 * d + 4 * d + 2 * d
        return (self.layers * block + self.patch_dim * d + t * d + d * d + self.freq_dim * d + 7 * d * d
                + d * self.patch_dim)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str) -> DiTConfig:
        """A config from its JSON object (a config.json, the step graph's metadata), checked."""
        if not isinstance(d, Mapping):
            raise FastCarError(f"{where}: the DiT config must be a JSON object")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise FastCarError(f"{where}: unknown DiT config keys {unknown}; known: {sorted(names)}")
        missing = sorted(k for k in ("layers", "hidden", "heads", "ffn", "text_dim") if k not in d)
        if missing:
            raise FastCarError(f"{where}: the DiT config lacks {missing}")
        d = dict(d)
        if "patch" in d:
            if not isinstance(d["patch"], list):
                raise FastCarError(f"{where}: patch must be a list of three integers")
            d["patch"] = tuple(d["patch"])
        return cls(**d).check(where)


# The ONNX I/O of the denoiser step (the export writes them, the compiler and the stream runtime read them).
STEP_INPUTS = ("latent", "timestep", "frame_start")
STEP_OUTPUT = "velocity"
TEXT_INPUT = "text_embeds"


def dit_past_names(layers: int) -> list[str]:
    return [f"past.{i}.{kv}" for i in range(layers) for kv in KV_KINDS]


def dit_cross_names(layers: int) -> list[str]:
    return [f"cross.{i}.{kv}" for i in range(layers) for kv in KV_KINDS]


def dit_present_names(layers: int) -> list[str]:
    return [f"present.{i}.{kv}" for i in range(layers) for kv in KV_KINDS]


def step_io(layers: int) -> tuple[list[str], list[str]]:
    """(inputs, outputs) of the step graph: the noisy chunk, per-frame timesteps, its first frame's index, the
    cache (past K/V per layer), the prompt's cross-attention K/V -> velocity, the chunk's own K/V."""
    return ([*STEP_INPUTS, *dit_past_names(layers), *dit_cross_names(layers)],
            [STEP_OUTPUT, *dit_present_names(layers)])


def text_io(layers: int) -> tuple[list[str], list[str]]:
    """(inputs, outputs) of the prompt graph: text embeddings -> cross-attention K/V per layer, once a video."""
    return [TEXT_INPUT], dit_cross_names(layers)


DIT_CONFIG_KEY = "fastcar.dit_config"  # the step graph's metadata: the config it was exported from
# What a loaded model is, read off its metadata once where it is loaded (fastcar_compile.api.load): a decoder with
# KV cache, the step graph `export --dit` writes (config + the prompt graph's name), or that prompt graph.
DECODER, DIT_STEP, DIT_PROMPT = "decoder", "dit-step", "dit-prompt"


def model_kind(props: Mapping[str, str]) -> str:
    """DECODER, DIT_STEP or DIT_PROMPT for a model's metadata_props."""
    if DIT_CONFIG_KEY not in props:
        return DECODER
    return DIT_STEP if DIT_TEXT_GRAPH_KEY in props else DIT_PROMPT


def dit_config_of(props: Mapping[str, str], where: str) -> DiTConfig:
    """The DiT config a graph's metadata_props record (DIT_CONFIG_KEY), checked like a user's config file."""
    try:
        d = json.loads(props[DIT_CONFIG_KEY])
    except KeyError:
        raise FastCarError(f"{where}: no {DIT_CONFIG_KEY} metadata; export the DiT with `fastcar-compile export "
                           "--dit`") from None
    except (ValueError, RecursionError):
        raise FastCarError(f"{where}: its {DIT_CONFIG_KEY} metadata is not valid JSON; export it again") from None
    return DiTConfig.from_dict(d, f"{where}'s {DIT_CONFIG_KEY}")
DIT_TEXT_GRAPH_KEY = "fastcar.dit_text_graph"  # file name of the prompt graph beside the step graph


def dit_text_graph_name(props: Mapping[str, str], where: str) -> str:
    """The prompt graph's file name a step graph's metadata records, checked to be a plain name beside it (never a
    path elsewhere: a graph is a file anyone can edit)."""
    name = props.get(DIT_TEXT_GRAPH_KEY)
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name \
            or len(name) > 255:
        raise FastCarError(f"{where}: its prompt graph name {name!r} is not a file name beside it; export it again")
    return name


def text_graph_path(step: str | os.PathLike) -> Path:
    """Where the prompt graph of step graph `dit.onnx` is written: `dit.text.onnx` beside it."""
    step = Path(step)
    return step.with_name(f"{step.stem}.text.onnx")
# The compiled step graph: `past.N.key|value` are the runtime's preallocated cache buffers [B, heads, capacity, d],
# written in place between chunks; their first `past_length` tokens hold K/V (the rest is masked out). Its metadata
# names this form; the stream runtime binds the buffers instead of concatenating them.
PAST_LENGTH = "past_length"
DIT_CACHE_FORM_KEY = "fastcar.dit_cache"
CACHE_IN_PLACE = "in-place"
DIT_MODES_KEY = "fastcar.dit_modes"  # the modes compiled in: DiTModes as JSON
REPLAY_FIRST = "replay_first"  # bool [1]: the chunk's first frame may replay (the runtime holds its predecessor)


def replay_io(layer: int) -> tuple[tuple[str, str], tuple[str, str], str]:
    """Block `layer`'s replay cache: (inputs (FFN output, key) of the frame before the chunk), (outputs: the
    chunk's last frame's), and its replay decision output [B, S]."""
    return ((f"past_replay.{layer}.ffn", f"past_replay.{layer}.key"),
            (f"present_replay.{layer}.ffn", f"present_replay.{layer}.key"), f"replay.{layer}")


def tempcache_io(layer: int) -> tuple[str, str]:
    """Block `layer`'s TempCache I/O: the input log(count) per cache slot [B, heads, capacity] (-inf: empty)
    and the output pre-RoPE keys of the chunk [B, heads, F x T, d] (what the runtime compares)."""
    return f"past_bias.{layer}", f"present_pre.{layer}.key"


def tempcache_slots_name(layer: int) -> str:
    """Block `layer`'s resident slots input in TempCache's `slots` form [B, heads, N] int64: the cache positions
    holding a slot per (row, head), -1 after them (what SlotAttention attends; merged-away positions are not listed)."""
    return f"tempcache_slots.{layer}"


# TempCache's compiled forms: "slots" = ai.fastcar SlotAttention over the resident slots the runtime lists (work
# follows the resident keys), "masked" = the in-place form over the whole buffer with log(count) added (-inf on
# the positions merges left), for an ONNX Runtime without the native library
TEMPCACHE_SLOTS, TEMPCACHE_MASKED = "slots", "masked"
TEMPCACHE_KERNELS = (TEMPCACHE_SLOTS, TEMPCACHE_MASKED)


def tas_name(layer: int) -> str:
    """Block `layer`'s TAS output [B, S] (FastCar compiled in): what `--calibrate-replay` reads."""
    return f"tas.{layer}"


def annca_io(layer: int) -> tuple[str, str]:
    """Block `layer`'s AnnCA I/O (AnnCA compiled in): the prompt keys' bucket codes [B, heads, L, tables] int64
    (an output of the prompt graph, an input of the step graph) and the prompt tokens each frame kept
    [B, heads, F, L] bool (an output of the step graph)."""
    return f"cross.{layer}.codes", f"annca.{layer}"


ANNSA_DENSE = "annsa_dense"  # int64 [Nd]: the cache's token positions AnnSA attends densely (sinks + local frames)
# AnnSA's compiled forms: "native" = the ai.fastcar AnnSAAttention op (each query scores its buckets' slots, no
# padding; without the native library its function body runs, masked dense), "graph" = block-sparse ONNX ops
ANNSA_NATIVE, ANNSA_GRAPH = "native", "graph"
ANNSA_KERNELS = (ANNSA_NATIVE, ANNSA_GRAPH)
# each form's per-block inputs (annsa_io's keys), after ANNSA_DENSE
ANNSA_INPUTS = {ANNSA_NATIVE: ("key_codes", "sorted_codes", "sorted_slots"),
                ANNSA_GRAPH: ("buckets", "keys", "bias", "kcodes")}


def annsa_io(layer: int) -> dict[str, str]:
    """Block `layer`'s AnnSA I/O: inputs `buckets` (the occupied bucket ids per table [B, heads, T, K]), `keys`
    (their cache positions [B, heads, T, K, M]), `bias` (0, -inf for padding), `kcodes` (those keys' ids in every
    table [B, heads, T, T, K, M]); output `codes` (the chunk's query ids [B, heads, S, T]). The native form's
    inputs instead: `key_codes` (every cache slot's ids [B, heads, capacity, T], -1 where not bucketed),
    `sorted_codes` and `sorted_slots` (per table the bucketed slots' ids ascending and their positions
    [B, heads, T, N]: each bucket's slots are one run)."""
    return {"buckets": f"annsa_buckets.{layer}", "keys": f"annsa_keys.{layer}", "bias": f"annsa_bias.{layer}",
            "kcodes": f"annsa_kcodes.{layer}", "codes": f"annsa_codes.{layer}",
            "key_codes": f"annsa_key_codes.{layer}", "sorted_codes": f"annsa_sorted_codes.{layer}",
            "sorted_slots": f"annsa_sorted_slots.{layer}"}


# The bucketings (sign random projections: fastar/lsh.py, or 8-bit quantised ones: fastar/int8.py) and TempCache's
# correspondents: the same (h, w) one frame back, or the top-1 cosine among the previous frame's slots sharing a
# bucket of one of the bucketings.
BUCKETINGS = ("lsh", "int8")
TEMPCACHE_MATCHES = ("aligned", *BUCKETINGS)
BUCKETED_MATCHES = TEMPCACHE_MATCHES[1:]  # the kinds a recorded bucketing may name (AnnSA's: BUCKETINGS)
MAX_ANNSA_LOCAL = 1 << 20  # frames


def _int_in(where: str, name: str, v: Any, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise FastCarError(f"{where}: {name}={v!r} must be an integer in {lo}..{hi}; compile the model again")
    return v


def _float_or_none(where: str, name: str, v: Any, lo: float, hi: float) -> float | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:  # NaN fails too
        raise FastCarError(f"{where}: {name}={v!r} must be null or a number in [{lo:g}, {hi:g}]; compile the model "
                           "again")
    return float(v)


def _choice(where: str, name: str, v: Any, choices: tuple[str, ...]) -> str:
    if v not in choices:
        raise FastCarError(f"{where}: {name}={v!r} must be one of {', '.join(choices)}; compile the model again")
    return v


@dataclass(frozen=True)
class BucketRecord:
    """A bucketing as a compiled step graph records it: the runtime draws the same seeded projections from it
    (fastar.config.hasher_of)."""

    kind: str
    lsh_bits: int
    int8_dirs: int
    ann_tables: int
    ann_seed: int

    @classmethod
    def from_dict(cls, d: Any, where: str) -> BucketRecord:
        if not isinstance(d, Mapping):
            raise FastCarError(f"{where}: a bucketing must be a JSON object, got {type(d).__name__}")
        fields = [f.name for f in dataclasses.fields(cls)]
        if sorted(d) != sorted(fields):
            raise FastCarError(f"{where}: a bucketing has the keys {fields}, got {sorted(d)}; compile the model again")
        _choice(where, "kind", d["kind"], BUCKETED_MATCHES)
        _int_in(where, "lsh_bits", d["lsh_bits"], 1, MAX_LSH_BITS)
        _choice(where, "int8_dirs", d["int8_dirs"], INT8_DIRS)
        _int_in(where, "ann_tables", d["ann_tables"], 1, MAX_ANN_TABLES)
        _int_in(where, "ann_seed", d["ann_seed"], 0, UINT32_MAX)
        return cls(**{k: d[k] for k in fields})

    def __str__(self) -> str:
        size = f"{self.lsh_bits} bits" if self.kind == "lsh" else f"{self.int8_dirs} int8 directions"
        return f"{self.kind} buckets ({size}) x {self.ann_tables} tables, seed {self.ann_seed}"


@dataclass(frozen=True)
class AnnSARecord(BucketRecord):
    """AnnSA's bucketing, the cached frames it always attends (`annsa_local`) and its compiled form."""

    annsa_local: int = 1
    annsa_kernel: str = ANNSA_GRAPH

    @classmethod
    def from_dict(cls, d: Any, where: str) -> AnnSARecord:
        if not isinstance(d, Mapping):
            raise FastCarError(f"{where}: AnnSA's record must be a JSON object, got {type(d).__name__}")
        base = BucketRecord.from_dict({k: v for k, v in d.items() if k not in ("annsa_local", "annsa_kernel")}, where)
        _choice(where, "kind", base.kind, BUCKETINGS)
        local = _int_in(where, "annsa_local", d.get("annsa_local"), 0, MAX_ANNSA_LOCAL)
        kernel = _choice(where, "annsa_kernel", d.get("annsa_kernel"), ANNSA_KERNELS)
        return cls(**dataclasses.asdict(base), annsa_local=local, annsa_kernel=kernel)


@dataclass(frozen=True)
class DiTModes:
    """The FAST-AR / FastCar modes compiled into a DiT step graph, written as JSON under DIT_MODES_KEY and read
    back by the stream runtime (checked like any input: a graph is a file anyone can edit).

    threshold: FastCar's tau (FFN replay, passes/dit_replay.py), None = off; tempcache: TempCache's SIM (the runtime
    merges at cache-write time, the graph adds each slot's log(count)), None = off; tempcache_match: its
    correspondent (TEMPCACHE_MATCHES; None when off) and tempcache_buckets: the bucketing of a top-1 match;
    tempcache_kernel: its compiled form (TEMPCACHE_KERNELS; None when off: a record without it is `masked`);
    annca: AnnCA's bucketing (passes/dit_annca.py); annsa: AnnSA's (passes/dit_annsa.py)."""

    threshold: float | None = None
    tempcache: float | None = None
    tempcache_match: str | None = None
    tempcache_buckets: BucketRecord | None = None
    tempcache_kernel: str | None = None
    annca: BucketRecord | None = None
    annsa: AnnSARecord | None = None

    @property
    def dense(self) -> bool:
        return all(getattr(self, f.name) is None for f in dataclasses.fields(self))

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str | None, where: str = "the step graph's fastcar.dit_modes") -> DiTModes:
        """The record (all off when `text` is None: a graph compiled without modes, or not compiled)."""
        if text is None:
            return cls()
        try:
            d = json.loads(text)
        except (ValueError, RecursionError):
            raise FastCarError(f"{where}: not valid JSON; compile the model again") from None
        if not isinstance(d, Mapping):
            raise FastCarError(f"{where}: must be a JSON object; compile the model again")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(d) - set(names))
        if unknown:
            raise FastCarError(f"{where}: unknown modes {unknown}; known: {names}")
        match = d.get("tempcache_match")
        sim = _float_or_none(where, "tempcache", d.get("tempcache"), -1.0, 1.0)
        if match is not None:
            _choice(where, "tempcache_match", match, TEMPCACHE_MATCHES)
        kernel = d.get("tempcache_kernel")
        if kernel is not None:
            _choice(where, "tempcache_kernel", kernel, TEMPCACHE_KERNELS)
        elif sim is not None:
            kernel = TEMPCACHE_MASKED
        buckets = d.get("tempcache_buckets")
        return cls(
            threshold=_float_or_none(where, "threshold", d.get("threshold"), -FLOAT32_LIMIT, FLOAT32_LIMIT),
            tempcache=sim, tempcache_match=match, tempcache_kernel=kernel,
            tempcache_buckets=None if buckets is None else BucketRecord.from_dict(buckets, f"{where} tempcache_buckets"),
            annca=None if d.get("annca") is None else BucketRecord.from_dict(d["annca"], f"{where} annca"),
            annsa=None if d.get("annsa") is None else AnnSARecord.from_dict(d["annsa"], f"{where} annsa"))


FLOAT32_LIMIT = 3.4028234663852886e38  # a tau the float32 graph constant can hold
