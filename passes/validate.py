"""The validation pass: the written model must pass onnx.checker and open in ONNX Runtime.

It checks the staged file (fastcar_compile.passes.save.Staging), the exact bytes that are then renamed into place.
Errors found here are the compiler's (internal errors), except when the input itself does not load in ORT.
"""

from __future__ import annotations

from pathlib import Path

import onnx
import onnx_ir as ir

from fastcar_compile.core import contract
from fastcar_compile.core.errors import FastCarError
from fastcar_compile.passes.save import Staging


def _unknown_contrib_op(exc: Exception, model: ir.Model) -> bool:
    """onnx.checker rejects ORT contrib ops registered in the ONNX domain (SimplifiedLayerNormalization,
    which onnxscript's ort_fusions emits); the input had them too, so ORT alone is the judge there."""
    text = str(exc)
    if "No Op registered for" not in text:
        return False
    op = text.split("No Op registered for", 1)[1].split()[0]
    return any(node.op_type == op for node in model.graph)


def _without_external_weights(proto: onnx.ModelProto) -> onnx.ModelProto:
    """The same graph with external weights turned into typed graph inputs, for a structural check."""
    keep = []
    for tensor in proto.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            proto.graph.input.append(onnx.helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims)))
        else:
            keep.append(tensor)
    del proto.graph.initializer[:]
    proto.graph.initializer.extend(keep)
    return proto


def ort_loads(path: Path) -> bool:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 4
    try:
        ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    except Exception:  # noqa: BLE001
        return False
    return True


def check_file(path: Path, model: ir.Model, *, external: bool, big: bool, source: Path | None) -> None:
    """onnx.checker (structure only when weights are external) and, below the size limit, an ORT session."""
    try:
        if external or big:
            # Structure only: the weights are the input's, unchanged (and possibly hard-linked, which
            # the checker's external-data check refuses); the proto without them is small.
            onnx.checker.check_model(_without_external_weights(onnx.load(str(path), load_external_data=False)))
        else:  # inline weights: let the checker read the file itself (no Python copy of the proto)
            onnx.checker.check_model(str(path))
    except Exception as exc:  # noqa: BLE001
        if not _unknown_contrib_op(exc, model):
            raise FastCarError(f"internal error: the compiled model fails onnx.checker: {exc}") from None
    if big:  # opening the session would load every weight
        return
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3  # a check, not a run: only its errors matter
    if _compressed(model):  # a compressed KV cache runs only in the native kernel (its body is the dense mode)
        from fastcar_compile.runtime.native import library_path

        lib = library_path()
        if lib is None:
            return
        so.register_custom_ops_library(str(lib))
    try:
        ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001
        if source is not None and not ort_loads(source):
            raise FastCarError(f"the input model {source} does not load in ONNX Runtime either "
                               f"({str(exc)[:300]}); fix or re-export it first") from None
        raise FastCarError(f"internal error: ONNX Runtime rejects the compiled model: {exc}") from None


def _compressed(model: ir.Model) -> bool:
    """Whether the model declares a compressed KV cache (its metadata, which MetadataPass wrote from the plan)."""
    return bool(model.metadata_props.get(contract.META_PREFIX + "kv_compress"))


class ValidatePass(ir.passes.InPlacePass):
    """Stage the model (write it beside the output) and check the written file; changes nothing."""

    def __init__(self, staging: Staging):
        super().__init__()
        self.staging = staging

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        path = self.staging.write(model)
        check_file(path, model, external=bool(self.staging.external), big=self.staging.big,
                   source=self.staging.source)
        return ir.passes.PassResult(model, modified=False)
