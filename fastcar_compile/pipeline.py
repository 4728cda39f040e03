"""The compiler's pipeline: which `onnx_ir.passes` passes run, in order, for a set of options.

    [exporter fusions: rotary, RMSNorm, skip-norm] -> discover -> select layers -> plan
    -> emit: [fused attention (q/k/v layout, packed QKV + RoPE in the op: the plan's form)] -> gate -> branch
       -> cache state
       [-> genai state] [-> native GroupQueryAttention (the export's own com.microsoft nodes)] -> KV dim names
       -> IR version -> metadata
    [-> validate] [-> genai config] [-> save]

The exporter-level fusions run first, so discovery, the plan and `--inspect` see the forms onnxruntime-genai's
builder writes (RotaryEmbedding, SimplifiedLayerNormalization, SkipSimplifiedLayerNormalization). Discovery runs
once; the plan (passes/plan.py, passes/attention_form.py) is decided from it and the options; the emission
passes build from the plan and from what the earlier ones recorded (the layer's match, PackedQuery, LayerRewrite),
never from the ai.fastcar nodes in the graph: each layer's attention op and gate are emitted once, in their final
form. A new transformation is one module under passes/ plus one line in `build`. `describe` is
what `fastcar-compile --verbose` prints.
"""

from __future__ import annotations

import onnx_ir as ir

from fastcar_compile.core.errors import FastCarError
from fastcar_compile.passes.analysis import DiscoverPass, PlanPass, SelectLayersPass
from fastcar_compile.passes.branch import BranchPass
from fastcar_compile.passes.cache_state import CacheStatePass
from fastcar_compile.passes.context import CompileContext
from fastcar_compile.passes.fuse_norm import RmsNormFusionPass, SkipNormFusionPass
from fastcar_compile.passes.fuse_rotary import RotaryFusionPass
from fastcar_compile.passes.fused_attention import FusedAttentionPass
from fastcar_compile.passes.gate import GatePass
from fastcar_compile.passes.genai_state import GenaiConfigPass, GenaiStatePass
from fastcar_compile.passes.kv_dims import KvDimNamesPass
from fastcar_compile.passes.metadata import IrVersionPass, MetadataPass
from fastcar_compile.passes.native_gqa import NativeGqaPass
from fastcar_compile.passes.save import SavePass, Staging
from fastcar_compile.passes.validate import ValidatePass


def exporter_fusions(ctx: CompileContext) -> list[ir.passes.PassBase]:
    """The exporter-level fusions (`--fusions`), the first stage: what discovery, the plan and `--inspect` see."""
    return [RotaryFusionPass(ctx), RmsNormFusionPass(ctx), SkipNormFusionPass(ctx)] if ctx.options.fusions else []


def build(ctx: CompileContext, staging: Staging | None = None, validate: bool = True) -> ir.passes.PassManager:
    """The passes for `ctx.options`; with `staging` the result is validated (unless off) and saved."""
    passes: list[ir.passes.PassBase] = [
        *exporter_fusions(ctx),
        DiscoverPass(ctx),
        SelectLayersPass(ctx),
        PlanPass(ctx),
        *([FusedAttentionPass(ctx)] if ctx.options.fused_attention else []),
        GatePass(ctx),
        BranchPass(ctx),
        CacheStatePass(ctx),
        *([GenaiStatePass(ctx)] if ctx.genai_config is not None else []),
        *([NativeGqaPass(ctx.notes, ctx.swap_attention_node, lambda: ctx.exported_gqa)]
          if ctx.options.native_attention else []),
        KvDimNamesPass(ctx),
        IrVersionPass(ctx),
        MetadataPass(ctx),
    ]
    if staging is not None:
        if validate:
            passes.append(ValidatePass(staging))
        if ctx.genai_config is not None:  # staged with the model, committed together by the save
            passes.append(GenaiConfigPass(ctx, staging))
        passes.append(SavePass(staging))
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
