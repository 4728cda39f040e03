"""Insert FastCar into matched decoder layers: TAS gate, conditional MLP with row compaction, replay cache.

Per layer (docs/DESIGN.md has the exact semantics):

    replay, tas, slot, write = ai.fastcar.TemporalGate(q, present_key, past_mlp_age, tau, video_start)
    cached = ai.fastcar.MLPCacheRead(past_mlp_cache, slot)
    branch = If(no token replays)  -> original MLP on every token (no compaction cost at 0% replay)
             elif(some token computes) -> MLP on the compacted rows, scattered into `cached`
             else -> cached                          (the whole MLP is skipped)
    present_mlp_cache, present_mlp_age = ai.fastcar.MLPCacheUpdate(..., branch, replay, slot, write)

The MLP nodes move into the If's subgraph (a copy serves the compacted branch); weights stay in the
main graph and are read from the outer scope, so nothing is duplicated.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
from fastcar_compile.passes import fastcar_ops
from fastcar_compile.passes import graph_utils as gu
from fastcar_compile.passes.discover import LayerMatch
from fastcar_compile.passes.window import gate_keys

TAS_QUERIES = ("rope", "raw")


@dataclass(frozen=True)
class RewriteOptions:
    frame_tokens: int
    threshold: float | tuple[float, ...] = -4.0
    tas_query: str = "rope"
    max_replay: int = 0
    per_layer_threshold: bool = False
    emit_diagnostics: bool = False


class _Builder:
    """Creates nodes tagged with their layer and role, appending them to a node list."""

    _ids = itertools.count()  # shared by every builder so names stay unique across subgraphs

    def __init__(self, layer: int, sink: list[ir.Node]):
        self.layer = layer
        self.sink = sink

    def __call__(self, op: str, inputs, attrs=None, *, domain: str = "", outputs: int = 1, part: str = "gate",
                 names: list[str] | None = None) -> ir.Value | tuple[ir.Value, ...]:
        uid = next(self._ids)
        node = ir.node(op, inputs, attrs or {}, domain=domain, num_outputs=outputs,
                       name=f"fastcar/{self.layer}/{op}_{uid}",
                       metadata_props={"fastcar.layer": str(self.layer), "fastcar.part": part})
        for i, out in enumerate(node.outputs):
            out.name = names[i] if names else f"fastcar.{self.layer}.{op.lower()}_{uid}_{i}"
        self.sink.append(node)
        return node.outputs[0] if outputs == 1 else tuple(node.outputs)


def _const(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    """A named initializer in the main graph (subgraphs read it from the outer scope)."""
    if name in graph.initializers:
        return graph.initializers[name]
    value = ir.Value(name=name, const_value=ir.tensor(array, name=name))
    value.type = ir.TensorType(ir.DataType.from_numpy(array.dtype))
    value.shape = ir.Shape(array.shape)
    graph.register_initializer(value)
    return value


def _graph_input(graph: ir.Graph, name: str, dtype: ir.DataType, shape, default: np.ndarray | None = None) -> ir.Value:
    value = ir.Value(name=name, type=ir.TensorType(dtype), shape=ir.Shape(shape))
    graph.inputs.append(value)
    if default is not None:
        value.const_value = ir.tensor(default, name=name)
        graph.register_initializer(value)
    return value


def _graph_output(graph: ir.Graph, value: ir.Value, name: str, dtype: ir.DataType, shape) -> None:
    value.name = name
    value.type = ir.TensorType(dtype)
    value.shape = ir.Shape(shape)
    graph.outputs.append(value)


def _clone(nodes: list[ir.Node], mapping: dict[ir.Value, ir.Value], suffix: str) -> list[ir.Node]:
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


def _tag(nodes, layer: int, part: str) -> None:
    for node in nodes:
        node.metadata_props["fastcar.layer"] = str(layer)
        node.metadata_props["fastcar.part"] = part


def _batch_dim(graph: ir.Graph):
    for value in graph.inputs:
        if value.name == "input_ids" and value.shape is not None and len(value.shape) >= 1:
            return value.shape[0]
    return "batch"


def rewrite(model: ir.Model, matches: list[LayerMatch], opts: RewriteOptions) -> list[dict]:
    """Rewrite every match in place; returns one record per layer describing the state it added."""
    graph = model.graph
    L = opts.frame_tokens
    opset = model.opset_imports.get("", 17)
    fastcar_ops.add_functions(model, opset)
    batch = _batch_dim(graph)

    video_start = _graph_input(graph, "video_start", ir.DataType.INT64, [], np.array(0, np.int64))
    if opts.per_layer_threshold:
        taus = np.asarray(opts.threshold, np.float32).reshape(-1)
        if taus.size == 1:
            taus = np.full(len(matches), taus[0], np.float32)
        threshold = _graph_input(graph, "fastcar_threshold", ir.DataType.FLOAT, [len(matches)], taus)
    else:
        threshold = _graph_input(graph, "fastcar_threshold", ir.DataType.FLOAT, [],
                                 np.array(float(opts.threshold), np.float32))

    records = []
    for k, match in enumerate(matches):
        records.append(_rewrite_layer(graph, match, k, opts, threshold, video_start, batch, L))
    return records


def _rewrite_layer(graph: ir.Graph, match: LayerMatch, k: int, opts: RewriteOptions, threshold: ir.Value,
                   video_start: ir.Value, batch, L: int) -> dict:
    att, mlp = match.attention, match.mlp
    assert att is not None and mlp is not None
    n = match.layer
    new_nodes: list[ir.Node] = []
    b = _Builder(n, new_nodes)
    dtype = mlp.entry.dtype or ir.DataType.FLOAT
    hd = mlp.hidden

    for node in att.nodes():
        _tag([node], n, "norm" if node.op_type in gu.NORM_OPS else "attention")
    past_cache = _graph_input(graph, f"past_mlp_cache.{n}", dtype, [batch, L, hd])
    past_age = _graph_input(graph, f"past_mlp_age.{n}", ir.DataType.INT64, [batch, L])

    # Query in [B, H, S, D].
    q, layout = (att.q, att.q_layout) if opts.tas_query == "rope" else (att.q_raw, att.q_raw_layout)
    if layout == "BSE":
        q = b("Reshape", [q, _const(graph, f"fastcar.shape.0_0_{att.num_heads}_{att.head_dim}",
                                    np.array([0, 0, att.num_heads, att.head_dim], np.int64))])
        layout = "BSHD"
    if layout == "BSHD":
        q = b("Transpose", [q], {"perm": [0, 2, 1, 3]})

    tau = threshold
    if opts.per_layer_threshold:
        tau = b("Gather", [threshold, _const(graph, f"fastcar.index.{k}", np.array(k, np.int64))], {"axis": 0})
    diag = [f"replay_mask.{n}", f"tas.{n}", f"fastcar.{n}.slot", f"fastcar.{n}.write"]
    replay, tas, slot, write = b("TemporalGate", [q, gate_keys(graph, b, att, L), past_age, tau, video_start],
                                 {"frame_tokens": L, "max_replay": opts.max_replay},
                                 domain=fastcar_ops.DOMAIN, outputs=4, names=diag)
    cached = b("MLPCacheRead", [past_cache, slot], domain=fastcar_ops.DOMAIN, part="cache")

    keep = b("Not", [replay])
    n_keep = b("ReduceSum", [b("Cast", [keep], {"to": ir.DataType.INT64})], {"keepdims": 0})
    all_keep = b("Equal", [n_keep, b("Size", [replay])])
    any_keep = b("Greater", [n_keep, _const(graph, "fastcar.zero", np.array(0, np.int64))])

    # Branch 1: every token computes: the original nodes, moved.
    x, m_out = mlp.entry, mlp.output
    full_nodes = list(mlp.nodes)
    graph.remove(full_nodes)
    _tag(full_nodes, n, "mlp")
    full = ir.Graph([], [m_out], nodes=full_nodes, name=f"fastcar_{n}_mlp_all")

    # Branch 2: compaction over the flattened (row, token) axis.
    comp_nodes: list[ir.Node] = []
    c = _Builder(n, comp_nodes)
    flat = _const(graph, f"fastcar.shape.flat_{hd}", np.array([-1, hd], np.int64))
    axis0 = _const(graph, "fastcar.axes0", np.array([0], np.int64))
    axis1 = _const(graph, "fastcar.axes1", np.array([1], np.int64))
    idx = c("Squeeze", [c("NonZero", [c("Reshape", [keep, _const(graph, "fastcar.shape.m1", np.array([-1], np.int64))])]),
                        axis0])
    xc = c("Unsqueeze", [c("Gather", [c("Reshape", [x, flat]), idx], {"axis": 0}), axis0])
    mapping: dict[ir.Value, ir.Value] = {x: xc}
    for k_ext, (shape_value, rank) in enumerate(mlp.external_shapes.items()):
        # [B, S, F] / [B*S, F] computed for all rows -> [1, .., -1, F] for the compacted rows.
        lead = _const(graph, f"fastcar.shape.lead{rank}", np.array([1] * (rank - 2) + [-1], np.int64))
        last = c("Slice", [shape_value, _const(graph, "fastcar.m1", np.array([-1], np.int64)),
                           _const(graph, "fastcar.big", np.array([2**62], np.int64))])
        mapping[shape_value] = c("Concat", [lead, last], {"axis": 0}, names=[f"fastcar.{n}.shape_ext{k_ext}"])
    clones = _clone(full_nodes, mapping, f"/fastcar_compact_{n}")
    comp_nodes.extend(clones)
    mc = c("Reshape", [_mapped(clones, full_nodes, m_out), flat], part="mlp")
    scattered = c("ScatterND", [c("Reshape", [cached, flat]), c("Unsqueeze", [idx, axis1]), mc])
    mixed = c("Reshape", [scattered, c("Shape", [x])])
    _tag(comp_nodes, n, "mlp")
    compact = ir.Graph([], [mixed], nodes=comp_nodes, name=f"fastcar_{n}_mlp_some")

    # Branch 3: every token replays: the MLP is skipped.
    none_nodes: list[ir.Node] = []
    skipped = _Builder(n, none_nodes)("Identity", [cached], part="cache")
    skip = ir.Graph([], [skipped], nodes=none_nodes, name=f"fastcar_{n}_mlp_none")

    partial_nodes: list[ir.Node] = []
    inner = _Builder(n, partial_nodes)("If", [any_keep], {"then_branch": compact, "else_branch": skip}, part="mlp")
    partial = ir.Graph([], [inner], nodes=partial_nodes, name=f"fastcar_{n}_mlp_partial")
    for out in (m_out, mixed, skipped, inner):
        out.type = ir.TensorType(dtype)
    used = b("If", [all_keep], {"then_branch": full, "else_branch": partial}, part="mlp",
             names=[f"fastcar.{n}.mlp_used"])
    used.type = ir.TensorType(dtype)

    mlp.closing.replace_input_with(list(mlp.closing.inputs).index(m_out), used)
    present_cache, present_age = b("MLPCacheUpdate", [past_cache, past_age, used, replay, slot, write],
                                   domain=fastcar_ops.DOMAIN, outputs=2, part="cache",
                                   names=[f"present_mlp_cache.{n}", f"present_mlp_age.{n}"])
    _graph_output(graph, present_cache, f"present_mlp_cache.{n}", dtype, [batch, L, hd])
    _graph_output(graph, present_age, f"present_mlp_age.{n}", ir.DataType.INT64, [batch, L])
    if opts.emit_diagnostics:
        _graph_output(graph, replay, f"replay_mask.{n}", ir.DataType.BOOL, [batch, "seq"])
        _graph_output(graph, tas, f"tas.{n}", ir.DataType.FLOAT, [batch, "seq"])

    # Insert the new nodes before the closing node (all their inputs exist by then).
    graph.insert_before(mlp.closing, new_nodes)
    return {
        "layer": n,
        "hidden": hd,
        "dtype": dtype.name.lower(),
        "state": [
            {"input": past_cache.name, "output": f"present_mlp_cache.{n}", "shape": ["batch", L, hd],
             "dtype": dtype.name.lower(), "fill": 0},
            {"input": past_age.name, "output": f"present_mlp_age.{n}", "shape": ["batch", L], "dtype": "int64",
             "fill": -1},
        ],
    }


def _mapped(clones: list[ir.Node], originals: list[ir.Node], value: ir.Value) -> ir.Value:
    for orig, clone in zip(originals, clones, strict=True):
        for o, c in zip(orig.outputs, clone.outputs, strict=True):
            if o is value:
                return c
    raise KeyError(value.name)

