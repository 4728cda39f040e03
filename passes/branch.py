"""The FastCar replay rewrite, part 2: branch selection and row compaction around each layer's MLP.

    cached = ai.fastcar.MLPCacheRead(past_mlp_cache, slot)
    used = If(some token computes)
             rows = If(no token replays) -> the MLP's input as it is (no compaction cost at 0% replay)
                                    else -> the rows that compute (NonZero, Gather)
             out  = the MLP's nodes on `rows`, once
             used = If(no token replays) -> out   else -> out scattered into `cached` (ScatterND)
           else -> cached               (the whole MLP is skipped)

The MLP nodes move into the If's subgraph once, one level below the main graph; weights stay in the main
graph and are read from the outer scope, so nothing is duplicated. This layout (`shared_mlp`, the default) is
what keeps the process small in ONNX Runtime: ORT prepacks a MatMul weight once per consuming node and frees
the plain copy only when every consumer prepacked it, and a consumer two If levels below the graph owning the
weight never finds it to prepack (session_state.cc looks one scope up). The older nested layout (kept as
`shared_mlp=False`)

    used = If(no token replays) -> the MLP on every token
           else If(some token computes) -> a copy of the MLP on the compacted rows, scattered into `cached`
                else -> cached

read every MLP weight from two nodes, one of them two levels down: the process held the plain weights and
their prepacked copy (+288 MiB on the hidden-1024 LLaMA; docs/memory.md). The MLP's closing Add reads `used`.
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

        full_nodes = list(mlp.nodes)
        graph.remove(full_nodes)
        build.tag(full_nodes, n, "mlp")
        used_shape = mlp.output.shape

        # every token replays: the MLP is skipped
        none_nodes: list[ir.Node] = []
        skipped = build.Builder(n, none_nodes, lr.ids)("Identity", [cached], part="cache")
        skip = ir.Graph([], [skipped], nodes=none_nodes, name=f"fastcar_{n}_mlp_none")
        skipped.type = ir.TensorType(dtype)
        if self.ctx.options.shared_mlp:
            compute = self._shared(graph, lr, cached, all_keep, full_nodes)
            lr.used = b("If", [any_keep], {"then_branch": compute, "else_branch": skip}, part="mlp",
                        names=[f"fastcar.{n}.mlp_used"])
        else:
            full = ir.Graph([], [mlp.output], nodes=full_nodes, name=f"fastcar_{n}_mlp_all")
            mixed, comp_nodes = self._compacted(graph, lr, cached, full_nodes)
            compact = ir.Graph([], [mixed], nodes=comp_nodes, name=f"fastcar_{n}_mlp_some")
            partial_nodes: list[ir.Node] = []
            inner = build.Builder(n, partial_nodes, lr.ids)("If", [any_keep],
                                                            {"then_branch": compact, "else_branch": skip}, part="mlp")
            partial = ir.Graph([], [inner], nodes=partial_nodes, name=f"fastcar_{n}_mlp_partial")
            for out in (mlp.output, mixed, inner):
                out.type = ir.TensorType(dtype)
            lr.used = b("If", [all_keep], {"then_branch": full, "else_branch": partial}, part="mlp",
                        names=[f"fastcar.{n}.mlp_used"])
        lr.used.type, lr.used.shape = ir.TensorType(dtype), used_shape  # (the skip-norm fusion checks it)
        mlp.closing.replace_input_with(list(mlp.closing.inputs).index(mlp.output), lr.used)
        graph.insert_before(mlp.closing, lr.nodes)
        lr.nodes = []

    def _shared(self, graph: ir.Graph, lr: LayerRewrite, cached: ir.Value, all_keep: ir.Value,
                full_nodes: list[ir.Node]) -> ir.Graph:
        """The compute branch: rows (all, or the compacted ones) -> the MLP's own nodes once -> merged rows."""
        mlp, n, hd, dtype = lr.match.mlp, lr.layer, lr.hidden, lr.dtype
        assert mlp is not None
        x = mlp.entry
        ext = list(mlp.external_shapes.items())  # shape tensors the MLP's Reshapes read, with their length
        flat = build.const(graph, f"fastcar.shape.flat_{hd}", np.array([-1, hd], np.int64))
        axis0 = build.const(graph, "fastcar.axes0", np.array([0], np.int64))
        axis1 = build.const(graph, "fastcar.axes1", np.array([1], np.int64))

        # rows, every token computes: the MLP's inputs as they are
        as_is: list[ir.Node] = []
        a = build.Builder(n, as_is, lr.ids)
        outs_all = [a("Identity", [v], part="mlp") for v in (x, *(v for v, _ in ext))]
        # rows, some tokens compute: [1, rows, hidden] and the shape tensors rebuilt for that row count
        some: list[ir.Node] = []
        c = build.Builder(n, some, lr.ids)
        idx = self._rows(graph, c, lr)
        outs_some = [c("Unsqueeze", [c("Gather", [c("Reshape", [x, flat]), idx], {"axis": 0}), axis0])]
        for k_ext, (shape_value, rank) in enumerate(ext):
            # [B, S, F] / [B*S, F] computed for all rows -> [1, .., -1, F] for the compacted rows.
            lead = build.const(graph, f"fastcar.shape.lead{rank}", np.array([1] * (rank - 2) + [-1], np.int64))
            last = c("Slice", [shape_value, build.const(graph, "fastcar.m1", np.array([-1], np.int64)),
                               build.const(graph, "fastcar.big", np.array([2**62], np.int64))])
            outs_some.append(c("Concat", [lead, last], {"axis": 0}, names=[f"fastcar.{n}.shape_ext{k_ext}"]))
        build.tag(some, n, "mlp")
        sources = (x, *(v for v, _ in ext))
        types = [ir.TensorType(dtype), *[ir.TensorType(ir.DataType.INT64)] * len(ext)]  # when a source has none
        types = [src.type if src.type is not None else t for src, t in zip(sources, types, strict=True)]
        for va, vs, ty in zip(outs_all, outs_some, types, strict=True):
            va.type = vs.type = ty
        body: list[ir.Node] = []
        t = build.Builder(n, body, lr.ids)
        rows = t("If", [all_keep], {"then_branch": ir.Graph([], outs_all, nodes=as_is, name=f"fastcar_{n}_rows_all"),
                                    "else_branch": ir.Graph([], outs_some, nodes=some, name=f"fastcar_{n}_rows_some")},
                 outputs=len(outs_all), part="mlp")
        rows = rows if isinstance(rows, tuple) else (rows,)
        for r, src, ty in zip(rows, sources, types, strict=True):
            r.type, r.shape = ty, _any_rows(src.shape)
        swap = dict(zip(sources, rows, strict=True))
        for node in full_nodes:
            for i, v in enumerate(node.inputs):
                if v in swap:
                    node.replace_input_with(i, swap[v])
            for out in node.outputs:  # the same nodes see B*S rows or the compacted ones
                out.shape = _any_rows(out.shape)
        body.extend(full_nodes)
        y = mlp.output
        y.type = ir.TensorType(dtype)

        kept: list[ir.Node] = []
        y_all = build.Builder(n, kept, lr.ids)("Identity", [y], part="mlp")
        scatter: list[ir.Node] = []
        s = build.Builder(n, scatter, lr.ids)
        idx_s = self._rows(graph, s, lr)
        scattered = s("ScatterND", [s("Reshape", [cached, flat]), s("Unsqueeze", [idx_s, axis1]),
                                    s("Reshape", [y, flat])])
        y_some = s("Reshape", [scattered, s("Shape", [x])])
        build.tag(scatter, n, "mlp")
        y_all.type = y_some.type = ir.TensorType(dtype)
        merged = t("If", [all_keep], {"then_branch": ir.Graph([], [y_all], nodes=kept, name=f"fastcar_{n}_mlp_all"),
                                      "else_branch": ir.Graph([], [y_some], nodes=scatter, name=f"fastcar_{n}_mlp_some")},
                   part="mlp")
        merged.type = ir.TensorType(dtype)
        return ir.Graph([], [merged], nodes=body, name=f"fastcar_{n}_mlp_compute")

    @staticmethod
    def _rows(graph: ir.Graph, c: build.Builder, lr: LayerRewrite) -> ir.Value:
        """Indices of the (row, token) positions that compute, over the flattened axis."""
        axis0 = build.const(graph, "fastcar.axes0", np.array([0], np.int64))
        m1 = build.const(graph, "fastcar.shape.m1", np.array([-1], np.int64))
        return c("Squeeze", [c("NonZero", [c("Reshape", [c("Not", [lr.replay]), m1])]), axis0])

    @staticmethod
    def _compacted(graph: ir.Graph, lr: LayerRewrite, cached: ir.Value,
                   full_nodes: list[ir.Node]) -> tuple[ir.Value, list[ir.Node]]:
        """Nested layout, branch 2: a copy of the MLP on the rows that compute, over the flattened (row, token) axis."""
        mlp, n, hd = lr.match.mlp, lr.layer, lr.hidden
        assert mlp is not None
        comp_nodes: list[ir.Node] = []
        c = build.Builder(n, comp_nodes, lr.ids)
        x = mlp.entry
        flat = build.const(graph, f"fastcar.shape.flat_{hd}", np.array([-1, hd], np.int64))
        axis0 = build.const(graph, "fastcar.axes0", np.array([0], np.int64))
        axis1 = build.const(graph, "fastcar.axes1", np.array([1], np.int64))
        idx = BranchPass._rows(graph, c, lr)
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


def _any_rows(shape: ir.Shape | None) -> ir.Shape | None:
    """`shape` with every axis but the last unknown: the branch's nodes see all rows or the compacted ones."""
    if shape is None or len(shape) < 2:
        return shape
    return ir.Shape([None] * (len(shape) - 1) + [shape[-1]])
