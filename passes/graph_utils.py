"""Small dataflow helpers over onnx-ir graphs, shared by discovery and rewriting."""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import onnx_ir as ir

# Ops that only move or reinterpret data along a tensor's path (GQA expansion, K^T, head split).
LAYOUT_OPS = frozenset({"Unsqueeze", "Squeeze", "Expand", "Reshape", "Transpose", "Cast", "Identity", "Tile", "Flatten"})
# Fused norms that also close a residual (onnxscript ort_fusions, ORT transformers optimizer).
SKIP_NORM_OPS = frozenset({"SkipSimplifiedLayerNormalization", "SkipLayerNormalization"})
NORM_OPS = frozenset(
    {"LayerNormalization", "RMSNormalization", "SimplifiedLayerNormalization"} | SKIP_NORM_OPS
)
ATTENTION_OPS = frozenset({"Attention", "MultiHeadAttention", "GroupQueryAttention"})
ROTARY_OPS = frozenset({"RotaryEmbedding"})
MATMUL_OPS = frozenset({"MatMul", "Gemm", "MatMulNBits", "FusedMatMul"})


def describe(node: ir.Node | None) -> str:
    if node is None:
        return "<graph input>"
    return f"{node.op_type} '{node.name or '?'}'"


def real_consumers(value: ir.Value) -> list[ir.Node]:
    """Consumers that use the data, not just the shape."""
    return [n for n in value.consumers() if n.op_type != "Shape"]


def is_static(value: ir.Value | None, _memo: dict | None = None) -> bool:
    """True if the value is known at compile time (initializer, Constant, or computed only from those)."""
    if value is None:
        return True
    memo = {} if _memo is None else _memo
    if value in memo:
        return memo[value]
    if value.const_value is not None or value.is_initializer():
        memo[value] = True
        return True
    producer = value.producer()
    if producer is None:
        memo[value] = False
        return False
    memo[value] = False  # cycle guard
    result = all(is_static(v, memo) for v in producer.inputs)
    memo[value] = result
    return result


def const_tensor(value: ir.Value | None) -> ir.TensorProtocol | None:
    """The tensor of an initializer or of a Constant node's `value` output (TorchScript exports use the latter),
    unread; else None."""
    if value is None:
        return None
    tensor = value.const_value
    if tensor is None:
        producer = value.producer()
        if producer is not None and producer.op_type == "Constant" and "value" in producer.attributes:
            tensor = producer.attributes["value"].value
    return tensor


def const_ints(value: ir.Value | None, limit: int = 8) -> list[int] | None:
    """The integers of a small constant (at most `limit` elements: Slice bounds, axes), else None."""
    tensor = const_tensor(value)
    if tensor is None or tensor.size > limit:
        return None
    return [int(v) for v in np.asarray(tensor.numpy()).reshape(-1)]


def scalar_const(value: ir.Value | None) -> float | None:
    """The number held by a constant scalar (or 1-element) value, else None."""
    tensor = const_tensor(value)
    if tensor is None or math.prod(tensor.shape) != 1:  # never read a weight just to learn it is no scalar
        return None
    try:
        arr = np.asarray(tensor.numpy())
    except Exception:  # noqa: BLE001 - lazy external tensors that cannot be read are not scalars
        return None
    return float(arr.reshape(-1)[0]) if arr.size == 1 else None


def static_dims(value: ir.Value) -> list[int | None] | None:
    if value.shape is None:
        return None
    return [d if isinstance(d, int) else None for d in value.shape]


def ancestors_until(outputs: Iterable[ir.Value], stop: set[ir.Value], limit: int = 100_000) -> set[ir.Node]:
    """Nodes reachable backwards from `outputs` without passing through a value in `stop`."""
    seen: set[ir.Node] = set()
    stack = [v for v in outputs if v not in stop]
    while stack and len(seen) < limit:
        v = stack.pop()
        node = v.producer()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(i for i in node.inputs if i is not None and i not in stop)
    return seen


def live_nodes(graph: ir.Graph, replaced: set[ir.Value], reads: Iterable[ir.Value]) -> set[ir.Node]:
    """The nodes that still compute something once the values in `replaced` get new producers reading `reads`:
    everything reachable backwards from the graph's outputs and `reads` without passing through `replaced` (the If
    branches of a live node, and the outer values they read, included). What a rewrite checks before it drops a
    value: nothing else reads it when none of its consumers is live."""
    seen: set[ir.Node] = set()
    stack = [v for v in (*graph.outputs, *reads) if v is not None and v not in replaced]
    while stack:
        node = stack.pop().producer()
        if node is None or node in seen:
            continue
        seen.add(node)
        inner = [n for a in node.attributes.values() if a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS)
                 for g in (a.value if a.type == ir.AttributeType.GRAPHS else [a.value])
                 for n in ir.traversal.RecursiveGraphIterator(g)]
        seen.update(inner)
        stack.extend(i for n in (node, *inner) for i in n.inputs if i is not None and i not in replaced)
    return seen


def descendants(value: ir.Value, within: set[ir.Node]) -> set[ir.Node]:
    """Nodes of `within` that depend on `value`."""
    out: set[ir.Node] = set()
    stack = [value]
    while stack:
        v = stack.pop()
        for node in v.consumers():
            if node in within and node not in out:
                out.add(node)
                stack.extend(node.outputs)
    return out


def depends_on(value: ir.Value, source: ir.Value, limit: int = 5000) -> bool:
    """Does `value` depend on `source` (bounded backwards search)?"""
    seen: set[ir.Node] = set()
    stack = [value]
    while stack and len(seen) < limit:
        v = stack.pop()
        if v is source:
            return True
        node = v.producer()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(i for i in node.inputs if i is not None)
    return False


def in_graph_order(graph: ir.Graph, nodes: set[ir.Node]) -> list[ir.Node]:
    return [n for n in graph if n in nodes]


def weight_shape(value: ir.Value | None) -> tuple[int, ...] | None:
    """Shape of an initializer/constant weight, without reading its data."""
    if value is None:
        return None
    producer = value.producer()
    if value.const_value is None and producer is not None and producer.op_type in LAYOUT_OPS and producer.inputs:
        return weight_shape(producer.inputs[0])
    tensor = const_tensor(value)
    if tensor is None:
        return None
    return tuple(int(d) for d in tensor.shape)


def take_over(old: ir.Value, new: ir.Value, graph_outputs: bool = False) -> None:
    """`new` replaces `old` for every consumer (and, with `graph_outputs`, where it is a graph output) and takes its
    name, type and shape (the fusions keep the exported value names); `old` is renamed `<name>.unfused` until it
    is removed."""
    name, new.type, new.shape = old.name, old.type, old.shape
    ir.convenience.replace_all_uses_with(old, new, replace_graph_outputs=graph_outputs)
    old.name, new.name = f"{name}.unfused", name
