"""RMSNorm fusions: the exporters' decomposed RMSNorm -> ORT's `SimplifiedLayerNormalization`, and a residual
Add feeding one -> `com.microsoft.SkipSimplifiedLayerNormalization` (what onnxruntime-genai's builder emits).

torch.onnx (dynamo) writes LlamaRMSNorm as Pow(x, 2) -> ReduceMean(-1) -> Add(eps) -> Sqrt -> Reciprocal ->
Mul(x, .) -> Mul(weight, .): seven kernel launches where genai's graph has one, 17 times per step at 8
layers (docs/genai.md, "path (b)"). These passes run before discovery, so discovery, `--inspect` and the
gate see the forms onnxruntime-genai's builder writes (the MLP's norm joined to the residual Add, outside the
MLP branch). The chain is matched here rather than by onnxscript's `ort_fusions.rms_normalization` rule, which
refuses patterns whose constants live in an outer graph ("Pattern matches crossing graph boundaries are not
supported"), so this matcher also serves graphs with If branches. The skip fusion (main graph only, where both the Add and the norm live) is onnxscript's
`ort_fusions.skip_normalization` rule, which checks that both Add inputs have the same [B, S, D] shape.

Exactness: SimplifiedLayerNormalization computes x / sqrt(mean(x^2) + eps) * weight in float32 (stash_type
1), the same operations as the chain; only float32 chains without casts are fused.
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from fastcar_compile.core import contract
from fastcar_compile.passes import graph_utils as gu
from fastcar_compile.passes.context import CompileContext


def _only_consumer(value: ir.Value, op: str | tuple[str, ...]) -> ir.Node | None:
    """The single node reading `value` when it is `op` and `value` is not a graph output, else None."""
    uses = value.consumers()
    if len(uses) != 1 or value.is_graph_output():
        return None
    ops = (op,) if isinstance(op, str) else op
    return uses[0] if uses[0].op_type in ops and uses[0].domain == "" else None


def _other(node: ir.Node, value: ir.Value) -> ir.Value | None:
    """The other input of a binary node that reads `value` once."""
    ins = list(node.inputs)
    if len(ins) != 2 or ins.count(value) != 1:
        return None
    return ins[1 - ins.index(value)]


def _last_axis(node: ir.Node, rank: int | None) -> bool:
    """ReduceMean over the last axis only, keeping it (axes as attribute before opset 18, input after)."""
    if node.attributes.get_int("keepdims", 1) != 1:
        return False
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        axes = node.inputs[1].const_value
        axes = None if axes is None else [int(a) for a in axes.numpy().reshape(-1)]
    else:
        axes = node.attributes.get_ints("axes")
        axes = None if axes is None else list(axes)
    return axes is not None and len(axes) == 1 and (axes[0] == -1 or (rank is not None and axes[0] == rank - 1))


def match_rms_norm(pow_node: ir.Node) -> tuple[ir.Value, ir.Value, float, list[ir.Node]] | None:
    """(x, weight, epsilon, chain nodes with the final Mul last) of an RMSNorm chain starting at Pow(x, 2)."""
    if pow_node.op_type != "Pow" or pow_node.domain != "" or gu.scalar_const(pow_node.inputs[1]) != 2.0:
        return None
    x = pow_node.inputs[0]
    # (the compacted If branch's row gather has no declared type: the Pow's cloned output type says it)
    if x is None or (x.dtype or pow_node.outputs[0].dtype) != ir.DataType.FLOAT:
        return None
    rank = len(x.shape) if x.shape is not None else None
    mean = _only_consumer(pow_node.outputs[0], "ReduceMean")
    if mean is None or not _last_axis(mean, rank):
        return None
    add = _only_consumer(mean.outputs[0], "Add")
    eps = gu.scalar_const(_other(add, mean.outputs[0])) if add is not None else None
    if eps is None or eps < 0:
        return None
    sqrt = _only_consumer(add.outputs[0], "Sqrt")
    if sqrt is None:
        return None
    chain = [pow_node, mean, add, sqrt]
    nxt = _only_consumer(sqrt.outputs[0], ("Reciprocal", "Div"))
    if nxt is None:
        return None
    if nxt.op_type == "Div":  # x / sqrt(...)
        if list(nxt.inputs) != [x, sqrt.outputs[0]]:
            return None
        scaled = nxt
    else:  # x * (1 / sqrt(...))
        chain.append(nxt)
        scaled = _only_consumer(nxt.outputs[0], "Mul")
        if scaled is None or _other(scaled, nxt.outputs[0]) is not x:
            return None
    chain.append(scaled)
    final = _only_consumer(scaled.outputs[0], "Mul")
    weight = _other(final, scaled.outputs[0]) if final is not None else None
    dims = gu.weight_shape(weight) if weight is not None and gu.is_static(weight) else None
    # x's last dim must be the weight's; unknown only for the compacted branch's gathered rows (the same stream
    # as the known-shape chain it was cloned from; a mismatch there would make ORT refuse, not differ)
    last = x.shape[-1] if x.shape is not None and len(x.shape) else None
    if dims is None or len(dims) != 1 or (last is not None and dims[0] != last) or \
            weight.dtype != ir.DataType.FLOAT:
        return None
    chain.append(final)
    return x, weight, eps, chain


def fuse_rms_norms(graph: ir.Graph) -> int:
    """Replace every RMSNorm chain of `graph` (not its subgraphs) by SimplifiedLayerNormalization; how many."""
    count = 0
    for node in list(graph):
        found = match_rms_norm(node) if node.graph is graph else None
        if found is None:
            continue
        x, weight, eps, chain = found
        final = chain[-1]
        if final.outputs[0].is_graph_output():  # (a graph output keeps its producer: nothing to gain there)
            continue
        fused = ir.node("SimplifiedLayerNormalization", [x, weight],
                        {"axis": -1, "epsilon": float(eps), "stash_type": 1},
                        name=f"{final.name or 'rmsnorm'}/fused_rms_norm")
        graph.insert_before(final, fused)
        gu.take_over(final.outputs[0], fused.outputs[0])
        for old in reversed(chain):
            graph.remove(old, safe=True)
        count += 1
    return count


class RmsNormFusionPass(ir.passes.InPlacePass):
    """Decomposed RMSNorm chains (main graph and If branches) -> SimplifiedLayerNormalization."""

    def __init__(self, ctx: CompileContext):
        super().__init__()
        self.ctx = ctx

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        # onnx-ir collects every nested graph (If branches) before yielding, so fusing while iterating is safe
        count = sum(fuse_rms_norms(g) for g in [model.graph, *model.graph.subgraphs()])
        if count:
            self.ctx.notes.append(f"fused {count} RMSNorm chains into SimplifiedLayerNormalization")
        return ir.passes.PassResult(model, modified=count > 0)


class SkipNormFusionPass(ir.passes.InPlacePass):
    """A residual Add feeding SimplifiedLayerNormalization -> SkipSimplifiedLayerNormalization (onnxscript rule)."""

    def __init__(self, ctx: CompileContext):
        super().__init__()
        self.ctx = ctx

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        from onnxscript.rewriter.ort_fusions.skip_normalization import fuse_skip_rms_normalization

        count = fuse_skip_rms_normalization(model)
        if count:
            model.opset_imports.setdefault(contract.MS_DOMAIN, 1)
            RemoveUnusedNodesPass()(model)
            self.ctx.notes.append(f"fused {count} residual Adds into SkipSimplifiedLayerNormalization")
        return ir.passes.PassResult(model, modified=count > 0)
