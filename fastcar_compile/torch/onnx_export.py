"""Lower the rewritten program to a fast.onnx with the ONNX path's contract (docs/DESIGN.md).

`torch.onnx.export` re-captures the program; the `fastcar::*` custom ops are translated to the `ai.fastcar`
ops (custom_translation_table) whose ONNX function bodies passes/fastcar_ops.py ships with the model, the
MLP skip (`torch.cond`) becomes an `If`. Inputs, outputs, defaults and metadata follow the compiler's
contract, so `FastCarSession`, ort_driver and the FPGA flow read it like a `fastcar-compile` output.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import numpy as np
import torch

from fastcar_compile._version import __version__
from fastcar_compile.errors import FastCarError
from fastcar_compile.torch.module import FastCarDecoder

_FASTCAR = None


_TYPES = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)", "tensor(double)", "tensor(int64)", "tensor(int32)",
          "tensor(bool)"]


def _register_schemas() -> None:
    """OpSchemas for the ai.fastcar ops, read off their function signatures: torch.onnx's graph builder
    needs a schema to emit a node (the function bodies still ship with the model)."""
    import onnx

    from fastcar_compile.passes import fastcar_ops

    for op in fastcar_ops.OP_TEXTS:
        if onnx.defs.has(op, fastcar_ops.DOMAIN):
            continue
        fn = fastcar_ops.function_proto(op, 18)
        params = [(f"T{i}", name) for i, name in enumerate(list(fn.input) + list(fn.output))]
        schema = onnx.defs.OpSchema(
            op, fastcar_ops.DOMAIN, fastcar_ops.VERSION, "",
            inputs=[onnx.defs.OpSchema.FormalParameter(n, t) for t, n in params[: len(fn.input)]],
            outputs=[onnx.defs.OpSchema.FormalParameter(n, t) for t, n in params[len(fn.input):]],
            type_constraints=[(t, _TYPES, "") for t, _ in params],
            attributes=[onnx.defs.OpSchema.Attribute(a, onnx.defs.OpSchema.AttrType.INT, "") for a in fn.attribute])
        onnx.defs.register_schema(schema)


def _opset():
    global _FASTCAR
    if _FASTCAR is None:
        from onnxscript import values

        from fastcar_compile.passes import fastcar_ops

        _register_schemas()
        _FASTCAR = values.Opset(fastcar_ops.DOMAIN, fastcar_ops.VERSION)
    return _FASTCAR


def _temporal_gate(q, present_key, past_mlp_age, threshold, video_start, frame_tokens: int, max_replay: int):
    return _opset().TemporalGate(q, present_key, past_mlp_age, threshold, video_start, frame_tokens=frame_tokens,
                                 max_replay=max_replay)


def _mlp_cache_read(past_mlp_cache, slot):
    return _opset().MLPCacheRead(past_mlp_cache, slot)


def _mlp_cache_update(past_mlp_cache, past_mlp_age, branch, replay, slot, write):
    return _opset().MLPCacheUpdate(past_mlp_cache, past_mlp_age, branch, replay, slot, write)


def translation_table() -> dict:
    """fastcar::* custom op -> onnxscript function emitting the ai.fastcar op."""
    return {torch.ops.fastcar.temporal_gate.default: _temporal_gate,
            torch.ops.fastcar.mlp_cache_read.default: _mlp_cache_read,
            torch.ops.fastcar.mlp_cache_update.default: _mlp_cache_update}


def io_names(dec: FastCarDecoder, emit_diagnostics: bool) -> tuple[list[str], list[str]]:
    """The contract's names, in the program's input/output order."""
    from fastcar_compile.contract import io_names as kv_io

    n = dec.num_kv // 2
    ins, outs = kv_io(n)
    ins += ["video_start", "fastcar_threshold"]
    for i in dec.layers:
        ins += [f"past_mlp_cache.{i}", f"past_mlp_age.{i}"]
        outs += [f"present_mlp_cache.{i}", f"present_mlp_age.{i}"]
    for i in dec.layers:
        outs += [f"replay_mask.{i}", f"tas.{i}"]
    return ins, outs


def _example(dec: FastCarDecoder, batch: int = 2, seq: int = 3, past: int = 5) -> tuple:
    g = torch.Generator().manual_seed(0)
    hkv, d = dec.kv_shape
    ids = torch.randint(0, 2, (batch, seq), generator=g)
    mask = torch.ones(batch, past + seq, dtype=torch.int64)
    pos = torch.arange(past, past + seq).unsqueeze(0).expand(batch, seq).contiguous()
    kv = [torch.randn(batch, hkv, past, d, generator=g).to(dec.dtype) for _ in range(dec.num_kv)]
    state = []
    for _ in dec.layers:
        state += [torch.zeros(batch, dec.frame_tokens, dec.hidden, dtype=dec.dtype),
                  torch.full((batch, dec.frame_tokens), -1, dtype=torch.int64)]
    return (ids, mask, pos, *kv, torch.tensor(0, dtype=torch.int64), dec.threshold_tensor(), *state)


def to_onnx(decoder, path: str | os.PathLike, *, opset: int = 20, emit_diagnostics: bool = False):
    """Write the FastCar program of `decoder` (a FastCarDecoder or a model from `apply`) to `path` atomically;
    returns the onnx_ir model."""
    import onnx_ir as ir
    from torch.export import Dim

    from fastcar_compile.atomic import atomic_path
    from fastcar_compile.passes import fastcar_ops

    dec = getattr(decoder, "fastcar", decoder)
    if not isinstance(dec, FastCarDecoder):
        raise FastCarError(f"to_onnx takes a model returned by fastcar_compile.torch.apply, got {type(decoder).__name__}")
    ins, outs = io_names(dec, emit_diagnostics)
    B, S, T, P = Dim.AUTO, Dim.AUTO, Dim.AUTO, Dim.AUTO
    shapes = [{0: B, 1: S}, {0: B, 1: T}, {0: B, 1: S}] + [{0: B, 2: P}] * dec.num_kv + [None, None]
    shapes += [{0: B}] * (2 * len(dec.layers))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prog = torch.onnx.export(dec.program, _example(dec), input_names=ins, output_names=outs,
                                 dynamic_shapes=tuple(shapes), opset_version=opset, dynamo=True, optimize=True,
                                 custom_translation_table=translation_table(), verbose=False)
    model: ir.Model = prog.model
    fastcar_ops.add_functions(model, model.opset_imports.get("", opset))
    graph = model.graph
    for value in graph.inputs:  # defaults, as the ONNX path writes them
        if value.name == "video_start":
            value.const_value = ir.tensor(np.array(dec.video_start, np.int64), name=value.name)
            graph.register_initializer(value)
        elif value.name == "fastcar_threshold":
            value.const_value = ir.tensor(dec.threshold_tensor().numpy(), name=value.name)
            graph.register_initializer(value)
    if not emit_diagnostics:
        keep = [o for o in graph.outputs if not o.name.startswith(("replay_mask.", "tas."))]
        graph.outputs.clear()
        graph.outputs.extend(keep)
        from onnx_ir.passes.common import RemoveUnusedNodesPass

        RemoveUnusedNodesPass()(model)
    model.metadata_props.update(metadata(dec, emit_diagnostics))
    path = Path(path)
    with atomic_path(path) as tmp:
        ir.save(model, str(tmp))
    return model


def metadata(dec: FastCarDecoder, emit_diagnostics: bool) -> dict[str, str]:
    """The `fastcar.*` metadata_props of docs/DESIGN.md."""
    o = dec.options
    state = []
    for i in dec.layers:
        state.append({"input": f"past_mlp_cache.{i}", "output": f"present_mlp_cache.{i}",
                      "shape": ["batch", dec.frame_tokens, dec.hidden], "dtype": str(dec.dtype).split(".")[-1],
                      "fill": 0})
        state.append({"input": f"past_mlp_age.{i}", "output": f"present_mlp_age.{i}",
                      "shape": ["batch", dec.frame_tokens], "dtype": "int64", "fill": -1})
    n = dec.num_kv // 2
    tau = dec.threshold_tensor().tolist()
    return {
        "fastcar.version": __version__,
        "fastcar.frame_tokens": str(dec.frame_tokens),
        "fastcar.threshold": json.dumps(tau),
        "fastcar.per_layer_threshold": json.dumps(dec.per_layer_threshold),
        "fastcar.layers": json.dumps(dec.layers),
        "fastcar.num_layers": str(n),
        "fastcar.tas_query": o["tas_query"],
        "fastcar.max_replay": str(o["max_replay"]),
        "fastcar.hidden_size": str(dec.hidden),
        "fastcar.num_heads": str(o["num_heads"]),
        "fastcar.num_kv_heads": str(o["num_kv_heads"]),
        "fastcar.head_dim": str(o["head_dim"]),
        "fastcar.state": json.dumps(state),
        "fastcar.kv": json.dumps([{"input": f"past_key_values.{i}.{k}", "output": f"present.{i}.{k}"}
                                  for i in range(n) for k in ("key", "value")]),
        "fastcar.diagnostics": json.dumps(emit_diagnostics),
        "fastcar.frontend": "torch",
    }
