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
    fused_attention: bool = False  # exported attention cores -> GroupQueryAttention (passes/fused_attention.py)
    # video_start / fastcar_threshold as plain inputs without defaults: onnxruntime-genai feeds only those from
    # generator.set_model_input (it drops names ORT lists as overridable initializers), docs/genai.md
    required_video_inputs: bool = False

    def __post_init__(self) -> None:
        check_int("--frame-tokens", self.frame_tokens, 1, MAX_FRAME_TOKENS, "tokens per video frame")
        taus = contract.check_thresholds(self.threshold).reshape(-1)
        object.__setattr__(self, "threshold", tuple(float(t) for t in taus))
        contract.check_tas_query(self.tas_query)
        check_int("--max-replay", self.max_replay, 0, MAX_REPLAY, "0 = unlimited")
        if not self.per_layer_threshold and len(self.threshold) != 1:
            raise FastCarError("several thresholds need --per-layer-threshold")

    @property
    def metadata_threshold(self) -> float | list[float]:
        return list(self.threshold) if self.per_layer_threshold else self.threshold[0]


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
