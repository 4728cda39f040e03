"""The compiler's pipeline: which `onnx_ir.passes` passes run, in order, for a set of options.

    discover -> select layers -> plan [-> fused attention] -> gate -> branch -> cache state [-> genai state]
    [-> native GroupQueryAttention]
    [-> rotary, q/k/v layout + packed gate [-> packed QKV + RoPE in the op], RMSNorm, MLP norm hoist,
     skip-norm fusions] -> row select into the gate
    -> KV dim names -> IR version -> metadata [-> validate] [-> genai config] [-> save]

Discovery runs once, on the export; the plan (passes/plan.py) is decided from it and the options, and every
later pass builds from the plan and from what the earlier passes recorded (the layer's match, LayerRewrite),
never from the ai.fastcar nodes in the graph. A new transformation is one module under passes/ plus one line
in `build`. `describe` is what
`fastcar-compile --verbose` prints.
"""

from __future__ import annotations

import onnx_ir as ir

from fastcar_compile.core.errors import FastCarError
from fastcar_compile.passes.analysis import DiscoverPass, PlanPass, SelectLayersPass
from fastcar_compile.passes.branch import BranchPass
from fastcar_compile.passes.cache_state import CacheStatePass
from fastcar_compile.passes.context import CompileContext
from fastcar_compile.passes.fuse_layout import FusedLayoutPass
from fastcar_compile.passes.fuse_norm import RmsNormFusionPass, SkipNormFusionPass
from fastcar_compile.passes.fuse_rotary import RotaryFusionPass
from fastcar_compile.passes.fuse_rows import RowGatePass
from fastcar_compile.passes.fused_attention import FusedAttentionPass
from fastcar_compile.passes.gate import GatePass
from fastcar_compile.passes.genai_state import GenaiConfigPass, GenaiStatePass
from fastcar_compile.passes.hoist_norm import NormHoistPass
from fastcar_compile.passes.kv_dims import KvDimNamesPass
from fastcar_compile.passes.metadata import IrVersionPass, MetadataPass
from fastcar_compile.passes.native_gqa import NativeGqaPass
from fastcar_compile.passes.pack_qkv import PackQkvPass
from fastcar_compile.passes.save import SavePass, Staging
from fastcar_compile.passes.validate import ValidatePass


def build(ctx: CompileContext, staging: Staging | None = None, validate: bool = True) -> ir.passes.PassManager:
    """The passes for `ctx.options`; with `staging` the result is validated (unless off) and saved."""
    passes: list[ir.passes.PassBase] = [
        DiscoverPass(ctx),
        SelectLayersPass(ctx),
        PlanPass(ctx),
        *([FusedAttentionPass(ctx)] if ctx.options.fused_attention else []),
        GatePass(ctx),
        BranchPass(ctx),
        CacheStatePass(ctx),
        *([GenaiStatePass(ctx)] if ctx.genai_config is not None else []),
        *([NativeGqaPass(ctx.notes, ctx.swap_attention_node)] if ctx.options.native_attention else []),
        *([RotaryFusionPass(ctx), FusedLayoutPass(ctx), *([PackQkvPass(ctx)] if ctx.options.pack_qkv else []),
           RmsNormFusionPass(ctx), NormHoistPass(ctx), SkipNormFusionPass(ctx)] if ctx.options.fusions else []),
        RowGatePass(ctx),
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
