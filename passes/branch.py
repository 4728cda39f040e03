"""The FastCar replay rewrite, part 2: branch selection and row compaction around each layer's MLP.

    cached = ai.fastcar.MLPCacheRead(past_mlp_cache, slot)
    used = If(no token replays)   -> the original MLP on every token (no compaction cost at 0% replay)
           elif(some token computes) -> the MLP on the compacted rows, scattered into `cached`
           else -> cached               (the whole MLP is skipped)

The MLP nodes move into the If's subgraph (a copy serves the compacted branch); weights stay in the main
graph and are read from the outer scope, so nothing is duplicated. The MLP's closing Add then reads `used`.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from fastcar_compile import contract
from fastcar_compile.passes import build
from fastcar_compile.passes.context import CompileContext, LayerRewrite


class BranchPass(ir.passes.InPlacePass):
    """Per layer: MLPCacheRead and the If that runs the MLP on all, the compacted, or no rows."""

    def __init__(self, ctx: CompileContext):
        super().__init__()
        self.ctx = ctx

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        for lr in self.ctx.layers:
            self._branch(model.graph, lr)
        return ir.passes.PassResult(model, modified=bool(self.ctx.layers))

    def _branch(self, graph: ir.Graph, lr: LayerRewrite) -> None:
        mlp, n, dtype = lr.match.mlp, lr.layer, lr.dtype
        assert mlp is not None and lr.replay is not None
        b = build.Builder(n, lr.nodes, lr.ids)
        if lr.cached is not None and lr.conditions is not None:  # the packed gate read them already
            cached, (all_keep, any_keep) = lr.cached, lr.conditions
        else:
            cached = b(contract.MLP_CACHE_READ, [lr.past_cache, lr.slot], domain=contract.DOMAIN, part="cache")
            # Few nodes per layer on the main graph (each costs a kernel launch every step, replayed or not);
            # the token count comes from the graph's token input when there is one, the same node in every
            # layer (ORT's common-subexpression elimination then runs it once per step).
            tokens = next((v for v in graph.inputs if v.name == contract.INPUT_IDS), lr.replay)
            n_replay = b("ReduceSum", [b("Cast", [lr.replay], {"to": ir.DataType.INT64})], {"keepdims": 0})
            all_keep = b("Equal", [n_replay, build.const(graph, "fastcar.zero", np.array(0, np.int64))])
            any_keep = b("Less", [n_replay, b("Size", [tokens])])

        # Branch 1: every token computes: the original nodes, moved.
        full_nodes = list(mlp.nodes)
        graph.remove(full_nodes)
        build.tag(full_nodes, n, "mlp")
        full = ir.Graph([], [mlp.output], nodes=full_nodes, name=f"fastcar_{n}_mlp_all")
        mixed, comp_nodes = self._compacted(graph, lr, cached, full_nodes)
        compact = ir.Graph([], [mixed], nodes=comp_nodes, name=f"fastcar_{n}_mlp_some")

        # Branch 3: every token replays: the MLP is skipped.
        none_nodes: list[ir.Node] = []
        skipped = build.Builder(n, none_nodes, lr.ids)("Identity", [cached], part="cache")
        skip = ir.Graph([], [skipped], nodes=none_nodes, name=f"fastcar_{n}_mlp_none")

        partial_nodes: list[ir.Node] = []
        inner = build.Builder(n, partial_nodes, lr.ids)("If", [any_keep], {"then_branch": compact, "else_branch": skip},
                                                        part="mlp")
        partial = ir.Graph([], [inner], nodes=partial_nodes, name=f"fastcar_{n}_mlp_partial")
        for out in (mlp.output, mixed, skipped, inner):
            out.type = ir.TensorType(dtype)
        lr.used = b("If", [all_keep], {"then_branch": full, "else_branch": partial}, part="mlp",
                    names=[f"fastcar.{n}.mlp_used"])
        lr.used.type, lr.used.shape = ir.TensorType(dtype), mlp.output.shape  # (the skip-norm fusion checks it)
        mlp.closing.replace_input_with(list(mlp.closing.inputs).index(mlp.output), lr.used)
        graph.insert_before(mlp.closing, lr.nodes)
        lr.nodes = []

    @staticmethod
    def _compacted(graph: ir.Graph, lr: LayerRewrite, cached: ir.Value,
                   full_nodes: list[ir.Node]) -> tuple[ir.Value, list[ir.Node]]:
        """Branch 2: the MLP on the rows that compute, over the flattened (row, token) axis."""
        mlp, n, hd = lr.match.mlp, lr.layer, lr.hidden
        assert mlp is not None
        comp_nodes: list[ir.Node] = []
        c = build.Builder(n, comp_nodes, lr.ids)
        keep = c("Not", [lr.replay])
        x = mlp.entry
        flat = build.const(graph, f"fastcar.shape.flat_{hd}", np.array([-1, hd], np.int64))
        axis0 = build.const(graph, "fastcar.axes0", np.array([0], np.int64))
        axis1 = build.const(graph, "fastcar.axes1", np.array([1], np.int64))
        m1 = build.const(graph, "fastcar.shape.m1", np.array([-1], np.int64))
        idx = c("Squeeze", [c("NonZero", [c("Reshape", [keep, m1])]), axis0])
        xc = c("Unsqueeze", [c("Gather", [c("Reshape", [x, flat]), idx], {"axis": 0}), axis0])
        mapping: dict[ir.Value, ir.Value] = {x: xc}
        for k_ext, (shape_value, rank) in enumerate(mlp.external_shapes.items()):
            # [B, S, F] / [B*S, F] computed for all rows -> [1, .., -1, F] for the compacted rows.
            lead = build.const(graph, f"fastcar.shape.lead{rank}", np.array([1] * (rank - 2) + [-1], np.int64))
            last = c("Slice", [shape_value, build.const(graph, "fastcar.m1", np.array([-1], np.int64)),
                               build.const(graph, "fastcar.big", np.array([2**62], np.int64))])
            mapping[shape_value] = c("Concat", [lead, last], {"axis": 0}, names=[f"fastcar.{n}.shape_ext{k_ext}"])
        clones = build.clone(full_nodes, mapping, f"/fastcar_compact_{n}")
        comp_nodes.extend(clones)
        mc = c("Reshape", [mapping[mlp.output], flat], part="mlp")
        scattered = c("ScatterND", [c("Reshape", [cached, flat]), c("Unsqueeze", [idx, axis1]), mc])
        mixed = c("Reshape", [scattered, c("Shape", [x])])
        build.tag(comp_nodes, n, "mlp")
        return mixed, comp_nodes
