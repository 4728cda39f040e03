"""The compiler's pipeline: one list of named stages, the same for both targets (a decoder, a video DiT's step
graph), each stage the `onnx_ir.passes` passes of that target, in order.

    fuse      exporter fusions: rotary, RMSNorm, skip-norm (decoders)
    discover  find each block (decoder layers: passes/discover.py; DiT blocks: passes/dit_discover.py)
    plan      decide per block what the emission builds (passes/plan.py; passes/dit_plan.py): typed, printed
    emit      build it from the plan and from what the earlier emission passes recorded, never by matching the
              graph again: decoders' fused attention (the plan's form) -> gate -> branch -> cache state [-> genai
              state] [-> native GroupQueryAttention on the export's own com.microsoft nodes] -> KV dim names;
              DiTs' in-place cache (+ TempCache, AnnSA) -> FFN replay -> AnnCA
    finish    IR version, metadata [-> the CUDA provider's form: function bodies inlined, ops checked]
    validate  onnx.checker and an ONNX Runtime session on the staged file (when writing, unless off)
    save      stage the files that go with the model (the genai folder; the DiT's prompt graph), rename into place

The exporter-level fusions run first, so discovery, the plan and `--inspect` see the forms onnxruntime-genai's
builder writes. A new transformation is one module under passes/ plus one line in its target's stage. `describe`
is what `fastcar-compile --verbose` prints.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import onnx_ir as ir

from fastcar_compile.core.errors import FastCarError
from fastcar_compile.passes.analysis import DiscoverPass, PlanPass, SelectLayersPass
from fastcar_compile.passes.branch import BranchPass
from fastcar_compile.passes.cache_state import CacheStatePass
from fastcar_compile.passes.context import CompileContext, DiTContext
from fastcar_compile.passes.cuda_target import CudaProviderPass
from fastcar_compile.passes.dit_annca import AnnCAPass
from fastcar_compile.passes.dit_cache import InPlaceCachePass
from fastcar_compile.passes.dit_discover import DiTDiscoverPass
from fastcar_compile.passes.dit_plan import DiTPlanPass
from fastcar_compile.passes.dit_prompt import StagePromptGraphPass
from fastcar_compile.passes.dit_replay import ReplayPass
from fastcar_compile.passes.fuse_norm import RmsNormFusionPass, SkipNormFusionPass
from fastcar_compile.passes.fuse_rotary import RotaryFusionPass
from fastcar_compile.passes.fused_attention import FusedAttentionPass
from fastcar_compile.passes.gate import GatePass
from fastcar_compile.passes.genai_state import GenaiConfigPass, GenaiStatePass
from fastcar_compile.passes.kv_dims import KvDimNamesPass
from fastcar_compile.passes.metadata import DiTMetadataPass, IrVersionPass, MetadataPass
from fastcar_compile.passes.native_gqa import NativeGqaPass
from fastcar_compile.passes.save import SavePass, Staging
from fastcar_compile.passes.validate import ValidatePass

Passes = list[ir.passes.PassBase]
STAGES = ("fuse", "discover", "plan", "emit", "finish", "validate", "save")


@dataclass(frozen=True)
class Target:
    """What a kind of model runs at each stage (validate is the same for every target)."""

    name: str
    fuse: Callable[[object], Passes]
    discover: Callable[[object], Passes]
    plan: Callable[[object], Passes]
    emit: Callable[[object], Passes]
    finish: Callable[[object], Passes]
    files: Callable[[object, Staging], Passes]  # passes staging the files saved with the model


def exporter_fusions(ctx: CompileContext) -> Passes:
    """The exporter-level fusions (`--fusions`), the first stage: what discovery, the plan and `--inspect` see."""
    return [RotaryFusionPass(ctx), RmsNormFusionPass(ctx), SkipNormFusionPass(ctx)] if ctx.options.fusions else []


def _decoder_emit(ctx: CompileContext) -> Passes:
    return [
        *([FusedAttentionPass(ctx)] if ctx.options.fused_attention else []),
        GatePass(ctx),
        BranchPass(ctx),
        CacheStatePass(ctx),
        *([GenaiStatePass(ctx)] if ctx.genai_config is not None else []),
        *([NativeGqaPass(ctx.notes, ctx.swap_attention_node, lambda: ctx.exported_gqa)]
          if ctx.options.native_attention else []),
        KvDimNamesPass(ctx),
    ]


def _provider(provider: str, notes: list[str]) -> Passes:
    """The last finishing pass for an execution provider other than the CPU's."""
    return [CudaProviderPass(notes)] if provider == "cuda" else []


DECODER = Target(
    "decoder",
    fuse=exporter_fusions,
    discover=lambda ctx: [DiscoverPass(ctx), SelectLayersPass(ctx)],
    plan=lambda ctx: [PlanPass(ctx)],
    emit=_decoder_emit,
    finish=lambda ctx: [IrVersionPass(ctx), MetadataPass(ctx), *_provider(ctx.options.provider, ctx.notes)],
    files=lambda ctx, staging: [GenaiConfigPass(ctx, staging)] if ctx.genai_config is not None else [],
)
DIT = Target(
    "dit",
    fuse=lambda ctx: [],
    discover=lambda ctx: [DiTDiscoverPass(ctx)],
    plan=lambda ctx: [DiTPlanPass(ctx)],
    emit=lambda ctx: [InPlaceCachePass(ctx), ReplayPass(ctx), AnnCAPass(ctx)],
    finish=lambda ctx: [DiTMetadataPass(ctx), *_provider(ctx.options.get("provider", "cpu"), ctx.notes)],
    files=lambda ctx, staging: [StagePromptGraphPass(ctx, staging)],
)


def target_of(ctx: CompileContext | DiTContext) -> Target:
    return DIT if isinstance(ctx, DiTContext) else DECODER


def build(ctx: CompileContext | DiTContext, staging: Staging | None = None, validate: bool = True
          ) -> ir.passes.PassManager:
    """The passes of `ctx`'s target, stage by stage; with `staging` the result is validated (unless off) and
    saved with its files."""
    t = target_of(ctx)
    passes: Passes = [*t.fuse(ctx), *t.discover(ctx), *t.plan(ctx), *t.emit(ctx), *t.finish(ctx)]
    if staging is not None:
        if validate:
            passes.append(ValidatePass(staging))
        passes += [*t.files(ctx, staging), SavePass(staging)]
    return ir.passes.PassManager(passes)


def describe(manager: ir.passes.PassManager) -> list[str]:
    """One line per pass: its name and the first line of its docstring (or module docstring)."""
    lines = []
    for p in manager.passes:
        doc = (type(p).__doc__ or "").strip().splitlines() or [""]
        lines.append(f"{type(p).__name__:<17} {doc[0]}".rstrip())
    return lines


def run(manager: ir.passes.PassBase, model: ir.Model) -> ir.passes.PassResult:
    """Run the passes; a user error raised inside one comes out as itself (PassManager wraps exceptions)."""
    try:
        return manager(model)
    except ir.passes.PassError as exc:
        cause: BaseException | None = exc
        while isinstance(cause, ir.passes.PassError) and cause.__cause__ is not None:
            cause = cause.__cause__
        if isinstance(cause, FastCarError | OSError):  # a file-system error is the caller's to explain
            raise cause from None
        raise
