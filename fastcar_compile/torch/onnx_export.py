"""Lower the rewritten program to a fast.onnx with the ONNX path's contract (docs/DESIGN.md).

`torch.onnx.export` re-captures the program; the `fastcar::*` custom ops are translated to the `ai.fastcar`
ops (custom_translation_table) whose ONNX function bodies passes/fastcar_ops.py ships with the model. The
MLP branch is traced dense and rebuilt by the ONNX path's BranchPass (all / compacted rows / none), and the
nodes get the ONNX path's `fastcar.layer`/`fastcar.part` tags (onnx_branch). Inputs, outputs, defaults and
metadata follow the compiler's contract, so `FastCarSession`, ort_driver and the FPGA flow read it like a `fastcar-compile` output.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from fastcar_compile.core import contract
from fastcar_compile.core._version import __version__
from fastcar_compile.core.errors import FastCarError
from fastcar_compile.torch.module import FastCarDecoder

_FASTCAR = None


_TYPES = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)", "tensor(double)", "tensor(int64)", "tensor(int32)",
          "tensor(bool)"]


# torch.onnx says on every export that torchvision's ops are not registered: nothing to do with the user's
# model. Dropped by message, only while to_onnx runs, so any other warning of that logger still shows.
_NOISE = {"torch.onnx._internal.exporter._registration": "torchvision is not installed"}


class _DropMessages(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    added = [(logging.getLogger(name), _DropMessages(prefix)) for name, prefix in _NOISE.items()]
    for log, f in added:
        log.addFilter(f)
    try:
        yield
    finally:
        for log, f in added:
            log.removeFilter(f)


def _register_schemas() -> None:
    """OpSchemas for the ai.fastcar ops, read off their function signatures: torch.onnx's graph builder
    needs a schema to emit a node (the function bodies still ship with the model)."""
    import onnx

    from fastcar_compile.passes import fastcar_ops

    for op in (contract.TEMPORAL_GATE, *fastcar_ops.OP_TEXTS):
        # CompressedAttention is never emitted here, and its optional inputs / float attributes do not fit
        # this generic schema (registered once per process, it would make onnx.checker refuse the ONNX path's)
        if op in (contract.COMPRESSED_ATTENTION, contract.GROUP_QUERY_ATTENTION) or onnx.defs.has(op, fastcar_ops.DOMAIN):
            continue
        fn = fastcar_ops.function_proto(op, 18)
        names_in, names_out, needed = list(fn.input), list(fn.output), (len(fn.input), len(fn.output))
        if op == contract.TEMPORAL_GATE:  # every form's inputs and outputs; those of the plain form required
            names_in, names_out, needed = list(contract.GATE_INPUTS), list(contract.GATE_OUTPUTS), (5, 4)
        params = [(f"T{i}", name) for i, name in enumerate(names_in + names_out)]

        def formal(name: str, type_str: str, k: int, required: int):
            option = onnx.defs.OpSchema.FormalParameterOption
            return onnx.defs.OpSchema.FormalParameter(
                name, type_str, param_option=option.Single if k < required else option.Optional)

        schema = onnx.defs.OpSchema(
            op, fastcar_ops.DOMAIN, fastcar_ops.VERSION, "",
            inputs=[formal(n, t, k, needed[0]) for k, (t, n) in enumerate(params[: len(names_in)])],
            outputs=[formal(n, t, k, needed[1]) for k, (t, n) in enumerate(params[len(names_in):])],
            type_constraints=[(t, _TYPES, "") for t, _ in params],
            attributes=[onnx.defs.OpSchema.Attribute(a, onnx.defs.OpSchema.AttrType.INT, "") for a in fn.attribute]
            + [onnx.defs.OpSchema.Attribute(a.name, onnx.defs.OpSchema.AttrType.INT, "", required=False)
               for a in fn.attribute_proto])  # attributes with a default (age_offset)
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
    return getattr(_opset(), contract.TEMPORAL_GATE)(q, present_key, past_mlp_age, threshold, video_start, frame_tokens=frame_tokens,
                                 max_replay=max_replay)


def _mlp_cache_read(past_mlp_cache, slot):
    return getattr(_opset(), contract.MLP_CACHE_READ)(past_mlp_cache, slot)


def _mlp_cache_update(past_mlp_cache, past_mlp_age, branch, replay, slot, write):
    return getattr(_opset(), contract.MLP_CACHE_UPDATE)(past_mlp_cache, past_mlp_age, branch, replay, slot, write)


# Element types of TemporalGate's outputs (replay, tas, slot, write): the fake impl's dtypes in ops.py. The
# exporter cannot infer a custom op's output types, and onnx_ir would warn on every untyped value it writes.
_GATE_TYPES = ("BOOL", "FLOAT", "INT64", "BOOL")


def _type_gate_outputs(model) -> None:
    """Type the gates' outputs, keeping only the plain form's four: the exporter gives a node every output its
    schema declares, and TemporalGate's schema declares those of every form (optional)."""
    import onnx_ir as ir

    from fastcar_compile.passes import fastcar_ops
    from fastcar_compile.passes import graph_utils as gu

    for node in list(ir.traversal.RecursiveGraphIterator(model.graph)):
        if node.domain != fastcar_ops.DOMAIN or node.op_type != contract.TEMPORAL_GATE:
            continue
        n = len(_GATE_TYPES)
        if len(node.outputs) > n:
            if any(v.uses() or v.is_graph_output() for v in node.outputs[n:]):
                raise RuntimeError("internal: the exported gate uses an output of another form")
            new = ir.node(node.op_type, list(node.inputs), {a.name: a for a in node.attributes.values()},
                          domain=node.domain, num_outputs=n, name=node.name, overload=node.overload)
            node.graph.insert_before(node, new)
            for before, after in zip(node.outputs[:n], new.outputs, strict=True):
                gu.take_over(before, after, graph_outputs=True)
            node.graph.remove(node, safe=True)
            node = new
        for value, name in zip(node.outputs, _GATE_TYPES, strict=True):
            if value.type is None:
                value.type = ir.TensorType(getattr(ir.DataType, name))


def translation_table() -> dict:
    """fastcar::* custom op -> onnxscript function emitting the ai.fastcar op."""
    return {torch.ops.fastcar.temporal_gate.default: _temporal_gate,  # names: contract.OP_NAMES
            torch.ops.fastcar.mlp_cache_read.default: _mlp_cache_read,
            torch.ops.fastcar.mlp_cache_update.default: _mlp_cache_update}


def io_names(dec: FastCarDecoder) -> tuple[list[str], list[str]]:
    """The contract's names, in the program's input/output order (diagnostics last)."""
    ins, outs = contract.io_names(dec.num_kv // 2)
    ins += [contract.VIDEO_START, contract.THRESHOLD]
    for i in dec.layers:
        ins += [contract.mlp_cache_input(i), contract.mlp_age_input(i)]
        outs += [contract.mlp_cache_output(i), contract.mlp_age_output(i)]
    for i in dec.layers:
        outs += [contract.replay_mask_output(i), contract.tas_output(i)]
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
    """Write the FastCar program of `decoder` (a FastCarDecoder or a model from `apply`) to `path` atomically
    (weights over 16 MiB in an external-data file beside it: `<path>.data`, or `<path>.<token>.data` when an
    earlier output's data is there; the model names its file, copy both); returns the onnx_ir model."""
    import onnx_ir as ir
    from onnx_ir.passes.common import RemoveUnusedNodesPass
    from torch.export import Dim

    from fastcar_compile.passes import fastcar_ops
    from fastcar_compile.passes.save import Staging
    from fastcar_compile.torch.onnx_branch import options_of, rebuild_branches
    from fastcar_compile.torch.rewrite import dense_branches

    dec = getattr(decoder, "fastcar", decoder)
    if not isinstance(dec, FastCarDecoder):
        raise FastCarError(f"to_onnx takes a model returned by fastcar_compile.torch.apply, got {type(decoder).__name__}")
    from fastcar_compile.core.fileio import refuse_special

    refuse_special(path, "to_onnx path")  # a rename would replace a FIFO or device node
    ins, outs = io_names(dec)
    B, S, T, P = Dim.AUTO, Dim.AUTO, Dim.AUTO, Dim.AUTO
    shapes = [{0: B, 1: S}, {0: B, 1: T}, {0: B, 1: S}] + [{0: B, 2: P}] * dec.num_kv + [None, None]
    shapes += [{0: B}] * (2 * len(dec.layers))
    with torch.no_grad(), warnings.catch_warnings(), dense_branches(), _quiet_exporter():
        warnings.simplefilter("ignore")
        prog = torch.onnx.export(dec.program if dec.lowering_program is None else dec.lowering_program, _example(dec), input_names=ins, output_names=outs,
                                 dynamic_shapes=tuple(shapes), opset_version=opset, dynamo=True, optimize=True,
                                 custom_translation_table=translation_table(), verbose=False)
    model: ir.Model = prog.model
    _type_gate_outputs(model)
    fastcar_ops.add_functions(model, model.opset_imports.get("", opset))
    rebuild_branches(model, layers=list(dec.layers), options=options_of(dec))
    graph = model.graph
    defaults = {contract.VIDEO_START: np.array(dec.video_start, np.int64),
                contract.THRESHOLD: dec.threshold_tensor().numpy()}
    for value in [v for v in graph.inputs if v.name in defaults]:  # initializers, not inputs, as the ONNX path writes them
        graph.inputs.remove(value)
        value.const_value = ir.tensor(defaults[value.name], name=value.name)
        graph.register_initializer(value)
    if not emit_diagnostics:
        diag = {n for i in dec.layers for n in (contract.replay_mask_output(i), contract.tas_output(i))}
        keep = [o for o in graph.outputs if o.name not in diag]
        graph.outputs.clear()
        graph.outputs.extend(keep)
    RemoveUnusedNodesPass()(model)  # also the program's own MLPCacheRead, replaced by BranchPass's
    model.metadata_props.update(metadata(dec, emit_diagnostics).to_props())
    # staged and renamed into place like the ONNX path's output, with the same rule for external data (weights
    # over save.INLINE_WEIGHTS_MAX go to `<path>.data`: inline weights read by an If branch stay resident twice in
    # ONNX Runtime, docs/memory.md)
    staging = Staging(Path(path))
    try:
        staging.write(model)
        staging.commit()
    finally:
        staging.cleanup()
    return model


# Element type names as the ONNX path writes them (onnx_ir DataType names, lower case).
_IR_DTYPE = {torch.float32: "float", torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float64: "double"}


def metadata(dec: FastCarDecoder, emit_diagnostics: bool) -> contract.FastCarMetadata:
    """The `fastcar.*` metadata of docs/DESIGN.md (schema: contract.FastCarMetadata)."""
    o = dec.options
    dtype = _IR_DTYPE[dec.dtype]
    state = []
    for i in dec.layers:
        state.append(contract.StateEntry(contract.mlp_cache_input(i), contract.mlp_cache_output(i),
                                         ("batch", dec.frame_tokens, dec.hidden), dtype, contract.CACHE_FILL))
        state.append(contract.StateEntry(contract.mlp_age_input(i), contract.mlp_age_output(i),
                                         ("batch", dec.frame_tokens), "int64", contract.AGE_FILL))
    n = dec.num_kv // 2
    return contract.FastCarMetadata(
        version=__version__, frame_tokens=dec.frame_tokens, threshold=dec.threshold,
        per_layer_threshold=dec.per_layer_threshold, layers=list(dec.layers), num_layers=n,
        tas_query=o["tas_query"], max_replay=o["max_replay"], hidden_size=dec.hidden, num_heads=o["num_heads"],
        num_kv_heads=o["num_kv_heads"], head_dim=o["head_dim"], state=state,
        kv=[contract.KVEntry(contract.kv_input(i, k), contract.kv_output(i, k)) for i in range(n)
            for k in contract.KV_KINDS],
        diagnostics=emit_diagnostics, multi_token_decode=True)  # the shared gate bodies decide per token
