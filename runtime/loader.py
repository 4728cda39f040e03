"""One way to open an ONNX Runtime session on a model this package compiled or exported, for every runtime
(FastCarSession for decoders, the DiT stream's OrtDiT): the path's refusals, the model folder's shared lock
while the model and its external data are read (a compile replacing them waits: core/locks.py), the native
`ai.fastcar` kernels registered when they are built, the float16 fallback to the ops' function bodies (the
kernels are float32 only), and ONNX Runtime's failure as one line.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from fastcar_compile.core import contract
from fastcar_compile.core.errors import FastCarError
from fastcar_compile.core.fileio import refuse_special_input
from fastcar_compile.core.locks import folder_lock
from fastcar_compile.runtime.overridable import model_source

DEFAULT_THREADS = 2
_COPIED_OPTIONS = ("intra_op_num_threads", "inter_op_num_threads", "graph_optimization_level",
                   "enable_cpu_mem_arena", "log_severity_level")


def _ort():
    import onnxruntime as ort

    return ort


def session_options(threads: int, mem_pattern: bool = False):
    """The runtime's SessionOptions: `threads` intra-op threads (0: one per core), quiet, memory patterns off
    unless asked for (a graph whose input shapes repeat, as a DiT step's do within a chunk)."""
    so = _ort().SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    # ORT's memory patterns are cached per distinct input shape; a decode loop's attention mask grows by
    # one token every step, so each step cached a new plan that was never reused: resident memory grew by
    # a few KB per token even with a bounded KV cache (tests/test_session_memory.py)
    so.enable_mem_pattern = mem_pattern
    return so


def check_model_path(path: str | os.PathLike, what: str = "model file") -> Path:
    """`path` as a Path, refused in one line when it is a folder, a special file or missing."""
    path = Path(path)
    if path.is_dir():
        raise FastCarError(f"{what} {path} is a directory; pass the path of an .onnx file")
    refuse_special_input(path, what)
    if not path.is_file():
        raise FastCarError(f"{what} {path} does not exist; pass the path of an .onnx file")
    return path


def needs_native(name: str) -> str:
    """Why a compressed-KV model cannot run on the function bodies, and what to do (one line)."""
    return (f"{name} has a compressed KV cache ({contract.COMPRESSED_ATTENTION} with a budget), which only the "
            "native kernels run; build them (python -m fastcar_compile.runtime.native.build) or recompile "
            "without --kv-budget")


def _load_error(path: Path, exc: Exception, native: bool) -> str:
    """ORT's load failure as one line: a non-ONNX file is named as such; native=False only when it helps."""
    text = str(exc)
    if "protobuf parsing failed" in text.lower() or "INVALID_PROTOBUF" in text:
        return f"{path} is not an ONNX model (ONNX Runtime cannot parse it); give the path of an .onnx file"
    first = text.strip().splitlines()[0][:300] if text.strip() else type(exc).__name__
    if not native and contract.COMPRESSED_ATTENTION in text:  # the function body is the dense mode only
        return needs_native(path.name)
    hint = ""
    if native and any(k in text for k in ("ai.fastcar", "TemporalGate", "MLPCacheUpdate")):
        hint = " (the native kernels are float32 only; pass native=False)"
    return f"ONNX Runtime cannot load {path}: {first}{hint}"


def _native_library(native: bool | None) -> Path | None:
    """The native kernels' library to register: None when native=False or (native=None) not built; native=True
    refuses a missing one. Whether they are in use is said once per process (native.announce)."""
    if native is False:
        return None
    from fastcar_compile.runtime.native import announce, library_path, native_status

    lib = library_path()
    if lib is None and native:
        raise FastCarError(f"native=True but {native_status(None).split(': ', 1)[1]}")
    announce(lib)
    return lib


def open_session(path: Path, options: Any, *, providers: list[str] | None = None, native: bool | None = None,
                 plain_inputs: bool = True) -> tuple[Any, str | None]:
    """(InferenceSession, the native library registered or None) of the model at `path` (check_model_path'd)
    with SessionOptions `options`. native: None = the kernels when built, True = required, False = never. A
    float16 model the kernels refuse runs on the ops' function bodies instead (native=None). plain_inputs: a
    decoder's per-run values (runtime/overridable.py) as plain inputs; a graph without them skips the look."""
    ort = _ort()
    provs = providers or ["CPUExecutionProvider"]
    with folder_lock(path.parent, shared=True):
        lib = _native_library(native)
        plain = options
        if lib is not None:
            plain = _ort().SessionOptions()  # for the float16 fallback: the same settings, no library
            for attr in _COPIED_OPTIONS:
                setattr(plain, attr, getattr(options, attr))
            plain.enable_mem_pattern = options.enable_mem_pattern
            options.register_custom_ops_library(str(lib))
        # video_start / fastcar_threshold as plain inputs, fed every run (runtime/overridable.py)
        source = model_source(path, *{id(o): o for o in (options, plain)}.values()) if plain_inputs else str(path)
        try:
            return ort.InferenceSession(source, sess_options=options, providers=provs), \
                (str(lib) if lib is not None else None)
        except Exception as exc:  # ORT raises its own exception types; make it a user error
            if not (lib is not None and native is None and "TemporalGate" in str(exc) + str(exc.__cause__)):
                raise FastCarError(_load_error(path, exc, lib is not None)) from None
        try:  # the kernels are float32 only: a float16 model keeps its function bodies
            return ort.InferenceSession(source, sess_options=plain, providers=provs), None
        except Exception as exc2:
            raise FastCarError(f"ONNX Runtime cannot load {path}: {exc2}") from exc2
