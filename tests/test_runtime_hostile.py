"""Runtime input validation: each bad input raises one clear FastCarError.

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
from fastcar_compile.core.errors import FastCarError
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


# ------------------------------------------------------------------ values of the runtime API
@pytest.mark.parametrize("prompt,kwargs,word", [
    ([[1, 2]], {"seed": -1, "do_sample": True}, "seed"),
    ([[1, 2]], {"seed": 1.5}, "seed"),
    ([[1, 2]], {"seed": "0"}, "seed"),
    ([[1, 2]], {"cfg_scale": float("nan"), "uncond_prompt_ids": [[1]]}, "cfg_scale"),
    ([[1, 2]], {"cfg_scale": float("inf"), "uncond_prompt_ids": [[1]]}, "cfg_scale"),
    ([[1, 2]], {"cfg_scale": "2", "uncond_prompt_ids": [[1]]}, "cfg_scale"),
    ([[1, 2]], {"logits_processor": lambda g: g * np.nan}, "NaN"),
    ([[1, 2]], {"logits_processor": lambda g: np.where(np.arange(g.shape[-1]) == 3, np.inf, g)}, r"\+inf"),
    ([[1, 2]], {"logits_processor": lambda g: np.full_like(g, -np.inf)}, "every token"),
    ([[1, 2]], {"logits_processor": lambda g: g[:, :5]}, "shape"),
    ([[1, 2]], {"logits_processor": lambda g: None}, "logits_processor"),
], ids=["seed=-1", "seed=1.5", "seed='0'", "cfg_scale=nan", "cfg_scale=inf", "cfg_scale='2'", "processor NaN",
        "processor +inf", "processor all -inf", "processor shape", "processor None"])
def test_generate_rejects_values(sess, prompt, kwargs, word):
    with pytest.raises(FastCarError, match=word) as info:
        sess.generate(prompt, 1, **kwargs)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("args,kwargs,word", [
    ((10**9,), {}, "GiB"),
    ((2.5,), {}, "batch"),
    (("2",), {}, "batch"),
    ((True,), {}, "batch"),
    ((0,), {}, "batch"),
    ((1,), {"video_start": "abc"}, "video_start"),
    ((1,), {"video_start": -5}, "video_start"),
    ((1,), {"video_start": 2**70}, "video_start"),
], ids=["batch=10**9", "batch=2.5", "batch='2'", "batch=True", "batch=0", "video_start='abc'", "video_start=-5",
        "video_start=2**70"])
def test_new_state_rejects(sess, args, kwargs, word):
    with pytest.raises(FastCarError, match=word) as info:
        sess.new_state(*args, **kwargs)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("positions,word", [
    (np.array([[-3, -2]]), ">= 0"),
    (np.array([[0.5, 1.0]]), "integers"),
    (np.array([[0, 1, 2]]), r"\[1, 2\]"),
    (np.array([[2**63, 0]], np.uint64), ">= 0"),
], ids=["negative", "floats", "shape", "uint64 wrap"])
def test_step_rejects_position_ids(sess, positions, word):
    with pytest.raises(FastCarError, match=word):
        sess.step(sess.new_state(1), np.array([[1, 2]]), position_ids=positions)


@pytest.mark.parametrize("kwargs,word", [
    ({"threads": 10**6}, "threads"),
    ({"threads": -1}, "threads"),
    ({"threads": 1.5}, "threads"),
    ({"max_length": True}, "max_length"),
    ({"max_length": 0}, "max_length"),
    ({"max_length": 10**12}, "max_length"),
], ids=["threads=10**6", "threads=-1", "threads=1.5", "max_length=True", "max_length=0", "max_length=10**12"])
def test_session_rejects(models, kwargs, word):
    with pytest.raises(FastCarError, match=word) as info:
        FastCarSession(models / "a.onnx", **kwargs)
    assert "\n" not in str(info.value)


def test_state_beyond_memory_is_refused_up_front(native_lib, tmp_path, monkeypatch):
    """A compiled --kv-budget: every video holds that many key/value slots per KV head (and their records); a
    state beyond the memory available is refused when the session opens, naming the size and the limit, instead
    of a MemoryError later (16777216 slots: 25 GiB here). The size is computed here from the bundled graph's KV
    shapes at the largest budget the compiler takes; the available memory is set below it."""
    from fastcar_compile.core import limits

    budget = 1 << 20
    fc.compile(BUNDLED, tmp_path / "big.onnx", frame_tokens=L, threshold=0.0, kv_budget=budget, kv_sinks=4,
               kv_window=L)
    kv = [i for i in onnx.load(BUNDLED).graph.input if i.name.startswith("past_key_values")]
    per_slot = sum(i.type.tensor_type.shape.dim[1].dim_value * (i.type.tensor_type.shape.dim[3].dim_value + 1.5)
                   for i in kv) * 4  # key/value rows + the slot records (3 floats per layer and KV head)
    want = f"{budget * per_slot / 2**30:.1f} GiB"
    monkeypatch.setattr(limits, "available_memory_bytes", lambda: 1 << 30)
    with pytest.raises(FastCarError, match="more than the 1.0 GiB") as info:
        FastCarSession(tmp_path / "big.onnx")
    assert want in str(info.value) and "--kv-budget" in str(info.value)


def test_video_longer_than_max_length_is_refused_before_generating(models, native_lib, monkeypatch):
    """2 frames of 64 tokens after a 3-token prompt need 130 KV positions: with max_length=96 the session
    refuses before the first step (it used to generate 94 tokens, then fail)."""
    s = FastCarSession(models / "a.onnx", max_length=96)
    calls = []
    monkeypatch.setattr(type(s), "step", lambda *a, **k: calls.append(1))
    with pytest.raises(FastCarError, match="max_length=96"):
        s.generate([[1, 2, 3]], 2)
    assert not calls
