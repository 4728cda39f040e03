"""Loading a compiled model prints nothing: ONNX Runtime, at warning severity, says nothing when it creates a session
of fast.onnx (it warns about every initializer listed as a graph input), while tau stays overridable per run.

ORT's own log is the reference: each load runs in a fresh process whose stderr is captured whole.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from fastcar_compile.api import bake_threshold
from fastcar_compile.core import contract

LOAD = """
import sys, onnxruntime as ort
so = ort.SessionOptions()
so.log_severity_level = 2  # warning
if sys.argv[2] == "ort":
    ort.InferenceSession(sys.argv[1], so, providers=["CPUExecutionProvider"])
else:
    from fastcar_compile.runtime import FastCarSession
    FastCarSession(sys.argv[1], session_options=so, native=sys.argv[2] == "native")
"""


def _load_log(model: Path, how: str) -> str:
    env = {**os.environ, "FASTCAR_QUIET": "1"}
    r = subprocess.run([sys.executable, "-c", LOAD, str(model), how], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stderr


def _old_form(src: Path, dst: Path) -> Path:
    """The layout models were written in before: the defaults of video_start / fastcar_threshold also listed as
    graph inputs (ORT's overridable initializers)."""
    proto = onnx.load(str(src))
    listed = {v.name for v in proto.graph.input}
    for t in proto.graph.initializer:
        if t.name in contract.OVERRIDABLE and t.name not in listed:
            proto.graph.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    onnx.save(proto, str(dst))
    return dst


@pytest.fixture(scope="module")
def models(zoo_model, tmp_path_factory) -> dict[str, Path]:
    import fastcar_compile as fc

    d = tmp_path_factory.mktemp("quiet")
    dense = zoo_model("llama", "dynamo20")
    fc.compile(str(dense), str(d / "fast.onnx"), frame_tokens=4, threshold=0.5)
    fc.compile(str(dense), str(d / "per_layer.onnx"), frame_tokens=4, threshold=0.5, per_layer_threshold=True)
    old = _old_form(d / "fast.onnx", d / "old.onnx")
    bake_threshold(old, d / "rebaked.onnx", 0.25)
    return {"dense": dense, "fast": d / "fast.onnx", "per_layer": d / "per_layer.onnx", "old": old,
            "rebaked": d / "rebaked.onnx"}


@pytest.mark.parametrize("name", ["fast", "per_layer", "rebaked"])
def test_stock_session_prints_nothing(models, name):
    assert _load_log(models[name], "ort") == ""


def test_old_form_warns_in_stock_ort_but_not_in_fastcar_session(models):
    """ORT itself shows what the old layout cost (the reference that the check above can fail)."""
    assert "appears in graph inputs" in _load_log(models["old"], "ort")
    assert _load_log(models["old"], "fastcar") == ""


@pytest.mark.parametrize("name", ["fast", "per_layer"])
def test_fastcar_session_prints_nothing(models, name):
    assert _load_log(models[name], "fastcar") == ""


def test_fastcar_session_with_the_native_kernels_prints_nothing(models, native_lib):
    assert _load_log(models["fast"], "native") == ""


def _greedy_logits(sess, prompt: np.ndarray, steps: int, **kw) -> np.ndarray:
    state = sess.new_state(1)
    out = sess.step(state, prompt, **kw)
    logits = [out.logits[:, -1]]
    for _ in range(steps):
        out = sess.step(out.state, out.logits[:, -1:].argmax(-1), **kw)
        logits.append(out.logits[:, -1])
    return np.concatenate(logits)


def test_threshold_still_overridable(models):
    """tau=+inf per run gives the dense model's logits (eager-free reference: ORT on the input model); the
    default tau is the one compiled in (a stock session of the file, which cannot override it); an old-form model
    runs the same."""
    import onnxruntime as ort

    from fastcar_compile.runtime import FastCarSession

    prompt = np.array([[5, 17, 42, 7, 9, 11]], np.int64)
    dense = _greedy_logits(FastCarSession(models["dense"], native=False), prompt, 10)
    fast = FastCarSession(models["fast"], native=False)
    np.testing.assert_allclose(_greedy_logits(fast, prompt, 10, threshold=np.inf), dense, atol=1e-4)
    forced = _greedy_logits(fast, prompt, 10, threshold=-np.inf)
    assert np.abs(forced - dense).max() > 1e-3  # every eligible MLP replayed: tau reached the gate

    # the compiled-in default, read by a stock session from the file's initializer, equals the session's default
    stock = ort.InferenceSession(str(models["fast"]), providers=["CPUExecutionProvider"])
    assert contract.THRESHOLD not in {i.name for i in stock.get_inputs()}
    assert fast.default_threshold == pytest.approx(0.5)
    np.testing.assert_allclose(_greedy_logits(fast, prompt, 10), _greedy_logits(fast, prompt, 10, threshold=0.5))
    old = FastCarSession(models["old"], native=False)
    np.testing.assert_allclose(_greedy_logits(old, prompt, 10), _greedy_logits(fast, prompt, 10), atol=1e-6)
    rebaked = FastCarSession(models["rebaked"], native=False)
    assert rebaked.default_threshold == pytest.approx(0.25)
