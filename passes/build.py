"""Small graph-building helpers the rewrite passes share (node creation with tags, constants, graph I/O)."""

from __future__ import annotations

import itertools

import numpy as np
import onnx_ir as ir

from fastcar_compile.core import contract


class Builder:
    """Creates nodes tagged with their layer and role, appending them to a node list.

    Names are `fastcar/[<namespace>/]<layer>/<op>_<id>` (values `fastcar.[<namespace>.]<layer>.<op>_<id>_<i>`)
    with ids counted per layer (`ids`), so they do not depend on the order in which the passes visit layers.
    Builders that share `ids` never collide; given `graph`, every name is also reserved on that graph (its
    existing node and value names, then each Builder's), and a taken id is skipped, so modes whose own counters
    both start at 0 for a layer still give graph-unique names.
    """

    def __init__(self, layer: int, sink: list[ir.Node], ids: itertools.count, *, graph: ir.Graph | None = None,
                 namespace: str = ""):
        self.layer = layer
        self.sink = sink
        self.ids = ids
        self.taken = _reserved(graph) if graph is not None else None
        self.node_prefix = f"fastcar/{namespace}/{layer}" if namespace else f"fastcar/{layer}"
        self.value_prefix = f"fastcar.{namespace}.{layer}" if namespace else f"fastcar.{layer}"

    def __call__(self, op: str, inputs, attrs=None, *, domain: str = "", outputs: int = 1, part: str = "gate",
                 names: list[str] | None = None, overload: str = "") -> ir.Value | tuple[ir.Value, ...]:
        while True:
            uid = next(self.ids)
            name = f"{self.node_prefix}/{op}_{uid}"
            out_names = names or [f"{self.value_prefix}.{op.lower()}_{uid}_{i}" for i in range(outputs)]
            if self.taken is None or not (name in self.taken or (names is None and self.taken.intersection(out_names))):
                break  # (names given by the caller are its to keep unique)
        if self.taken is not None:
            self.taken.add(name)
            self.taken.update(out_names)
        node = ir.node(op, inputs, attrs or {}, domain=domain, num_outputs=outputs, overload=overload, name=name,
                       metadata_props={contract.TAG_LAYER: str(self.layer), contract.TAG_PART: part})
        for out, out_name in zip(node.outputs, out_names, strict=False):
            out.name = out_name
        self.sink.append(node)
        return node.outputs[0] if outputs == 1 else tuple(node.outputs)


_RESERVED = "fastcar.builder_names"


def _reserved(graph: ir.Graph) -> set[str]:
    """The node and value names taken on `graph` (kept in its in-memory meta, not serialized): seeded from the
    graph once, then grown by every Builder given that graph, whose nodes may not be in it yet."""
    taken = graph.meta.get(_RESERVED)
    if taken is None:
        taken = {n.name for n in graph if n.name}
        taken.update(v.name for v in graph.inputs if v.name)
        taken.update(v.name for n in graph for v in n.outputs if v.name)
        taken.update(graph.initializers)
        graph.meta[_RESERVED] = taken
    return taken


def const(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    """A named initializer in the main graph (subgraphs read it from the outer scope); shared by name."""
    if name in graph.initializers:
        return graph.initializers[name]
    value = ir.Value(name=name, const_value=ir.tensor(array, name=name))
    value.type = ir.TensorType(ir.DataType.from_numpy(array.dtype))
    value.shape = ir.Shape(array.shape)
    graph.register_initializer(value)
    return value


def absent(graph: ir.Graph, dtype: type = np.float32) -> ir.Value:
    """The empty tensor that stands for an absent optional input of a fastcar op before a given one (the lite
    custom-op API cannot take a gap); one initializer per dtype, shared by every node."""
    suffix = "" if dtype is np.float32 else f"_{np.dtype(dtype).name.replace('int', 'i')}"
    return const(graph, f"fastcar.ca.none{suffix}", np.zeros(0, dtype))


def graph_input(graph: ir.Graph, name: str, dtype: ir.DataType, shape) -> ir.Value:
    """A new graph input (fed every run)."""
    value = ir.Value(name=name, type=ir.TensorType(dtype), shape=ir.Shape(shape))
    graph.inputs.append(value)
    return value


def overridable(graph: ir.Graph, name: str, dtype: ir.DataType, shape, default: np.ndarray | None) -> ir.Value:
    """One of contract.OVERRIDABLE: with `default` an initializer that is not a graph input (a stock ONNX Runtime
    session runs with it and prints nothing; FastCarSession feeds it as an input), without one a plain input."""
    if default is None:
        return graph_input(graph, name, dtype, shape)
    value = ir.Value(name=name, type=ir.TensorType(dtype), shape=ir.Shape(shape),
                     const_value=ir.tensor(np.asarray(default, dtype=dtype.numpy()), name=name))
    graph.register_initializer(value)
    return value


def video_start_input(graph: ir.Graph, default: int | None) -> ir.Value:
    """The model's `video_start` (KV index of the first video token), created once: the gate pass and the
    fused attention's prompt pruning both read it. default None: a plain input without a default, which every run
    must feed (ONNX Runtime refuses a run without it: no silent 0); else the compiled-in default (--video-start)."""
    for value in graph.inputs:
        if value.name == contract.VIDEO_START:
            return value
    if contract.VIDEO_START in graph.initializers:
        return graph.initializers[contract.VIDEO_START]
    return overridable(graph, contract.VIDEO_START, ir.DataType.INT64, [],
                       None if default is None else np.array(default, np.int64))


def graph_output(graph: ir.Graph, value: ir.Value, name: str, dtype: ir.DataType, shape) -> None:
    value.name = name
    value.type = ir.TensorType(dtype)
    value.shape = ir.Shape(shape)
    graph.outputs.append(value)


def clone(nodes: list[ir.Node], mapping: dict[ir.Value, ir.Value], suffix: str) -> list[ir.Node]:
    """Copy nodes (in order) with inputs remapped; shapes are dropped because the row count changes."""
    clones = []
    for node in nodes:
        attrs = [ir.Attr(a.name, a.type, a.value) for a in node.attributes.values()]
        new = ir.Node(node.domain, node.op_type, [mapping.get(v, v) if v is not None else None for v in node.inputs],
                      attrs, num_outputs=len(node.outputs), version=node.version, name=f"{node.name}{suffix}",
                      metadata_props=dict(node.metadata_props))
        for old, out in zip(node.outputs, new.outputs, strict=True):
            out.name = f"{old.name}{suffix}"
            out.type = old.type
            mapping[old] = out
        clones.append(new)
    return clones


def tag(nodes, layer: int, part: str) -> None:
    for node in nodes:
        node.metadata_props[contract.TAG_LAYER] = str(layer)
        node.metadata_props[contract.TAG_PART] = part


def batch_dim(graph: ir.Graph):
    """The batch dimension of `input_ids` (symbolic or int), for the shapes of new state inputs."""
    for value in graph.inputs:
        if value.name == contract.INPUT_IDS and value.shape is not None and len(value.shape) >= 1:
            return value.shape[0]
    return "batch"
