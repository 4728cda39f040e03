"""The MLP's norm out of the FastCar `If`: one main-graph norm the skip fusion then joins to the residual Add.

BranchPass moves the whole MLP, its RMSNorm included, into the If's all-compute branch, so a decode step at 0%
replay runs the attention's residual Add on the main graph and the norm inside the branch: two launches where
onnxruntime-genai's graph runs one SkipSimplifiedLayerNormalization. The norm is row-wise and cheap (one
[B, S, hidden] pass), so computing it on every step, replayed or not, costs nothing measurable; this pass moves
the all-compute branch's SimplifiedLayerNormalization of an outer value in front of the If, where
SkipNormFusionPass (next) fuses it with the residual Add. The compacted branch keeps its own norm of the
gathered rows (it reads the residual sum, which the fused node still outputs). Same operations on the same
values: exact. In BranchPass's shared layout (SelectRows, then one MLP behind the `If`) the norm moves in front
of the row selection instead (`_hoist_from_rows`).
"""

from __future__ import annotations

import onnx_ir as ir

from fastcar_compile.passes.context import CompileContext

NORM = "SimplifiedLayerNormalization"


def _hoistable(branch: ir.Graph) -> ir.Node | None:
    """The branch's norm of a value from outside it (weight from outside too), else None."""
    inside = {v for node in branch for v in node.outputs}
    for node in branch:
        if node.op_type == NORM and node.domain == "" and all(v is not None and v not in inside
                                                              for v in node.inputs):
            return node
    return None


class NormHoistPass(ir.passes.InPlacePass):
    """The If's all-compute MLP norm -> the main graph (then fused with the residual Add into a skip norm)."""

    def __init__(self, ctx: CompileContext):
        super().__init__()
        self.ctx = ctx

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        count = 0
        for lr in self.ctx.layers:  # the If BranchPass built around each rewritten layer's MLP
            node = lr.branch
            then = node.attributes.get("then_branch") if node is not None else None
            if then is None or then.type != ir.AttributeType.GRAPH:
                continue
            if lr.select is not None and _hoist_from_rows(graph, node, lr.select, then.value):
                count += 1
                continue
            norm = _hoistable(then.value)
            if norm is None or norm.outputs[0].is_graph_output():
                continue
            then.value.remove(norm)
            graph.insert_before(node, norm)
            count += 1
        if count:
            self.ctx.notes.append(f"moved {count} MLP norms out of the FastCar If")
        return ir.passes.PassResult(model, modified=count > 0)


def _hoist_from_rows(graph: ir.Graph, layer_if: ir.Node, select: ir.Node, compute: ir.Graph) -> bool:
    """BranchPass's shared layout (passes/branch.py): `rows, some = SelectRows(x, replay)` on the main graph,
    `If(some)` whose compute branch starts with the MLP's norm of `rows`. The norm then runs on the main graph
    before the selection, which takes the normalised rows: a row-wise norm of the selected rows is the selected
    rows of the norm, so the values are the same."""
    if select.outputs[1] is not layer_if.inputs[0]:
        return False
    x, rows = select.inputs[0], select.outputs[0]
    readers = [n for n in compute if rows in n.inputs]
    if len(readers) != 1 or readers[0].op_type != NORM or readers[0].domain != "" or readers[0].inputs[0] is not rows:
        return False
    norm = readers[0]
    inside = {v for n in compute for v in n.outputs}
    if any(v is None or v in inside for v in norm.inputs[1:]) or norm.outputs[0].is_graph_output():
        return False
    normed = norm.outputs[0]
    ir.convenience.replace_all_uses_with(normed, rows)
    compute.remove(norm)
    norm.replace_input_with(0, x)
    graph.insert_before(select, norm)
    select.replace_input_with(0, normed)
    normed.shape = x.shape
    return True
