"""A minimal ONNX Runtime decode driver for the tests, independent of `fastcar_compile.runtime`.

It feeds a model's inputs by name (the I/O contract of tests/zoo.py plus the FastCar state of docs/DESIGN.md),
runs a prefill step and teacher-forced decode steps, carries every `present*` output back into the matching
`past*` input, and returns per-step logits and the `replay_mask.N` / `tas.N` diagnostics when present.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort

_ORT_TO_NP = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(double)": np.float64,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(bool)": np.bool_,
}


# The per-layer state onnxruntime-genai's generator recycles besides the KV cache (src/models/recurrent_state.cpp,
# docs/semantics.md): allocated from the input's static shape, zero-filled for a new sequence, present -> past each step.
GENAI_RECURRENT = re.compile(r"past_key_values\.\d+\.(conv_state|recurrent_state)")


def native_or_none() -> Path | None:
    """The native kernels' library, or None where it cannot be built (tests then check the function bodies only
    and report the kernel half as a skip: skip_native_half)."""
    from fastcar_compile.runtime.native import build

    try:
        return build.build(log=lambda *_: None)
    except build.Skipped:
        return None


def skip_native_half(lib: Path | None) -> None:
    """After a body-only check: say so as a skip where the kernels were not built."""
    if lib is None:
        import pytest

        pytest.skip("function bodies checked; native kernels not built here "
                    "(`python -m fastcar_compile.runtime.native.build` says why)")


# the compiled model's per-run values: initializers of fast.onnx, made graph inputs where a test feeds them
VIDEO_INPUTS = frozenset({"video_start", "fastcar_threshold"})


def make_session(path: str | Path | bytes, threads: int = 1, native: bool = False,
                 inputs: set[str] | frozenset[str] = frozenset()) -> ort.InferenceSession:
    """A CPU session with one intra-op thread (the test machine is shared); `native`: with the ai.fastcar kernels
    registered (the test is skipped where they are not built); `inputs`: initializers of the file made plain
    graph inputs, so a run can feed them (fast.onnx's `video_start`, `fastcar_threshold` defaults)."""
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    if native:
        import pytest

        from fastcar_compile.runtime.native import library_path

        lib = library_path()
        if lib is None:
            pytest.skip("native kernels not built here")
        so.register_custom_ops_library(str(lib))
    return ort.InferenceSession(model_source(path, so, inputs), so, providers=["CPUExecutionProvider"])


def model_source(path: str | Path | bytes, so: ort.SessionOptions, inputs=frozenset()) -> str | bytes:
    """The model for InferenceSession: its path, or with the initializers named in `inputs` made plain graph
    inputs (ONNX Runtime cannot feed an initializer that is not an input; its session-level initializer override
    is applied after constant folding, so it is not used here)."""
    if isinstance(path, bytes) or not inputs:
        return path if isinstance(path, bytes) else str(path)
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    graph = proto.graph
    listed = {v.name for v in graph.input}
    for t in [t for t in graph.initializer if t.name in inputs]:
        if t.name not in listed:
            graph.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
        graph.initializer.remove(t)
    so.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                str(Path(path).resolve().parent))
    return proto.SerializeToString()


def session_with(model: str | Path | ort.InferenceSession, values: dict[str, np.ndarray]) -> ort.InferenceSession:
    """A session of `model` that takes each of `values` as a graph input (a session made elsewhere as it is)."""
    if isinstance(model, ort.InferenceSession):
        return model
    return make_session(model, inputs=frozenset(values))


def past_name_for(output_name: str) -> str | None:
    """The state input an output feeds next step: present.N.key -> past_key_values.N.key, present_X -> past_X."""
    if output_name.startswith("present."):
        return "past_key_values." + output_name[len("present.") :]
    if output_name.startswith("present_"):
        return "past_" + output_name[len("present_") :]
    return None


@dataclass
class DecodeResult:
    """Per-step outputs of one decode; diagnostics are keyed by layer index."""

    logits: list[np.ndarray] = field(default_factory=list)  # each [B, S_step, V]
    replay_mask: dict[int, list[np.ndarray]] = field(default_factory=dict)  # each [B, S_step] bool
    tas: dict[int, list[np.ndarray]] = field(default_factory=dict)  # each [B, S_step] float32
    final_state: dict[str, np.ndarray] = field(default_factory=dict)  # last values of every past* input


def _static_dim(shape: list, axis: int, what: str, name: str) -> int:
    dim = shape[axis] if axis < len(shape) else None
    if not isinstance(dim, int):
        raise ValueError(f"input {name}: {what} (axis {axis}) must be a static dimension, got {dim!r}")
    return dim


def initial_state(
    sess: ort.InferenceSession, batch: int, frame_tokens: int | None = None, head_dim: int | None = None
) -> dict[str, np.ndarray]:
    """Empty KV cache ([B, Hkv, 0, D]) and a new video's FastCar state (caches 0, ages -1; genai's recurrent
    state zeros, as its generator starts it).

    head_dim: for graphs whose KV head size is symbolic (onnxruntime-genai's builder).
    """
    meta = sess.get_modelmeta().custom_metadata_map
    state: dict[str, np.ndarray] = {}
    for inp in sess.get_inputs():
        name, shape = inp.name, list(inp.shape)
        dtype = _ORT_TO_NP[inp.type]
        if GENAI_RECURRENT.fullmatch(name):  # genai's RecurrentState: zeros of the static shape, batch free
            dims = [batch] + [_static_dim(shape, a, "recurrent state", name) for a in range(1, len(shape))]
            state[name] = np.zeros(dims, dtype=dtype)
        elif name.startswith("past_key_values."):
            hkv = _static_dim(shape, 1, "kv heads", name)
            d = head_dim if head_dim is not None and not isinstance(shape[3], int) else _static_dim(
                shape, 3, "head dim", name)
            state[name] = np.zeros((batch, hkv, 0, d), dtype=dtype)
        elif name.startswith(("past_mlp_cache.", "past_mlp_age.")):
            L = shape[1] if isinstance(shape[1], int) else (frame_tokens or int(meta["fastcar.frame_tokens"]))
            if name.startswith("past_mlp_cache."):
                hidden = _static_dim(shape, 2, "hidden", name)
                state[name] = np.zeros((batch, L, hidden), dtype=dtype)
            else:
                state[name] = np.full((batch, L), -1, dtype=dtype)
        elif name.startswith("past"):
            raise ValueError(f"unknown state input {name!r}: the driver does not know how to start it")
    return state


def left_pad_masks(pad: list[int] | np.ndarray, prompt_len: int) -> tuple[np.ndarray, np.ndarray]:
    """attention_mask (zeros on the left) and position_ids (cumsum - 1, pads at 1 as transformers does)."""
    pad = np.asarray(pad, dtype=np.int64)
    mask = (np.arange(prompt_len)[None, :] >= pad[:, None]).astype(np.int64)
    pos = np.cumsum(mask, axis=1) - 1
    pos = np.where(mask == 0, 1, pos).astype(np.int64)
    return mask, pos


def decode(
    model: str | Path | ort.InferenceSession,
    steps: list[np.ndarray],
    pad: list[int] | None = None,
    video_start: int | None = None,
    threshold: float | list[float] | np.ndarray | None = None,
    frame_tokens: int | None = None,
    head_dim: int | None = None,
) -> DecodeResult:
    """Run `steps` (token ids [B, S] each; the first is the prompt) carrying all state between steps.

    pad: left-padding length per row of the prompt. video_start / threshold: override the graph's defaults
    (`video_start`, `fastcar_threshold` inputs); None leaves the defaults in the model, and feeds video_start 0
    (every step's tokens are video) to a model that takes it as an input without a default.
    """
    values = {name: np.asarray(value, dtype=dtype) for name, value, dtype in (
        ("video_start", video_start, np.int64), ("fastcar_threshold", threshold, np.float32)) if value is not None}
    sess, extra = session_with(model, values), dict(values)
    batch = int(steps[0].shape[0])
    input_names = {i.name for i in sess.get_inputs()}
    if "video_start" in input_names and "video_start" not in extra:
        extra["video_start"] = np.array(0, np.int64)
    overridable = {i.name for i in sess.get_overridable_initializers()}
    out_names = [o.name for o in sess.get_outputs()]
    state = initial_state(sess, batch, frame_tokens, head_dim)
    mask, pos = left_pad_masks(pad if pad is not None else [0] * batch, int(steps[0].shape[1]))
    for name in extra:
        if name not in input_names | overridable:
            raise ValueError(f"model has no input {name!r} to override")
    res = DecodeResult()
    for k, ids in enumerate(steps):
        ids = np.asarray(ids, dtype=np.int64)
        if ids.shape[0] != batch:
            raise ValueError(f"step {k}: batch {ids.shape[0]} != {batch}")
        if k > 0:
            s = ids.shape[1]
            pos = pos[:, -1:] + 1 + np.arange(s, dtype=np.int64)[None, :]
            mask = np.concatenate([mask, np.ones((batch, s), dtype=np.int64)], axis=1)
        feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": pos, **state, **extra}
        feeds = {n: v for n, v in feeds.items() if n in input_names or n in overridable}
        missing = input_names - feeds.keys()
        if missing:
            raise ValueError(f"no feed for required inputs {sorted(missing)}")
        outs = dict(zip(out_names, sess.run(out_names, feeds), strict=True))
        res.logits.append(outs["logits"])
        for name, val in outs.items():
            m = re.fullmatch(r"(replay_mask|tas)\.(\d+)", name)
            if m:
                getattr(res, m.group(1)).setdefault(int(m.group(2)), []).append(val)
            nxt = past_name_for(name)
            if nxt is not None:
                if nxt not in input_names:
                    raise ValueError(f"output {name!r} has no matching state input {nxt!r}")
                state[nxt] = val
    res.final_state = state
    return res


def greedy(model: str | Path, prompt: list[int], new_tokens: int, video_start: int,
           threshold: float | None = None, vocab_limit: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Greedy generation of one row: (the new tokens [new_tokens], replay bits [decode steps, layers] from the
    replay_mask.N outputs, when the model has them). Argmax over the first `vocab_limit` logits."""
    values = {"video_start": np.array(video_start, np.int64)}
    if threshold is not None:
        values["fastcar_threshold"] = np.array(threshold, np.float32)
    sess, extra = session_with(model, values), values
    input_names = {i.name for i in sess.get_inputs()} | {i.name for i in sess.get_overridable_initializers()}
    out_names = [o.name for o in sess.get_outputs()]
    masks = sorted((int(n.split(".")[1]), n) for n in out_names if n.startswith("replay_mask."))
    state = initial_state(sess, 1)
    ids = np.array([prompt], np.int64)
    past, toks, bits = 0, [], []
    while len(toks) < new_tokens:
        s = ids.shape[1]
        feeds = {"input_ids": ids, "attention_mask": np.ones((1, past + s), np.int64),
                 "position_ids": np.arange(past, past + s, dtype=np.int64)[None], **state, **extra}
        outs = dict(zip(out_names, sess.run(out_names, {k: v for k, v in feeds.items() if k in input_names}),
                        strict=True))
        if past:  # a decode step
            bits.append([bool(outs[n][0, 0]) for _, n in masks])
        for name, val in outs.items():
            nxt = past_name_for(name)
            if nxt is not None and nxt in state:
                state[nxt] = val
        past += s
        toks.append(int(outs["logits"][0, -1, :vocab_limit].argmax()))
        ids = np.array([[toks[-1]]], np.int64)
    return np.array(toks), np.array(bits, dtype=bool).reshape(len(bits), len(masks))
