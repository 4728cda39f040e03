"""Runtime input validation (issue 9, case 6/7): each bad input raises one clear FastCarError.

Uses the bundled decoder (no torch export): two compiles of it, and a second model with the same shapes
but other weights, whose state must not be accepted by the first.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import fastcar_compile as fc
from fastcar_compile.errors import FastCarError
from fastcar_compile.runtime import FastCarSession

BUNDLED = os.path.join(os.path.dirname(fc.__file__), "demo", "assets", "decoder.onnx")
L = 64


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("rt")
    fc.compile(BUNDLED, d / "a.onnx", frame_tokens=L, threshold=0.0)
    other = onnx.load(BUNDLED)  # same architecture and shapes, different weights
    t = max(other.graph.initializer, key=lambda t: t.ByteSize())
    t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t) * 1.5, t.name))
    onnx.save(other, str(d / "other.onnx"))
    fc.compile(d / "other.onnx", d / "b.onnx", frame_tokens=L, threshold=0.0)
    shutil.copyfile(d / "a.onnx", d / "a_copy.onnx")
    (d / "random.onnx").write_bytes(np.random.default_rng(0).bytes(5000))
    return d


@pytest.fixture(scope="module")
def sess(models):
    return FastCarSession(models / "a.onnx", native=False)


def test_state_from_another_model_with_the_same_shapes_is_refused(models, sess):
    other = FastCarSession(models / "b.onnx", native=False)
    assert [s.shape for s in other.specs] == [s.shape for s in sess.specs]  # the old check could not tell
    with pytest.raises(FastCarError, match="another model"):
        sess.step(other.new_state(1), np.array([[1]]))


def test_state_from_a_second_session_of_the_same_model_is_accepted(models, sess):
    twin = FastCarSession(models / "a_copy.onnx", native=False)
    out = sess.step(twin.new_state(1), np.array([[1, 2]]))
    ref = twin.step(twin.new_state(1), np.array([[1, 2]]))
    np.testing.assert_allclose(out.logits, ref.logits, atol=1e-6)


@pytest.mark.parametrize("prompt,kwargs,word", [
    ([[1, 2]], {"threshold": float("nan")}, "NaN"),
    ([[1, 2]], {"threshold": "abc"}, "threshold"),
    ([[1, -1]], {}, "negative"),
    ([[1, 10**6]], {}, "vocabulary"),
    ([[1, 2**70]], {}, "int64"),
    ([[1.5, 2]], {}, "integer"),
    (np.array([[1.5, 2.0]]), {}, "integer"),
    (np.zeros((1, 0), np.int64), {}, "empty"),
    ([[]], {}, "empty"),
    ([], {}, "empty"),
    ("abc", {}, "token ids"),
    ([[True, False]], {}, "integer"),
    ([[1, 2]], {"num_frames": 1.5}, "num_frames"),
    ([[1, 2]], {"num_frames": 0}, "num_frames"),
    ([[1, 2]], {"num_frames": "2"}, "num_frames"),
])
def test_generate_rejects(sess, prompt, kwargs, word):
    kwargs = {"num_frames": 1, **kwargs}
    with pytest.raises(FastCarError, match=word):
        sess.generate(prompt, **kwargs)


def test_out_of_vocab_id_in_step(sess):
    with pytest.raises(FastCarError, match="vocabulary"):
        sess.step(sess.new_state(1), np.array([[sess.vocab]]))
    with pytest.raises(FastCarError, match="negative"):
        sess.step(sess.new_state(1), np.array([[-1]]))


def test_trace_to_a_directory_is_refused_before_generating(sess, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(type(sess), "step", lambda *a, **k: calls.append(1))
    with pytest.raises(FastCarError, match="directory"):
        sess.generate([[1, 2]], 1, trace=str(tmp_path))
    assert not calls  # refused before any work (nothing generated then lost)


def test_random_bytes_are_named_as_not_onnx(models):
    with pytest.raises(FastCarError, match="not an ONNX model") as info:
        FastCarSession(models / "random.onnx")
    assert "native=False" not in str(info.value)


def test_directory_as_model(models):
    with pytest.raises(FastCarError, match="directory"):
        FastCarSession(models)
