"""What the compiler's passes share: the user's options (checked once) and what earlier passes found.

Passes are `onnx_ir.passes` passes over the model; the model cannot carry Python objects (layer matches,
the values a rewrite created), so each pass gets this context and reads/writes it in pipeline order:
discovery fills `matches`/`selected`, the rewrite passes fill `layers`, metadata reads all of it.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path

import onnx_ir as ir

from fastcar_compile import contract
from fastcar_compile.errors import FastCarError
from fastcar_compile.limits import MAX_FRAME_TOKENS, MAX_REPLAY, check_int
from fastcar_compile.passes.discover import LayerMatch


@dataclass(frozen=True)
class CompileOptions:
    """The compiler's options, validated on construction (one place for every check)."""

    frame_tokens: int
    threshold: tuple[float, ...] = (-4.0,)
    tas_query: str = contract.TAS_ROPE
    max_replay: int = 0
    layers: str | tuple[int, ...] | None = None
    per_layer_threshold: bool = False
    emit_diagnostics: bool = False
    # exported attention cores -> ai.fastcar CompressedAttention ("fastcar", the default: exact in every case,
    # in-place KV buffers) or com.microsoft.GroupQueryAttention ("gqa"); None/False/"off" = left as exported,
    # True = "gqa" (passes/fused_attention.py)
    fused_attention: str | bool | None = "fastcar"
    # video_start / fastcar_threshold as plain inputs without defaults: onnxruntime-genai feeds only those from
    # generator.set_model_input (it drops names ORT lists as overridable initializers), docs/genai.md
    required_video_inputs: bool = False
    # FAST-AR compressed KV cache in the fastcar attention op (fastcar_compile/fastar/config.py): slots per KV
    # head, attention sinks, local window, eviction, TempCache similarity, AnnSA "lsh:BITSxTABLES"
    kv_budget: int | None = None
    kv_sinks: int = 0
    kv_window: int = 0
    kv_eviction: str = "mass"
    tempcache: float | None = None
    sparse_attention: str | None = None
    kv_diagnostics: int | None = None  # dense attention on the side over at most this many tokens (stats outputs)

    def __post_init__(self) -> None:
        check_int("--frame-tokens", self.frame_tokens, 1, MAX_FRAME_TOKENS, "tokens per video frame")
        taus = contract.check_thresholds(self.threshold).reshape(-1)
        object.__setattr__(self, "threshold", tuple(float(t) for t in taus))
        contract.check_tas_query(self.tas_query)
        check_int("--max-replay", self.max_replay, 0, MAX_REPLAY, "0 = unlimited")
        object.__setattr__(self, "fused_attention", check_fused_attention(self.fused_attention))
        if self.kv_compress is not None:
            if self.fused_attention == "gqa":
                raise FastCarError("--kv-budget/--tempcache/--sparse-attention live in the fastcar attention op; "
                                   "use --fused-attention fastcar (or leave --fused-attention out)")
            object.__setattr__(self, "fused_attention", "fastcar")
        if not self.per_layer_threshold and len(self.threshold) != 1:
            raise FastCarError("several thresholds need --per-layer-threshold")

    @property
    def kv_compress(self):
        """The compressed-KV settings (fastar.KVCompressConfig, validated there), or None for a dense cache."""
        if self.kv_budget is None and self.tempcache is None and self.sparse_attention is None and \
                not self.kv_sinks and not self.kv_window and self.kv_diagnostics is None:
            return None
        from fastcar_compile.fastar.config import KVCompressConfig

        if self.kv_budget is None:
            raise FastCarError("--kv-sinks/--kv-window/--tempcache/--sparse-attention/--kv-diagnostics need "
                               "--kv-budget C (the "
                               "fixed number of KV slots per layer and KV head)")
        check_int("--kv-budget", self.kv_budget, 1, 1 << 24, "KV slots per layer and KV head")
        if self.kv_diagnostics is not None:
            check_int("--kv-diagnostics", self.kv_diagnostics, 1, 1 << 20, "tokens the dense side buffer holds")
        bits, tables = parse_sparse_attention(self.sparse_attention)
        return KVCompressConfig(budget=self.kv_budget, sinks=self.kv_sinks, window=self.kv_window,
                                tempcache_sim=self.tempcache, eviction=self.kv_eviction, lsh_bits=bits,
                                lsh_tables=tables, frame_len=self.frame_tokens, video_start=0)

    @property
    def metadata_threshold(self) -> float | list[float]:
        return list(self.threshold) if self.per_layer_threshold else self.threshold[0]


FUSED_ATTENTION = ("gqa", "fastcar")


def parse_sparse_attention(value: str | None) -> tuple[int | None, int]:
    """--sparse-attention 'lsh:BITSxTABLES' -> (bits, tables); None -> (None, 1)."""
    if value is None:
        return None, 1
    head, _, spec = str(value).partition(":")
    bits, _, tables = spec.partition("x")
    if head != "lsh" or not bits.isdigit() or not tables.isdigit():
        raise FastCarError(f"--sparse-attention must look like lsh:BITSxTABLES (e.g. lsh:8x4), got {value!r}")
    if not (1 <= int(bits) <= 24 and 1 <= int(tables) <= 64):
        raise FastCarError(f"--sparse-attention {value}: bits must be 1..24 and tables 1..64")
    return int(bits), int(tables)


def check_fused_attention(value: str | bool | None) -> str | None:
    """--fused-attention's value: 'gqa' | 'fastcar' | None ('off'/False); True means 'gqa' (the first one built)."""
    if value is None or value is False or value == "off":
        return None
    if value is True:
        return "gqa"
    if value not in FUSED_ATTENTION:
        raise FastCarError(f"--fused-attention must be one of {', '.join(FUSED_ATTENTION)} or off, got {value!r}")
    return value


@dataclass
class LayerRewrite:
    """The values one rewritten layer's parts hand each other (gate -> branch -> cache state)."""

    match: LayerMatch
    index: int  # position among the rewritten layers (its tau with --per-layer-threshold)
    dtype: ir.DataType
    past_cache: ir.Value
    past_age: ir.Value
    ids: itertools.count = field(default_factory=itertools.count)  # node/value name ids, per layer
    nodes: list[ir.Node] = field(default_factory=list)  # new main-graph nodes, inserted before `closing`
    replay: ir.Value | None = None
    tas: ir.Value | None = None
    slot: ir.Value | None = None
    write: ir.Value | None = None
    used: ir.Value | None = None  # the MLP branch output actually used (computed or replayed)
    state: list[contract.StateEntry] = field(default_factory=list)

    @property
    def layer(self) -> int:
        return self.match.layer

    @property
    def hidden(self) -> int:
        assert self.match.mlp is not None
        return self.match.mlp.hidden


@dataclass
class CompileContext:
    options: CompileOptions
    matches: list[LayerMatch] = field(default_factory=list)
    selected: list[LayerMatch] = field(default_factory=list)
    layers: list[LayerRewrite] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    video_start: ir.Value | None = None
    threshold: ir.Value | None = None
    batch: ir.SymbolicDim | int | str = "batch"
    metadata: dict[str, str] = field(default_factory=dict)  # the fastcar.* props written
    kv_state: list[contract.StateEntry] = field(default_factory=list)  # compressed-KV slot state (fused pass)
    kv_compressed: list[int] = field(default_factory=list)  # layers whose KV cache is compressed
    genai_config: Path | None = None  # onnxruntime-genai config beside the input: run in genai's generator

    @property
    def rewritten(self) -> list[int]:
        return [r.layer for r in self.layers]


def weight_bytes(model: ir.Model) -> int:
    total = 0
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if tensor is not None:
            total += math.prod(tensor.shape) * tensor.dtype.itemsize
    return total
