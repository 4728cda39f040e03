"""Test models of the one TemporalGate op: a single node of one form, and the same model (or a compiled one) as
the compiler wrote it before the one gate op, with the old per-form op names (contract.LEGACY_GATE_OPS)."""

from __future__ import annotations

import onnx
from onnx import helper

from fastcar_compile.core import contract
from fastcar_compile.passes import fastcar_ops

DOMAIN = contract.DOMAIN
OPSET = 20


def gate_model(form: contract.GateForm, feeds: dict[str, str], attrs: dict, ins: list, outs: list) -> onnx.ModelProto:
    """One TemporalGate node of `form`: feeds maps the op's input names (contract.GATE_INPUTS) to graph inputs;
    ins / outs are the graph's value infos (outs: the form's outputs in order)."""
    names = [feeds.get(n, "") for n in contract.GATE_INPUTS]
    while not names[-1]:
        names.pop()
    node = helper.make_node(contract.TEMPORAL_GATE, names, [o.name for o in outs], domain=DOMAIN,
                            **attrs, **{k: v for k, v in form.attributes.items() if v})
    node.overload = form.overload
    fns = [fastcar_ops.gate_function(form, OPSET)]
    if form.select_rows:
        fns.append(fastcar_ops.function_proto(contract.SELECT_ROWS, OPSET))
    return helper.make_model(helper.make_graph([node], "g", ins, outs), ir_version=10, functions=fns,
                             opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(DOMAIN, 1),
                                            helper.make_opsetid(contract.MS_DOMAIN, 1)])


def legacy(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` with every TemporalGate node of a non-plain form written as before the one gate op: the old op
    name, its input order, no form attributes or overload. Each old op ships its body (the form's, inputs in the
    old order), as compiled models did, so the model also runs without the native library."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    by_form = {form: (name, order) for name, (form, order) in contract.LEGACY_GATE_OPS.items()}
    used: dict[str, contract.GateForm] = {}

    def rewrite(graph: onnx.GraphProto) -> None:
        for node in graph.node:
            for a in node.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    rewrite(a.g)
            if node.domain != DOMAIN or node.op_type != contract.TEMPORAL_GATE:
                continue
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            form = contract.GateForm.of(attrs)
            if form not in by_form:
                continue
            name, order = by_form[form]
            given = dict(zip(contract.GATE_INPUTS, node.input, strict=False))
            inputs = [given.get(n, "") for n in order]
            kept = [a for a in node.attribute if a.name not in contract.GATE_FORM_ATTRIBUTES]
            node.op_type, node.overload = name, ""
            del node.input[:]
            node.input.extend(inputs)
            del node.attribute[:]
            node.attribute.extend(kept)
            used[name] = form

    rewrite(out.graph)
    for name, form in used.items():  # the form's body under the old name, its inputs in the old order
        fn = fastcar_ops.gate_function(form, OPSET)
        fn.name, fn.overload = name, ""
        del fn.input[:]
        fn.input.extend(contract.LEGACY_GATE_OPS[name][1])
        kept = [a for a in fn.attribute_proto if a.name not in contract.GATE_FORM_ATTRIBUTES]
        del fn.attribute_proto[:]
        fn.attribute_proto.extend(kept)
        out.functions.append(fn)
        if form.select_rows and not any(f.name == contract.SELECT_ROWS for f in out.functions):
            out.functions.append(fastcar_ops.function_proto(contract.SELECT_ROWS, OPSET))
    out.ir_version = max(out.ir_version, fastcar_ops.OVERLOAD_IR_VERSION)
    return out
