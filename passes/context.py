"""What the compiler's passes share: the user's options (checked once) and what earlier passes found.

Passes are `onnx_ir.passes` passes over the model; the model cannot carry Python objects (layer matches,
the values a rewrite created), so each pass gets this context and reads/writes it in pipeline order:
discovery fills `matches`/`selected`, the rewrite passes fill `layers`, metadata reads all of it.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import onnx_ir as ir

from fastcar_compile.core import contract, options
from fastcar_compile.core.errors import FastCarError
from fastcar_compile.core.options import FUSED_ATTENTION, ascii_float, ascii_int, check_fused_attention  # noqa: F401
from fastcar_compile.passes.attention_form import Forms
from fastcar_compile.passes.discover import LayerMatch
from fastcar_compile.passes.plan import Plan

if TYPE_CHECKING:
    from fastcar_compile.fastar.config import KVCompressConfig


@dataclass(frozen=True)
class CompileOptions(dataclasses.make_dataclass("DeclaredOptions", options.fields(), frozen=True)):
    """The compiler's options: the fields, their defaults and per-option checks are fastcar_compile.core.options'
    declarations; this class adds the checks between options (one place for every check, run on construction)."""

    def __post_init__(self) -> None:
        checked = options.check_all({name: getattr(self, name) for name in options.BY_NAME})
        for name, value in checked.items():
            object.__setattr__(self, name, value)
        if self.kv_compress is not None or any(c is not None for c in self.kv_layer_configs.values()):
            if self.fused_attention != "fastcar":
                raise FastCarError("--kv-budget/--kv-layer/--tempcache/--sparse-attention/--prune-prompt live in the "
                                   f"fastcar attention op, which --fused-attention {self.fused_attention or 'off'} "
                                   "leaves out; use --fused-attention fastcar (or leave --fused-attention out)")
            self._check_fastcar_windows()
        if not self.per_layer_threshold and len(self.threshold) != 1:
            raise FastCarError("several thresholds need --per-layer-threshold")
        if self.required_video_inputs and self.video_start is not None:
            raise FastCarError(f"--video-start {self.video_start} compiles video_start in, --required-video-inputs "
                               "makes it an input fed every run: give one of them")

    @property
    def video_start_default(self) -> int | None:
        """The compiled-in default of the video_start input (--video-start), None: an input every run feeds."""
        return None if self.required_video_inputs else self.video_start

    @functools.cached_property
    def kv_compress(self) -> KVCompressConfig | None:
        """The compressed-KV settings (fastar.KVCompressConfig, validated there), or None for a dense cache;
        built once (the options are frozen; __post_init__ reads it first, so bad settings fail at construction)."""
        if self.kv_budget is None and self.tempcache is None and self.sparse_attention is None and \
                self.prune_prompt is None and not self.kv_sinks and not self.kv_window and (self.kv_diagnostics is None or self.kv_layers):
            return None
        if self.kv_budget is None:
            raise FastCarError("--kv-sinks/--kv-window/--tempcache/--sparse-attention/--prune-prompt/"
                               "--kv-diagnostics need --kv-budget C (the "
                               "fixed number of KV slots per layer and KV head)")
        return kv_settings(self.frame_tokens, self.sparse_attention, diagnostics=self.kv_diagnostics,
                           budget=self.kv_budget,
                           sinks=self.kv_sinks, window=self.kv_window, tempcache_sim=self.tempcache,
                           eviction=self.kv_eviction, prune_prompt=self.prune_prompt)

    @functools.cached_property
    def kv_layer_configs(self) -> dict[int, KVCompressConfig | None]:
        """Layer -> its --kv-layer settings (None = 'off', an uncompressed cache); layers absent use kv_compress.
        Built once, like kv_compress (read it, do not modify it)."""
        out: dict[int, KVCompressConfig | None] = {}
        for spec in self.kv_layers:
            layers, cfg = parse_kv_layer(spec, self.frame_tokens)
            twice = sorted(set(layers) & set(out))
            if twice:
                raise FastCarError(f"--kv-layer {spec}: layer {twice[0]} already has settings from an earlier "
                                   "--kv-layer; give each layer once")
            out.update(dict.fromkeys(layers, cfg))
        check_diagnostics(self.kv_diagnostics)
        return out

    def _check_fastcar_windows(self) -> None:
        """Every compressed cache of a layer to be rewritten keeps the key one frame back (KVCompressConfig.
        check_fastcar_window): the global kv_* settings where they reach such a layer, then each --kv-layer."""
        explicit = self.kv_layer_configs
        if self.kv_compress is not None and self._fastcar_beyond(set(explicit)):
            self.kv_compress.check_fastcar_window(
                f"--kv-window {self.kv_window}", f"use --kv-window {self.frame_tokens} or more (with --kv-budget "
                "above --kv-sinks + --kv-window)")
        for spec in self.kv_layers:
            cfg = next((explicit[n] for n in _layer_indices(spec.partition(":")[0], spec) if self._fastcar_on(n)),
                       None)
            if cfg is not None:
                cfg.check_fastcar_window(f"--kv-layer {spec!r}", f"add window={self.frame_tokens} (or more) to it")

    @functools.cached_property
    def _fastcar_ranges(self) -> list[tuple[int, int]] | None:
        """`layers` as inclusive index ranges (None: every matched layer). Unreadable text gives None here:
        the layer selection reports it with the model's layers at hand (analysis.parse_layers)."""
        if self.layers is None:
            return None
        if not isinstance(self.layers, str):
            return [(int(n), int(n)) for n in self.layers]
        try:
            return options.parse_layer_ranges(self.layers, "--layers")
        except FastCarError:
            return None

    def _fastcar_on(self, layer: int) -> bool:
        """Whether `layer` is asked to be rewritten (the FastCar gate on it)."""
        ranges = self._fastcar_ranges
        return ranges is None or any(lo <= layer <= hi for lo, hi in ranges)

    def _fastcar_beyond(self, named: set[int]) -> bool:
        """Whether some layer asked to be rewritten is outside `named` (then it takes the global kv_* settings)."""
        ranges = self._fastcar_ranges
        return ranges is None or any(hi - lo + 1 > sum(lo <= n <= hi for n in named) for lo, hi in ranges)

    def kv_config(self, layer: int) -> KVCompressConfig | None:
        """One layer's compressed-KV settings (fastar.KVCompressConfig) or None for a dense cache."""
        explicit = self.kv_layer_configs
        return explicit[layer] if layer in explicit else self.kv_compress

    @property
    def metadata_threshold(self) -> float | list[float]:
        return list(self.threshold) if self.per_layer_threshold else self.threshold[0]


SPARSE_FORM = "lsh:BITSxTABLES (e.g. lsh:8x4), int8 or int8:DIRSxTABLES (e.g. int8:2x4)"
INT8_DEFAULT = (2, 4)  # `int8` alone: 2 directions x 16 levels per table, 4 tables (fastar/int8.py)


def parse_sparse_attention(value: str | None, flag: str = "--sparse-attention") -> dict:
    """'lsh:BITSxTABLES' | 'int8[:DIRSxTABLES]' -> KVCompressConfig keywords ({} for None). The one reader of
    this grammar (--sparse-attention, --kv-layer sparse=, eval --kv-modes); the buckets' limits are
    fastar.config.check_buckets' (core/options.py's bounds), their messages prefixed with `flag` and the value."""
    from fastcar_compile.fastar.config import check_buckets

    if value is None:
        return {}
    head, _, spec = str(value).partition(":")
    first, _, tables = spec.partition("x")
    if str(value) == "int8":
        kw = {"int8_dirs": INT8_DEFAULT[0], "int8_tables": INT8_DEFAULT[1]}
    elif head not in ("lsh", "int8") or not _digits(first) or not _digits(tables):
        raise FastCarError(f"{flag} must look like {SPARSE_FORM}, got {value!r}")
    else:
        kw = {"lsh_bits": int(first), "lsh_tables": int(tables)} if head == "lsh" else \
            {"int8_dirs": int(first), "int8_tables": int(tables)}
    try:
        check_buckets(**kw)
    except FastCarError as exc:
        raise FastCarError(f"{flag} {value}: {exc}") from None
    return kw


KV_LAYER_KEYS = ("budget", "sinks", "window", "eviction", "tempcache", "sparse", "prune")
KV_LAYER_FORM = ("--kv-layer takes LAYERS:SETTINGS, e.g. 0:budget=129,sinks=4,window=124,eviction=oldest or "
                 "1-3:budget=4100,tempcache=0.95 or 2:off (settings: " + ", ".join(KV_LAYER_KEYS) + ")")


def _digits(text: str) -> bool:
    """ASCII digits only: str.isdigit() also takes '²' (which int() refuses) and '٢' (which int() reads as 2)."""
    return text.isascii() and text.isdigit()


MAX_LAYER_INDEX = 1 << 16  # a --kv-layer range is expanded before the model's layers are known


def _layer_indices(text: str, spec: str) -> list[int]:
    """'0,2-5' -> [0, 2, 3, 4, 5] (options.parse_layer_ranges; checked against the model's layers by the
    fused-attention pass)."""
    flag = f"--kv-layer {spec!r}"
    ranges = options.parse_layer_ranges(text, flag, KV_LAYER_FORM)
    if any(hi > MAX_LAYER_INDEX for _, hi in ranges):
        raise FastCarError(f"{flag}: layer indices go up to {MAX_LAYER_INDEX}; {KV_LAYER_FORM}")
    return [n for lo, hi in ranges for n in range(lo, hi + 1)]


def check_diagnostics(tokens: int | None) -> None:
    """--kv-diagnostics' range (the dense side buffer's tokens), when set."""
    if tokens is not None:
        options.BY_NAME["kv_diagnostics"].check(tokens)


def kv_settings(frame_tokens: int, sparse: str | None, diagnostics: int | None = None, context: str = "",
                **settings) -> KVCompressConfig:
    """The one check-and-build of a compressed-KV setting (the global kv_* options and each --kv-layer): the
    value object is fastar.KVCompressConfig, whose checks are the compile options' bounds (core/options.py);
    --kv-diagnostics' range and the sparse spec are read first. Messages are prefixed with `context` when given.
    The layout is the compiler's: L = frame_tokens; video_start is not known here (the op reads the model's
    input)."""
    from fastcar_compile.fastar.config import KVCompressConfig

    check_diagnostics(diagnostics)
    try:
        settings.update(parse_sparse_attention(sparse))
        return KVCompressConfig(**settings, frame_tokens=frame_tokens, video_start=0)
    except FastCarError as exc:
        if not context:
            raise
        raise FastCarError(f"{context}: {exc}") from None


def parse_kv_layer(spec: str, frame_tokens: int):
    """'LAYERS:SETTINGS' -> (layer indices, fastar.KVCompressConfig or None for 'off'), validated there."""
    layers_text, colon, settings = str(spec).partition(":")
    if not colon or not settings.strip():
        raise FastCarError(f"--kv-layer {spec!r}: no settings; {KV_LAYER_FORM}")
    layers = _layer_indices(layers_text, spec)
    if settings.strip() == "off":
        return layers, None
    values: dict[str, str] = {}
    for item in settings.split(","):
        key, eq, value = item.strip().partition("=")
        if not eq or key not in KV_LAYER_KEYS or key in values:
            raise FastCarError(f"--kv-layer {spec!r}: cannot read {item.strip()!r}; {KV_LAYER_FORM}")
        values[key] = value.strip()
    if "budget" not in values:
        raise FastCarError(f"--kv-layer {spec!r}: needs budget=C (KV slots per KV head) or 'off'")
    try:
        ints = {k: ascii_int(values[k]) for k in ("budget", "sinks", "window") if k in values}
        sim = ascii_float(values["tempcache"]) if "tempcache" in values else None
        prune = ascii_float(values["prune"]) if "prune" in values else None
    except ValueError:
        raise FastCarError(f"--kv-layer {spec!r}: budget/sinks/window must be integers, tempcache/prune numbers; "
                           f"{KV_LAYER_FORM}") from None
    cfg = kv_settings(frame_tokens, values.get("sparse"), context=f"--kv-layer {spec!r}", budget=ints["budget"],
                      sinks=ints.get("sinks", 0), window=ints.get("window", 0), tempcache_sim=sim,
                      eviction=values.get("eviction", "mass"), prune_prompt=prune)
    return layers, cfg


@dataclass(frozen=True)
class PackedQuery:
    """The query a fused layer's packed gate reads, recorded by the attention emission before the gate is emitted:
    `value` [B, S, >= H*D] (its first H*D channels are the query), `rope` = (cos table, sin table, rotary dim)
    when `value` is the projection before RoPE and the gate rotates it itself."""

    value: ir.Value
    rope: tuple[ir.Value, ir.Value, int] | None = None


GENAI_AGE_FILL = 0  # onnxruntime-genai zero-fills its state; the stored age is age + 1 (passes/genai_state.py)


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
    cached: ir.Value | None = None  # the slots' cached MLP rows, when the gate node reads them (packed gate)
    conditions: tuple[ir.Value, ir.Value] | None = None  # (no token replays, some token computes), likewise
    used: ir.Value | None = None  # the MLP branch output actually used (computed or replayed)
    present: tuple[ir.Value, ir.Value] | None = None  # (cache, age) when the branch's merge wrote them back
    state: list[contract.StateEntry] = field(default_factory=list)
    rows: tuple[ir.Value, ir.Value] | None = None  # (rows, some) when the gate selects the rows (select_rows)

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
    kv_configs: dict[int, object] = field(default_factory=dict)  # those layers' fastar.KVCompressConfig
    rotary_table: int | None = None  # positions of the packed attention's cos/sin table when a layer is packed
    fusions: dict[int, dict] = field(default_factory=dict)  # layer -> what its fused attention reads (the plan's)
    forms: Forms = field(default_factory=lambda: Forms({}, [], 0))  # how each fused attention is built (the plan's)
    packed_queries: dict[int, PackedQuery] = field(default_factory=dict)  # rewritten fused layers: the packed gate's
    plan: Plan = field(default_factory=Plan)  # per layer: what the emission builds (PlanPass)
    # the export's com.microsoft.GroupQueryAttention nodes (PlanPass), the only ones NativeGqaPass swaps
    exported_gqa: list[ir.Node] = field(default_factory=list)
    genai_config: Path | None = None  # onnxruntime-genai config beside the input: run in genai's generator

    @property
    def age_attrs(self) -> dict[str, int]:
        """The age encoding of every ai.fastcar op that reads or writes a layer's age, set where it is built:
        onnxruntime-genai zero-fills its recurrent state, so there the stored age is age + 1."""
        return {"age_offset": GENAI_AGE_FILL - contract.AGE_FILL} if self.genai_config is not None else {}

    @property
    def rewritten(self) -> list[int]:
        return [r.layer for r in self.layers]

    def rewrite_of(self, layer: int) -> LayerRewrite | None:
        """The rewritten layer's record (None: the layer is not rewritten)."""
        return next((r for r in self.layers if r.layer == layer), None)

    def attention_node(self, layer: int) -> ir.Node:
        """The op computing the layer's attention now (the fused op built for it, or the export's)."""
        match = next(m for m in self.matches if m.layer == layer)
        assert match.attention is not None
        return match.attention.core_node

    def swap_attention_node(self, old: ir.Node, new: ir.Node) -> None:
        """A pass replaced the attention op `old` by `new` (same outputs), in whichever layer has it."""
        for m in self.matches:
            if m.attention is not None and m.attention.core_node is old:
                m.attention.core_node = new


def weight_bytes(model: ir.Model) -> int:
    total = 0
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if tensor is not None:
            total += math.prod(tensor.shape) * tensor.dtype.itemsize
    return total


@dataclass
class DiTContext:
    """What the DiT target's passes share (passes/pipeline.py): the options checked into the modes, the model's
    config (its metadata), discovery's block matches, the plan the emission reads, and the prompt graph the save
    copies beside the output (`prompt_source` -> the output's `prompt_name`, None: not written)."""

    options: dict
    modes: contract.DiTModes
    cfg: contract.DiTConfig
    notes: list[str] = field(default_factory=list)
    matches: list = field(default_factory=list)  # passes/dit_discover.DiTBlockMatch
    plan: Plan = field(default_factory=Plan)
    metadata: dict[str, str] = field(default_factory=dict)  # the fastcar.dit_* props written
    prompt_source: Path | None = None
    prompt_name: str | None = None

    @property
    def rewritten(self) -> list[int]:
        return [m.layer for m in self.matches if m.ok]
