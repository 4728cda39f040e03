"""BranchPass's row selection folded into a packed gate: one main-graph node where there were two.

In the shared layout (passes/branch.py) each layer runs `rows, some = SelectRows(x, replay)` on the main graph,
every step. When `replay` comes from a packed TemporalGate (onnxruntime-genai graphs; dynamo exports after
FusedLayoutPass), the gate gets `select_rows`: it takes x and outputs the rows itself:
its own compute_some is the If condition. Same values (the op's body is the gate's body plus SelectRows), one
kernel launch less per layer and step. Runs after the fusions: the MLP norm hoisted out of the If
(NormHoistPass) and joined to the residual Add is what x is then. The gate moves to just before SelectRows (x
is computed after the attention the gate reads).
"""

from __future__ import annotations

import dataclasses

import onnx_ir as ir

from fastcar_compile.passes.context import CompileContext
from fastcar_compile.passes.gate import replace_gate


class RowGatePass(ir.passes.InPlacePass):
    """SelectRows(x, replay of a packed gate) -> the gate with select_rows."""

    def __init__(self, ctx: CompileContext):
        super().__init__()
        self.ctx = ctx

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        fused = 0
        for lr in self.ctx.layers:  # the layer's gate and SelectRows, as the emission recorded them
            select, gate, form = lr.select, lr.gate, lr.gate_form
            if select is None or gate is None or not form.packed_qkv or form.select_rows or \
                    gate.graph is not graph or select.inputs[1] is not gate.outputs[0]:
                continue
            outputs = len(gate.outputs)
            node = replace_gate(model, lr, dataclasses.replace(form, select_rows=True), {"mlp_input": select.inputs[0]},
                                {}, taken=(select.outputs[0],), at=select, name=f"{gate.name or 'gate'}/rows")
            some = node.outputs[outputs - 1]  # the gate's compute_some: the If condition
            ir.convenience.replace_all_uses_with(select.outputs[1], some)
            graph.remove(select, safe=True)
            lr.select = None
            fused += 1
        if fused:
            graph.sort()
            self.ctx.notes.append(f"row selection folded into the packed gate in {fused} layers")
        return ir.passes.PassResult(model, modified=fused > 0)
