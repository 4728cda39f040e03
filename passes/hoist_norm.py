"""The MLP's norm out of the FastCar `If`: one main-graph norm the skip fusion then joins to the residual Add.

BranchPass moves the whole MLP, its RMSNorm included, into the If's all-compute branch, so a decode step at 0%
replay runs the attention's residual Add on the main graph and the norm inside the branch: two launches where
onnxruntime-genai's graph runs one SkipSimplifiedLayerNormalization. The norm is row-wise and cheap (one
[B, S, hidden] pass), so computing it on every step, replayed or not, costs nothing measurable; this pass moves
the all-compute branch's SimplifiedLayerNormalization of an outer value in front of the If, where
SkipNormFusionPass (next) fuses it with the residual Add. The compacted branch keeps its own norm of the
gathered rows (it reads the residual sum, which the fused node still outputs). Same operations on the same
values: exact. In BranchPass's shared layout (one MLP behind a rows `If`) the norm moves in front of that
selection instead (`_hoist_from_rows`).
"""

from __future__ import annotations

import onnx_ir as ir

from fastcar_compile import contract
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
        for node in list(graph):
            if node.op_type != "If" or contract.TAG_LAYER not in node.metadata_props:
                continue
            then = node.attributes.get("then_branch")
            if then is None or then.type != ir.AttributeType.GRAPH:
                continue
            if _hoist_from_rows(graph, node, then.value):
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


def _hoist_from_rows(graph: ir.Graph, layer_if: ir.Node, compute: ir.Graph) -> bool:
    """BranchPass's shared layout (passes/branch.py): the compute branch starts with the rows `If` (all rows as
    they are | the compacted ones) and the MLP's norm reads its first output. The norm then runs on the main
    graph before that selection, and both row choices take the normalised rows: a row-wise norm of the
    gathered rows is the gathered rows of the norm, so the values are the same."""
    nodes = list(compute)
    rows_if = nodes[0] if nodes and nodes[0].op_type == "If" else None
    if rows_if is None:
        return False
    as_is, some = rows_if.attributes.get("then_branch"), rows_if.attributes.get("else_branch")
    if as_is is None or some is None:
        return False
    first = as_is.value.outputs[0].producer() if as_is.value.outputs else None
    if first is None or first.op_type != "Identity":
        return False
    x, rows = first.inputs[0], rows_if.outputs[0]
    readers = rows.consumers()
    if len(readers) != 1 or readers[0].op_type != NORM or readers[0].domain != "" or \
            readers[0].inputs[0] is not rows:
        return False
    norm = readers[0]
    inside = {v for n in compute for v in n.outputs}
    if any(v is None or v in inside for v in norm.inputs[1:]) or norm.outputs[0].is_graph_output():
        return False
    normed = norm.outputs[0]
    ir.convenience.replace_all_uses_with(normed, rows)
    compute.remove(norm)
    norm.replace_input_with(0, x)
    graph.insert_before(layer_if, norm)
    first.replace_input_with(0, normed)
    for n in some.value:  # the compacted rows are gathered from the normalised ones
        for i, v in enumerate(n.inputs):
            if v is x:
                n.replace_input_with(i, normed)
    rows.shape = normed.shape
    return True
