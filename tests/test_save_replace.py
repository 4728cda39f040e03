"""Compiling over an earlier output: the .onnx rename is the only commit point, and afterwards the folder holds
exactly the files the new model reads (no stale data file from an earlier, larger compile)."""

from __future__ import annotations

import os
import types

import numpy as np
import onnx
import ort_driver
import pytest

import fastcar_compile as fc
from fastcar_compile import save
from fastcar_compile.errors import FastCarError

L = 4


def _steps(seed: int = 0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 100, (2, 5))] + [rng.integers(0, 100, (2, 1)) for _ in range(L)]


def _data_files(path) -> set[str]:
    """External-data files `path` names, read with onnx (not the code under test)."""
    proto = onnx.load(str(path), load_external_data=False)
    return {e.value for t in proto.graph.initializer for e in t.external_data if e.key == "location"}


def _weights(path) -> dict[str, np.ndarray]:
    return {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}


def _compile(src, out, monkeypatch, external: bool):
    """Compile with the inline limit lowered (external data from a tiny model) or at its default (inline)."""
    monkeypatch.setattr(save, "INLINE_WEIGHTS_MAX", 0 if external else 16 << 20)
    fc.compile(src, out, frame_tokens=L, threshold=float("inf"))


def _check(src, out):
    """The folder holds the model and exactly the data it names; it decodes as the uncompiled model does."""
    assert sorted(os.listdir(out.parent)) == sorted({out.name} | _data_files(out))
    dense = ort_driver.decode(str(src), _steps(), pad=[0, 1])
    fast = ort_driver.decode(str(out), _steps(), pad=[0, 1], frame_tokens=L)
    for a, b in zip(dense.logits, fast.logits, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("order", [(True, False), (False, True), (True, True)],
                         ids=["large-then-small", "small-then-large", "large-twice"])
def test_recompile_leaves_only_the_new_models_files(zoo_model, tmp_path, monkeypatch, order):
    first, second = zoo_model("llama", "dynamo20"), zoo_model("qwen2", "dynamo20")
    out = tmp_path / "out" / "fast.onnx"
    _compile(first, out, monkeypatch, order[0])
    assert bool(_data_files(out)) == order[0]
    _check(first, out)
    _compile(second, out, monkeypatch, order[1])
    assert bool(_data_files(out)) == order[1]
    _check(second, out)


@pytest.mark.parametrize("crash", ["raise", "observe"])
def test_replacing_keeps_the_old_pair_until_the_model_rename(zoo_model, tmp_path, monkeypatch, crash):
    """Between the data rename and the .onnx rename (a kill there, or a concurrent reader) the old .onnx still
    reads its own weights; an error at the .onnx rename leaves the old pair as it was, nothing extra."""
    first, second = zoo_model("llama", "dynamo20"), zoo_model("qwen2", "dynamo20")
    out = tmp_path / "out" / "fast.onnx"
    _compile(first, out, monkeypatch, True)
    old_weights, old_files = _weights(out), sorted(os.listdir(out.parent))
    calls, seen = [], []

    def replace(a, b):
        calls.append((a, b))
        if len(calls) == 2:  # the second rename of the commit: the new data file is already in place
            seen.append(_weights(out))  # what a reader (or the folder after a kill) sees now
            if crash == "raise":
                raise OSError("simulated failure before the model rename")
        os.replace(a, b)

    monkeypatch.setattr(save, "os", types.SimpleNamespace(**{**{k: getattr(os, k) for k in dir(os)
                                                                if not k.startswith("__")}, "replace": replace}))
    if crash == "raise":
        with pytest.raises(FastCarError, match="simulated"):  # the CLI's one-line OS error
            _compile(second, out, monkeypatch, True)
    else:
        _compile(second, out, monkeypatch, True)
    assert len(calls) == 2 and seen and seen[0].keys() == old_weights.keys()
    for name, arr in old_weights.items():
        np.testing.assert_array_equal(seen[0][name], arr)
    if crash == "raise":
        assert sorted(os.listdir(out.parent)) == old_files
        _check(first, out)
    else:
        _check(second, out)
