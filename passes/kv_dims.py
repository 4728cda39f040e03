"""Forget the symbolic dim names exporters declare on tensors computed from the KV cache.

ONNX Runtime's memory planner treats two tensors whose declared shapes use the same dim names as the same
size and reuses one buffer for both. Those names are the exporter's claim, not checked: onnxruntime-genai
0.18's fp16 CPU builder labels the expanded KV of its `repeat_kv` chain (past + new tokens long) with
`sequence_length` (the new tokens), so at the first decode step ORT reuses a [B, 1, 64] buffer for a
[B, 6, 64] tensor and fails ("Shape mismatch attempting to re-use buffer", in the Cast ORT inserts before
MultiHeadAttention), at every optimisation level. Intermediate tensors downstream of a `past*` KV input have
a past-dependent length, so their symbolic dims become unknown (static dims and ranks are kept); ORT
infers what it needs. Graph inputs and outputs keep their names (they are the model's I/O contract).
"""

from __future__ import annotations

import onnx_ir as ir

from fastcar_compile.passes.context import CompileContext
from fastcar_compile.passes.discover import kv_outputs


def _kv_inputs(graph: ir.Graph) -> list[ir.Value]:
    names = {"past_key_values." + o.name[len("present."):] for layer in kv_outputs(graph).values()
             for o in layer.values() if o.name and o.name.startswith("present.")}
    names |= {"past_" + o.name[len("present_"):] for layer in kv_outputs(graph).values()
              for o in layer.values() if o.name and o.name.startswith("present_")}
    return [v for v in graph.inputs if v.name in names]


def forget_kv_dim_names(graph: ir.Graph) -> int:
    """Unname the symbolic dims of every intermediate value computed from a past KV input; returns how many."""
    boundary = {id(v) for v in (*graph.inputs, *graph.outputs)}
    seen: set[int] = set()
    todo = list(_kv_inputs(graph))
    changed = 0
    while todo:
        value = todo.pop()
        for node, _ in value.uses():
            for out in node.outputs:
                if id(out) in seen:
                    continue
                seen.add(id(out))
                todo.append(out)
                shape = out.shape
                if id(out) in boundary or shape is None:
                    continue
                if any(isinstance(d, ir.SymbolicDim) and d.value is not None for d in shape):
                    out.shape = ir.Shape([d if isinstance(d, int) else None for d in shape])
                    changed += 1
    return changed


class KvDimNamesPass(ir.passes.InPlacePass):
    """Unname symbolic dims of tensors computed from the KV cache (exporters mislabel them; ORT trusts them)."""

    def __init__(self, ctx: CompileContext):
        super().__init__()
        self.ctx = ctx

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        return ir.passes.PassResult(model, modified=forget_kv_dim_names(model.graph) > 0)
