"""Packed projections: MatMuls that read one activation with constant weights -> one MatMul + Split.

The exporters keep q/k/v (and the MLP's gate/up) as separate MatMuls on the same normalised input, where
onnxruntime-genai's builder packs them: at decode (one row) each is a matrix-vector product, so three
launches of a small GEMV become one wider one (the kv projections are only 2 * 64 columns here). The weights
are concatenated along their output axis once, at compile time; every output column is the same dot product
over the same K as before. Runs after the FastCar rewrite, in the main graph and the If branches (the packed
weight lives in the main graph, which branches read from the outer scope).

Models whose weights are in an external-data file are left alone: their weights are copied next to the output
unchanged, and new tensors of weight size would be stored inline (protobuf's 2 GiB limit).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from fastcar_compile.passes import build
from fastcar_compile.passes.context import CompileContext
from fastcar_compile.passes.fuse_norm import graphs
from fastcar_compile.save import has_external


def _weight(node: ir.Node) -> tuple[int, int] | None:
    """(K, N) of a MatMul whose second input is a constant 2-D float32 initializer."""
    if node.op_type != "MatMul" or node.domain != "" or len(node.inputs) != 2:
        return None
    w = node.inputs[1]
    if w is None or w.const_value is None or w.dtype != ir.DataType.FLOAT or len(w.const_value.shape) != 2:
        return None
    return int(w.const_value.shape[0]), int(w.const_value.shape[1])


def groups(graph: ir.Graph) -> list[list[ir.Node]]:
    """Sets of >= 2 such MatMuls of `graph` reading the same activation with weights of the same K."""
    by_input: dict[tuple[int, int], list[ir.Node]] = {}
    for node in graph:
        kn = _weight(node)
        x = node.inputs[0] if kn is not None else None
        if x is None or x.const_value is not None:
            continue
        by_input.setdefault((id(x), kn[0]), []).append(node)
    return [g for g in by_input.values() if len(g) >= 2]


class PackedMatMulPass(ir.passes.InPlacePass):
    """MatMuls sharing an input and constant weights (q/k/v, gate/up) -> one MatMul on packed weights + Split."""

    def __init__(self, ctx: CompileContext):
        super().__init__()
        self.ctx = ctx

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        if has_external(model) or model.opset_imports.get("", 0) < 13:  # (Split's sizes are an input from 13)
            return ir.passes.PassResult(model, modified=False)
        packed: dict[tuple[int, ...], ir.Value] = {}  # weights -> packed weight (clones in the compacted branch)
        count = 0
        for graph in list(graphs(model.graph)):
            for group in groups(graph):
                self._pack(model.graph, graph, group, packed)
                count += 1
        if not count:
            return ir.passes.PassResult(model, modified=False)
        RemoveUnusedNodesPass()(model)
        self.ctx.notes.append(f"packed {count} groups of MatMuls sharing an input (q/k/v, gate/up) into one each")
        return ir.passes.PassResult(model, modified=True)

    @staticmethod
    def _pack(main: ir.Graph, graph: ir.Graph, group: list[ir.Node], packed: dict) -> None:
        weights = [n.inputs[1] for n in group]
        key = tuple(id(w) for w in weights)
        if key not in packed:
            name = f"fastcar.packed.{len(packed)}"
            arr = np.concatenate([np.asarray(w.const_value.numpy(), np.float32) for w in weights], axis=1)
            packed[key] = build.const(main, name, arr)
        sizes = build.const(main, f"fastcar.packed.split_{'_'.join(str(_weight(n)[1]) for n in group)}",
                            np.array([_weight(n)[1] for n in group], np.int64))
        first = group[0]
        mm = ir.node("MatMul", [first.inputs[0], packed[key]], name=f"{first.name or 'matmul'}/packed")
        split = ir.node("Split", [mm.outputs[0], sizes], {"axis": -1}, num_outputs=len(group),
                        name=f"{first.name or 'matmul'}/packed_split")
        mm.outputs[0].name = f"{first.outputs[0].name}.packed"
        mm.outputs[0].type = first.outputs[0].type
        graph.insert_before(first, [mm, split])
        for node, out in zip(group, split.outputs, strict=True):
            old = node.outputs[0]
            out.type, out.shape = old.type, old.shape
            ir.convenience.replace_all_uses_with(old, out)
            name = old.name
            old.name = f"{name}.unpacked"
            out.name = name
            graph.remove(node, safe=True)
