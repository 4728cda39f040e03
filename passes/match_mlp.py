"""Isolating an MLP branch: every node between its entry and its output, read only from the entry and weights.

The rewrite moves these nodes into an If branch and runs a copy on compacted rows, so the branch may read
nothing computed outside it except shape tensors of its Reshapes (dynamo's shared symbolic sizes, rebuilt
for the compacted row count) and may expose nothing but its output.
"""

from __future__ import annotations

import onnx_ir as ir

from fastcar_compile.passes import graph_utils as gu
from fastcar_compile.passes.layer_match import MLPBlock
from fastcar_compile.passes.match_base import MatchContext, MatchFailure


def isolate(ctx: MatchContext, entry: ir.Value, branch_out: ir.Value, residual: ir.Value, closing: ir.Node,
            fused: bool) -> MLPBlock:
    """The MLPBlock from `entry` to `branch_out` (added to the stream by `closing`), or why it is not one."""
    candidates = gu.ancestors_until([branch_out], {entry})
    nodes_set = gu.descendants(entry, candidates)
    nodes = [n for n in ctx.nodes if n in nodes_set]
    produced = {o for n in nodes for o in n.outputs}
    memo: dict = {}
    external_shapes: dict[ir.Value, int] = {}
    for node in nodes:
        for pos, inp in enumerate(node.inputs):
            if inp is None or inp is entry or inp in produced or gu.is_static(inp, memo):
                continue
            dims = gu.static_dims(inp)
            if node.op_type == "Reshape" and pos == 1 and dims is not None and len(dims) == 1 and dims[0]:
                external_shapes[inp] = int(dims[0])
                continue
            raise MatchFailure("mlp", f"MLP branch reads {inp.name} from outside the branch "
                               f"(produced by {gu.describe(inp.producer())}); cannot isolate it", gu.describe(node))
        for out in node.outputs:
            if out is branch_out:
                continue
            outside = [c for c in out.consumers() if c not in nodes_set]
            if outside or out.is_graph_output():
                raise MatchFailure("mlp", f"MLP value {out.name} is also used outside the branch",
                                   ", ".join(gu.describe(c) for c in outside) or "graph output")
    weights = []
    for node in nodes:
        if node.op_type == "MatMulNBits":  # packed 4-bit blocks: the logical shape is in the attributes
            weights.append((int(node.attributes["K"].value), int(node.attributes["N"].value)))
        elif node.op_type in gu.MATMUL_OPS:
            shape = gu.weight_shape(node.inputs[1])
            if shape is not None:
                weights.append(shape)
    if not weights:
        raise MatchFailure("mlp", "branch has no MatMul with a weight initializer", gu.describe(closing))
    edims = gu.static_dims(entry)
    hidden = edims[-1] if edims and edims[-1] is not None else weights[0][0]
    ctx.trace.append(f"MLP branch: {len(nodes)} nodes, weights {weights}, closed by {gu.describe(closing)}")
    return MLPBlock(entry, branch_out, residual, closing, nodes, weights, int(hidden), fused, external_shapes)
