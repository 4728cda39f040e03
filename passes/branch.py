"""The FastCar replay rewrite, part 2: branch selection and row compaction around each layer's MLP.

    rows, some = ai.fastcar.SelectRows(x, replay)        the MLP input's rows that compute ([1, n, hidden])
    out = If(some) -> the MLP's nodes on `rows`, once
               else -> rows (no row: the whole MLP is skipped)
    present_mlp_cache, present_mlp_age, used = ai.fastcar.MLPCacheMerge(past_mlp_cache, past_mlp_age, out, replay,
                                                                        slot, write)

`used` is each token's MLP output ([B, S, H]; reshaped to x's shape when x is not known to be 3-D): its computed
row, or its slot's cached one; the merge also writes it back (MLPCacheUpdate). The MLP nodes move into the If's subgraph once, one level below the main graph; weights stay in
the main graph and are read from the outer scope, so nothing is duplicated. This layout (`shared_mlp`, the
default) is what keeps the process small in ONNX Runtime: ORT prepacks a MatMul weight once per consuming node
and frees the plain copy only when every consumer prepacked it, and a consumer two If levels below the graph
owning the weight never finds it to prepack (session_state.cc looks one scope up). Per step it costs the If and
the MLP on a computing layer, the If and one Identity on a skipping one, besides the merge (in place of
MLPCacheUpdate) and SelectRows, which a packed gate does itself (select_rows). The older nested layout (kept
as `shared_mlp=False`)

    used = If(no token replays) -> the MLP on every token
           else If(some token computes) -> a copy of the MLP on the compacted rows, scattered into `cached`
                else -> cached

read every MLP weight from two nodes, one of them two levels down: the process held the plain weights and
their prepacked copy (+288 MiB on the hidden-1024 LLaMA; docs/memory.md). The MLP's closing Add reads `used`.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from fastcar_compile.core import contract
from fastcar_compile.passes import build
from fastcar_compile.passes.context import CompileContext, LayerRewrite
from fastcar_compile.passes.plan import Rows


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
        b = build.Builder(n, lr.nodes, lr.ids, graph=graph)
        full_nodes = list(mlp.nodes)
        graph.remove(full_nodes)
        build.tag(full_nodes, n, "mlp")
        used_shape = mlp.output.shape
        if self.ctx.plan[n].rows is Rows.NESTED:
            lr.used = self._nested(graph, lr, b, full_nodes)
        else:
            lr.used = self._shared(graph, lr, b, full_nodes)
        lr.used.type, lr.used.shape = ir.TensorType(dtype), used_shape  # (the skip-norm fusion checks it)
        mlp.closing.replace_input_with(list(mlp.closing.inputs).index(mlp.output), lr.used)
        graph.insert_before(mlp.closing, lr.nodes)
        lr.nodes = []

    def _shared(self, graph: ir.Graph, lr: LayerRewrite, b: build.Builder, full_nodes: list[ir.Node]) -> ir.Value:
        """SelectRows -> If(some row computes){the MLP's own nodes on the rows}{no row} -> MLPCacheMerge."""
        mlp, n, hd, dtype = lr.match.mlp, lr.layer, lr.hidden, lr.dtype
        assert mlp is not None
        x = mlp.entry
        if self.ctx.plan[n].rows is Rows.IN_GATE:  # the gate selected them (select_rows)
            assert lr.rows is not None
            rows, some = lr.rows
        else:
            rows, some = b(contract.SELECT_ROWS, [x, lr.replay], domain=contract.DOMAIN, outputs=2, part="mlp",
                           names=[f"fastcar.{n}.rows", f"fastcar.{n}.compute_some"])
        rows.type, rows.shape = ir.TensorType(dtype), ir.Shape([1, None, hd])
        some.type, some.shape = ir.TensorType(ir.DataType.BOOL), ir.Shape([])
        body: list[ir.Node] = []
        t = build.Builder(n, body, lr.ids, graph=graph)
        swap = {x: rows, **_row_shapes(graph, t, lr)}
        three = x.shape is not None and len(x.shape) == 3
        for node in full_nodes:
            for i, v in enumerate(node.inputs):
                if v in swap:
                    node.replace_input_with(i, swap[v])
            for out in node.outputs:  # the nodes see [1, rows, ...]: all B*S tokens or the computing ones
                out.shape = _any_rows(out.shape) if three else None
        build.tag(body, n, "mlp")
        body.extend(full_nodes)
        y = mlp.output
        y.type = ir.TensorType(dtype)
        skip_nodes: list[ir.Node] = []
        none = build.Builder(n, skip_nodes, lr.ids, graph=graph)("Identity", [rows], part="mlp")  # [1, 0, hidden]
        none.type = ir.TensorType(dtype)
        out = b("If", [some], {"then_branch": ir.Graph([], [y], nodes=body, name=f"fastcar_{n}_mlp_compute"),
                               "else_branch": ir.Graph([], [none], nodes=skip_nodes, name=f"fastcar_{n}_mlp_none")},
                part="mlp", names=[f"fastcar.{n}.mlp_rows"])
        out.type = ir.TensorType(dtype)
        present_cache, present_age, used = b(
            contract.MLP_CACHE_MERGE, [lr.past_cache, lr.past_age, out, lr.replay, lr.slot, lr.write],
            self.ctx.age_attrs, domain=contract.DOMAIN, outputs=3, part="cache",
            names=[contract.mlp_cache_output(n), contract.mlp_age_output(n),
                   f"fastcar.{n}.mlp_used" + ("" if three else "_bsh")])
        lr.present = (present_cache, present_age)
        # the merge returns [B, S, H]; the residual stream may be [B*S, H] (or of unknown rank). Untested for a real
        # 2-D entry: test_an_unknown_rank_mlp_entry_still_compiles_and_runs only reaches this with a [B, S, H] one
        if not three:
            used = b("Reshape", [used, b("Shape", [x], part="mlp")], part="mlp", names=[f"fastcar.{n}.mlp_used"])
        return used

    def _nested(self, graph: ir.Graph, lr: LayerRewrite, b: build.Builder, full_nodes: list[ir.Node]) -> ir.Value:
        """The older layout: If(all compute){MLP} else If(some compute){MLP copy on compacted rows} else cached."""
        mlp, n, dtype = lr.match.mlp, lr.layer, lr.dtype
        assert mlp is not None
        if lr.cached is not None and lr.conditions is not None:  # the packed gate read them already
            cached, (all_keep, any_keep) = lr.cached, lr.conditions
        else:
            cached = b(contract.MLP_CACHE_READ, [lr.past_cache, lr.slot], domain=contract.DOMAIN, part="cache")
            # the token count comes from the graph's token input when there is one, the same node in every
            # layer (ORT's common-subexpression elimination then runs it once per step)
            tokens = next((v for v in graph.inputs if v.name == contract.INPUT_IDS), lr.replay)
            n_replay = b("ReduceSum", [b("Cast", [lr.replay], {"to": ir.DataType.INT64})], {"keepdims": 0})
            all_keep = b("Equal", [n_replay, build.const(graph, "fastcar.zero", np.array(0, np.int64))])
            any_keep = b("Less", [n_replay, b("Size", [tokens])])
        none_nodes: list[ir.Node] = []
        skipped = build.Builder(n, none_nodes, lr.ids, graph=graph)("Identity", [cached], part="cache")
        skipped.type = ir.TensorType(dtype)
        skip = ir.Graph([], [skipped], nodes=none_nodes, name=f"fastcar_{n}_mlp_none")
        full = ir.Graph([], [mlp.output], nodes=full_nodes, name=f"fastcar_{n}_mlp_all")
        mixed, comp_nodes = self._compacted(graph, lr, cached, full_nodes)
        compact = ir.Graph([], [mixed], nodes=comp_nodes, name=f"fastcar_{n}_mlp_some")
        partial_nodes: list[ir.Node] = []
        inner = build.Builder(n, partial_nodes, lr.ids, graph=graph)("If", [any_keep],
                                                        {"then_branch": compact, "else_branch": skip}, part="mlp")
        partial = ir.Graph([], [inner], nodes=partial_nodes, name=f"fastcar_{n}_mlp_partial")
        for out in (mlp.output, mixed, inner):
            out.type = ir.TensorType(dtype)
        used = b("If", [all_keep], {"then_branch": full, "else_branch": partial}, part="mlp",
                 names=[f"fastcar.{n}.mlp_used"])
        return used

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
        c = build.Builder(n, comp_nodes, lr.ids, graph=graph)
        x = mlp.entry
        flat = build.const(graph, f"fastcar.shape.flat_{hd}", np.array([-1, hd], np.int64))
        axis0 = build.const(graph, "fastcar.axes0", np.array([0], np.int64))
        axis1 = build.const(graph, "fastcar.axes1", np.array([1], np.int64))
        idx = BranchPass._rows(graph, c, lr)
        xc = c("Unsqueeze", [c("Gather", [c("Reshape", [x, flat]), idx], {"axis": 0}), axis0])
        mapping: dict[ir.Value, ir.Value] = {x: xc, **_row_shapes(graph, c, lr)}
        clones = build.clone(full_nodes, mapping, f"/fastcar_compact_{n}")
        comp_nodes.extend(clones)
        mc = c("Reshape", [mapping[mlp.output], flat], part="mlp")
        scattered = c("ScatterND", [c("Reshape", [cached, flat]), c("Unsqueeze", [idx, axis1]), mc])
        mixed = c("Reshape", [scattered, c("Shape", [x])])
        build.tag(comp_nodes, n, "mlp")
        return mixed, comp_nodes


def _row_shapes(graph: ir.Graph, c: build.Builder, lr: LayerRewrite) -> dict[ir.Value, ir.Value]:
    """The shape tensors the MLP's Reshapes read from outside ([B, S, F] / [B*S, F], computed for all tokens)
    rebuilt for rows [1, n, hidden]: [1, .., -1, F]."""
    assert lr.match.mlp is not None
    out = {}
    for k_ext, (shape_value, rank) in enumerate(lr.match.mlp.external_shapes.items()):
        lead = build.const(graph, f"fastcar.shape.lead{rank}", np.array([1] * (rank - 2) + [-1], np.int64))
        last = c("Slice", [shape_value, build.const(graph, "fastcar.m1", np.array([-1], np.int64)),
                           build.const(graph, "fastcar.big", np.array([2**62], np.int64))])
        out[shape_value] = c("Concat", [lead, last], {"axis": 0}, names=[f"fastcar.{lr.layer}.shape_ext{k_ext}"])
    return out


def _any_rows(shape: ir.Shape | None) -> ir.Shape | None:
    """`shape` with every axis but the last unknown: the branch's nodes see all rows or the compacted ones."""
    if shape is None or len(shape) < 2:
        return shape
    return ir.Shape([None] * (len(shape) - 1) + [shape[-1]])
