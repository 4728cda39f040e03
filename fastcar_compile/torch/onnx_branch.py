"""After torch.onnx.export: each layer's MLP branch rebuilt by the ONNX path's BranchPass, its nodes tagged.

`to_onnx` traces the FastCar program with `rewrite.dense_branches()`: the MLP runs on every row and its
output feeds the residual Add and `MLPCacheUpdate` directly. Here the ONNX path's own discovery finds the
layers again in the lowered graph (cross-checked with the program: the MLP output it finds must be the value
the program writes to the cache), then, as `fastcar-compile` does:
- norm/attention nodes are tagged by `gate.tag_attention`, the gate's own nodes `gate`, the cache update
  `cache` (`fastcar.layer` / `fastcar.part`, contract.TAG_*), which the FPGA partitioner reads;
- `BranchPass` replaces the MLP with its rows `If` (SelectRows, the MLP once, MLPCacheMerge in place of the
  program's MLPCacheUpdate).
One branch builder therefore serves both front ends.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from fastcar_compile.core import contract
from fastcar_compile.core.errors import FastCarError
from fastcar_compile.passes import build
from fastcar_compile.passes import graph_utils as gu
from fastcar_compile.passes.branch import BranchPass
from fastcar_compile.passes.context import CompileContext, CompileOptions, LayerRewrite
from fastcar_compile.passes.discover import LayerMatch, discover
from fastcar_compile.passes.gate import tag_attention
from fastcar_compile.passes.plan import plan_blocks


def _only_feeding(node: ir.Node) -> list[ir.Node]:
    """`node` and the nodes computed only for it (e.g. the per-layer tau Gather): the gate's own nodes."""
    own = [node]
    seen = {node}
    for n in own:
        for value in n.inputs:
            p = value.producer() if value is not None else None
            if p is None or p in seen or value.is_graph_output():
                continue
            if all(c in seen for out in p.outputs for c in out.consumers()) and not any(
                    o.is_graph_output() for o in p.outputs):
                seen.add(p)
                own.append(p)
    return own


def _layer(found: dict[int, LayerMatch], outputs: dict[str, ir.Value], layer: int, index: int) -> LayerRewrite:
    """The LayerRewrite of one lowered layer: the ONNX match plus the program's gate and cache values."""
    present = outputs.get(contract.mlp_cache_output(layer))
    update = present.producer() if present is not None else None
    if update is None or update.op_type != contract.MLP_CACHE_UPDATE:
        raise FastCarError(f"to_onnx: {contract.mlp_cache_output(layer)} is not written by "
                           f"{contract.MLP_CACHE_UPDATE} in the lowered graph; please report this model")
    past_cache, past_age, used, replay, slot, write = update.inputs
    match = found.get(layer)
    if match is None or not match.ok:
        why = match.failure.reason if match is not None and match.failure is not None else "no present.N outputs"
        raise FastCarError(f"to_onnx: the ONNX discovery does not find layer {layer} in the lowered graph ({why}); "
                           "`fastcar-compile --inspect` on the dense export explains it")
    assert match.mlp is not None and match.attention is not None
    if match.mlp.output is not used:
        raise FastCarError(f"to_onnx: layer {layer}: the ONNX discovery's MLP output {match.mlp.output.name} is not "
                           f"the value the PyTorch program caches ({used.name}); the two discoveries disagree")
    gate = replay.producer()
    assert gate is not None and past_cache is not None and past_age is not None
    tag_attention(match.attention, layer)
    build.tag(_only_feeding(gate), layer, "gate")
    build.tag([update], layer, "cache")
    return LayerRewrite(match, index, past_cache.dtype or ir.DataType.FLOAT, past_cache, past_age, replay=replay,
                        tas=gate.outputs[1], slot=slot, write=write)


def rebuild_branches(model: ir.Model, *, layers: list[int], options: CompileOptions) -> None:
    """Replace the dense MLP of every rewritten layer with BranchPass's If and tag the layer's nodes."""
    graph = model.graph
    found = {m.layer: m for m in discover(model)}
    outputs = {v.name: v for v in graph.outputs if v.name}
    ctx = CompileContext(options)
    ctx.layers = [_layer(found, outputs, layer, k) for k, layer in enumerate(layers)]
    ctx.plan = plan_blocks(list(found.values()), layers, options)  # (the MLP rows' layout, as the compiler plans it)
    mlp_outputs = [lr.match.mlp.output for lr in ctx.layers]  # type: ignore[union-attr]
    # BranchPass rewires the residual Add to its If (nested layout): the program's cache update must read the If
    # too; its MLPCacheMerge (shared layout) writes the cache itself and replaces the program's update.
    consumers = [[(c, i) for c, i in v.uses() if c.op_type == contract.MLP_CACHE_UPDATE] for v in mlp_outputs]
    BranchPass(ctx)(model)
    for lr, uses in zip(ctx.layers, consumers, strict=True):
        for node, i in uses:
            if lr.present is None:
                node.replace_input_with(i, lr.used)
                continue
            for old, new in zip(node.outputs, lr.present, strict=True):
                gu.take_over(old, new, graph_outputs=True)
            graph.remove(node, safe=True)
    graph.sort()


def options_of(dec) -> CompileOptions:
    """The compiler options equal to a FastCarDecoder's (validated by CompileOptions as `fastcar-compile`'s)."""
    o = dec.options
    return CompileOptions(frame_tokens=dec.frame_tokens, threshold=tuple(np.atleast_1d(dec.threshold).tolist()),
                          tas_query=o["tas_query"], max_replay=o["max_replay"],
                          per_layer_threshold=dec.per_layer_threshold)
