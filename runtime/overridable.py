"""Load a compiled model with its per-run values (contract.OVERRIDABLE) as plain graph inputs.

fast.onnx stores the defaults of `video_start` and `fastcar_threshold` as initializers that are not graph inputs:
ONNX Runtime treats an initializer listed as an input as overridable but warns about each one on every load, so a
stock session runs with the defaults and prints nothing. FastCarSession changes tau and `video_start` per run, so
it loads the model with those initializers turned into plain inputs and feeds them (the defaults from the
metadata). Models written when the defaults were also graph inputs load the same way, without the warning.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastcar_compile.core import contract

# ONNX Runtime's session option for where a model given as bytes finds its external-data files
_EXTERNAL_DATA_FOLDER = "session.model_external_initializers_file_folder_path"


def with_plain_inputs(path: Path) -> bytes | None:
    """The model at `path` serialized with every initializer named in contract.OVERRIDABLE made a plain graph
    input (external data stays where it is); None when the model has none (a dense model, or one compiled with
    --required-video-inputs), so it loads from its path as it is."""
    import onnx

    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception:  # not a model onnx can read: ONNX Runtime's load names what is wrong
        return None
    graph = proto.graph
    defaults = [t for t in graph.initializer if t.name in contract.OVERRIDABLE]
    if not defaults:
        return None
    listed = {v.name for v in graph.input}
    for tensor in defaults:
        if tensor.name not in listed:
            graph.input.append(onnx.helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims)))
        graph.initializer.remove(tensor)
    return proto.SerializeToString()


def model_source(path: Path, *options: Any) -> str | bytes:
    """What to hand `onnxruntime.InferenceSession` for `path`: the path itself, or the bytes of
    `with_plain_inputs` with each of `options` (SessionOptions) told where the external data lies."""
    data = with_plain_inputs(path)
    if data is None:
        return str(path)
    for so in options:
        so.add_session_config_entry(_EXTERNAL_DATA_FOLDER, str(path.resolve().parent))
    return data
