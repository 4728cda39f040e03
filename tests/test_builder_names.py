"""passes/build.py's Builder: node and value names stay unique on a graph when several modes build into it.

Each mode (FastCar's replay, AnnSA, AnnCA, TempCache) counts its ids from 0 per layer, so two Builders on one
graph must not rely on their counters to keep names apart; ONNX refuses a graph whose values share a name.
"""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import onnx
import onnx_ir as ir

from fastcar_compile.passes.build import Builder


def _graph() -> tuple[ir.Graph, ir.Value]:
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2, 3]))
    return ir.Graph([x], [], nodes=[], opset_imports={"": 20}, name="g"), x


def _two_modes(graph: ir.Graph, x: ir.Value) -> list[ir.Node]:
    """Two Builders on one graph and layer, each with its own counter from 0, as two modes emit them."""
    first: list[ir.Node] = []
    second: list[ir.Node] = []
    a = Builder(0, first, itertools.count(), graph=graph)
    b = Builder(0, second, itertools.count(), graph=graph)
    ya = a("Relu", [a("Neg", [x])])
    yb = b("Relu", [b("Neg", [x])])
    graph.extend(first + second)
    for y in (ya, yb):
        y.type, y.shape = x.type, x.shape
    graph.outputs.extend([ya, yb])
    return first + second


def test_two_builders_on_one_graph_give_unique_names():
    graph, x = _graph()
    nodes = _two_modes(graph, x)
    node_names = Counter(n.name for n in nodes)
    value_names = Counter(v.name for n in nodes for v in n.outputs)
    assert max(node_names.values()) == 1, node_names
    assert max(value_names.values()) == 1, value_names
    # the graph is valid ONNX and computes what both chains say (independent NumPy reference)
    proto = ir.serde.serialize_model(ir.Model(graph, ir_version=10))
    onnx.checker.check_model(proto)
    import onnxruntime as ort
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    arr = np.array([[1.0, -2.0, 3.0], [-4.0, 5.0, -6.0]], np.float32)
    for out in sess.run(None, {"x": arr}):
        np.testing.assert_array_equal(out, np.maximum(-arr, 0))


def test_builder_skips_names_the_graph_already_has():
    graph, x = _graph()
    taken: list[ir.Node] = []
    Builder(1, taken, itertools.count())("Neg", [x])  # not told the graph: an earlier pass's node, in the graph
    graph.extend(taken)
    later: list[ir.Node] = []
    y = Builder(1, later, itertools.count(), graph=graph)("Neg", [x])
    assert later[0].name != taken[0].name and y.name != taken[0].outputs[0].name


def test_namespace_prefixes_names():
    graph, x = _graph()
    nodes: list[ir.Node] = []
    y = Builder(2, nodes, itertools.count(), graph=graph, namespace="annca")("Neg", [x])
    assert nodes[0].name == "fastcar/annca/2/Neg_0" and y.name == "fastcar.annca.2.neg_0_0"
