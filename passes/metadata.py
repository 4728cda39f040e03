"""Passes that finish the model: the IR version model-local functions need, and the `fastcar.*` metadata."""

from __future__ import annotations

import onnx_ir as ir

from fastcar_compile.core import contract, options
from fastcar_compile.core._version import __version__
from fastcar_compile.passes.context import CompileContext, DiTContext

# Model-local functions (the ai.fastcar ops ship as functions) need IR version 8.
FUNCTIONS_IR_VERSION = 8


class IrVersionPass(ir.passes.InPlacePass):
    """Raise the IR version to 8 when below (the ai.fastcar ops ship as model-local functions)."""

    def __init__(self, ctx: CompileContext):
        super().__init__()
        self.ctx = ctx

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        if model.ir_version >= FUNCTIONS_IR_VERSION:
            return ir.passes.PassResult(model, modified=False)
        self.ctx.notes.append(f"IR version raised from {model.ir_version} to {FUNCTIONS_IR_VERSION} "
                              "(model-local functions)")
        model.ir_version = FUNCTIONS_IR_VERSION
        return ir.passes.PassResult(model, modified=True)


def metadata_of(ctx: CompileContext) -> contract.FastCarMetadata:
    """The contract's metadata for what the passes did (first rewritten layer gives the model's sizes)."""
    opts, first = ctx.options, ctx.layers[0].match
    assert first.attention is not None and first.mlp is not None
    recorded = {o.record: getattr(opts, o.name) for o in options.OPTIONS if o.record}  # as declared
    recorded["threshold"] = opts.metadata_threshold
    return contract.FastCarMetadata(
        **recorded,
        version=__version__,
        layers=sorted(ctx.rewritten),
        num_layers=len(ctx.matches),
        hidden_size=first.mlp.hidden,
        num_heads=first.attention.num_heads,
        num_kv_heads=first.attention.num_kv_heads,
        head_dim=first.attention.head_dim,
        state=[s for lr in ctx.layers for s in lr.state] + ctx.kv_state,
        kv=[contract.KVEntry(contract.kv_input(m.layer, k), contract.kv_output(m.layer, k))
            for m in ctx.matches for k in contract.KV_KINDS],
        kv_compress=contract.kv_compress_record({n: c.to_dict() for n, c in ctx.plan.compressed.items()},
                                                opts.kv_diagnostics),
        multi_token_decode=True,  # the gate bodies of passes/fastcar_ops.py decide per token in decode steps
        rotary_positions=ctx.plan.rotary_positions,
    )


class MetadataPass(ir.passes.InPlacePass):
    """Write `fastcar.*` metadata_props (the schema is contract.FastCarMetadata)."""

    def __init__(self, ctx: CompileContext):
        super().__init__()
        self.ctx = ctx

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.ctx.metadata = metadata_of(self.ctx).to_props()
        model.metadata_props.update(self.ctx.metadata)
        return ir.passes.PassResult(model, modified=True)


class DiTMetadataPass(ir.passes.InPlacePass):
    """Write the DiT step graph's `fastcar.dit_*` metadata: the modes compiled in (contract.DiTModes), the cache's
    form, and the prompt graph's name beside the output."""

    def __init__(self, ctx: DiTContext):
        super().__init__()
        self.ctx = ctx

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        props = {contract.DIT_MODES_KEY: self.ctx.modes.to_json(), contract.DIT_CACHE_FORM_KEY: contract.CACHE_IN_PLACE}
        if self.ctx.prompt_name is not None:
            props[contract.DIT_TEXT_GRAPH_KEY] = self.ctx.prompt_name
        self.ctx.metadata = props
        model.metadata_props.update(props)
        return ir.passes.PassResult(model, modified=True)
