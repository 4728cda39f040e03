"""The FastCar replay rewrite, part 3: the per-layer cache state (DESIGN.md "Graph inputs/outputs").

Each rewritten layer carries `past_mlp_cache.N` [batch, L, hidden] (the MLP output per slot) and
`past_mlp_age.N` [batch, L] (how often each slot was replayed in a row) from step to step. `declare_state`
adds the two inputs (the gate reads the ages, the branch the cache); `CacheStatePass` writes the value each
token used back (`MLPCacheUpdate`; BranchPass's `MLPCacheMerge` did it in the shared layout), adds the `present_*` outputs (and the gate's diagnostics outputs) and
records the state pairs for the metadata.
"""

from __future__ import annotations

import onnx_ir as ir

from fastcar_compile.core import contract
from fastcar_compile.passes import build
from fastcar_compile.passes.context import CompileContext, LayerRewrite
from fastcar_compile.passes.discover import LayerMatch


def declare_state(graph: ir.Graph, ctx: CompileContext, match: LayerMatch, index: int) -> LayerRewrite:
    """Add the layer's state inputs and start its `LayerRewrite`."""
    assert match.mlp is not None
    n, L, hd = match.layer, ctx.options.frame_tokens, match.mlp.hidden
    dtype = match.mlp.entry.dtype or ir.DataType.FLOAT
    past_cache = build.graph_input(graph, contract.mlp_cache_input(n), dtype, [ctx.batch, L, hd])
    past_age = build.graph_input(graph, contract.mlp_age_input(n), ir.DataType.INT64, [ctx.batch, L])
    return LayerRewrite(match, index, dtype, past_cache, past_age)


class CacheStatePass(ir.passes.InPlacePass):
    """Write back the used MLP value and its age per slot; expose the state (and diagnostics) as outputs."""

    def __init__(self, ctx: CompileContext):
        super().__init__()
        self.ctx = ctx

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        for lr in self.ctx.layers:
            self._update(model.graph, lr)
        return ir.passes.PassResult(model, modified=bool(self.ctx.layers))

    def _update(self, graph: ir.Graph, lr: LayerRewrite) -> None:
        ctx, n, L, hd = self.ctx, lr.layer, self.ctx.options.frame_tokens, lr.hidden
        assert lr.used is not None and lr.match.mlp is not None
        nodes: list[ir.Node] = []
        b = build.Builder(n, nodes, lr.ids, graph=graph)
        if lr.present is not None:  # BranchPass's MLPCacheMerge wrote the used rows back already
            present_cache, present_age = lr.present
        else:
            present_cache, present_age = b(contract.MLP_CACHE_UPDATE,
                                           [lr.past_cache, lr.past_age, lr.used, lr.replay, lr.slot, lr.write],
                                           ctx.age_attrs, domain=contract.DOMAIN, outputs=2, part="cache",
                                           names=[contract.mlp_cache_output(n), contract.mlp_age_output(n)])
        build.graph_output(graph, present_cache, contract.mlp_cache_output(n), lr.dtype, [ctx.batch, L, hd])
        build.graph_output(graph, present_age, contract.mlp_age_output(n), ir.DataType.INT64, [ctx.batch, L])
        if ctx.options.emit_diagnostics:
            build.graph_output(graph, lr.replay, contract.replay_mask_output(n), ir.DataType.BOOL, [ctx.batch, "seq"])
            build.graph_output(graph, lr.tas, contract.tas_output(n), ir.DataType.FLOAT, [ctx.batch, "seq"])
        graph.insert_before(lr.match.mlp.closing, nodes)
        dtype = lr.dtype.name.lower()
        lr.state = [
            contract.StateEntry(lr.past_cache.name, contract.mlp_cache_output(n), ("batch", L, hd), dtype,
                                contract.CACHE_FILL),
            contract.StateEntry(lr.past_age.name, contract.mlp_age_output(n), ("batch", L), "int64",
                                contract.AGE_FILL),
        ]
