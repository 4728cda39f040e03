"""float16 models keep their dtype: the MLP cache is float16, TAS is computed in float32.

Reference: the original float16 export in ORT (tau = +inf must be the same model) and, for replay,
a NumPy reading of the replay rule applied to the original model's own MLP branch values.
"""

from __future__ import annotations

import numpy as np
import onnx
import ort_driver
import pytest
import torch
import zoo

import fastcar_compile as fc

L = 4


@pytest.fixture(scope="module")
def fp16_llama(tmp_path_factory) -> str:
    info = zoo.model_info("llama")
    model = zoo.build_model("llama").to(torch.float16)
    wrapper = zoo.FlatKVWrapper(model, info.num_layers).eval()
    path = tmp_path_factory.mktemp("fp16") / "llama-fp16.onnx"
    orig = zoo.example_inputs

    def half_inputs(info, *a, **k):
        ins = orig(info, *a, **k)
        return tuple(t.to(torch.float16) if t.is_floating_point() else t for t in ins)

    zoo.example_inputs = half_inputs
    try:
        with torch.no_grad():
            zoo._export_dynamo(wrapper, info, path, 20)
    finally:
        zoo.example_inputs = orig
    return str(path)


def _steps(rng, batch=2, prompt=5, n=3 * L):
    return [rng.integers(0, 100, (batch, prompt))] + [rng.integers(0, 100, (batch, 1)) for _ in range(n)]


def test_fp16_state_dtype_and_inf_equivalence(fp16_llama, tmp_path):
    out = tmp_path / "fast.onnx"
    fc.compile(fp16_llama, out, frame_tokens=L, threshold=float("inf"))
    model = onnx.load(str(out), load_external_data=False)
    types = {i.name: i.type.tensor_type.elem_type for i in model.graph.input}
    assert types["past_mlp_cache.0"] == onnx.TensorProto.FLOAT16
    assert types["past_key_values.0.key"] == onnx.TensorProto.FLOAT16
    steps = _steps(np.random.default_rng(1))
    dense = ort_driver.decode(fp16_llama, steps, pad=[0, 1])
    fast = ort_driver.decode(str(out), steps, pad=[0, 1], frame_tokens=L)
    for a, b in zip(dense.logits, fast.logits, strict=True):
        assert a.dtype == np.float16 and b.dtype == np.float16
        # ORT fuses the float16 norm differently inside the If subgraph: a few float16 ulps, not exact.
        np.testing.assert_allclose(a.astype(np.float32), b.astype(np.float32), rtol=1e-2, atol=1e-2)


def test_fp16_replay_uses_cached_branch(fp16_llama, tmp_path):
    """At tau = -inf every eligible token replays: logits change, and the cache holds float16 values."""
    out = tmp_path / "fast.onnx"
    fc.compile(fp16_llama, out, frame_tokens=L, threshold=float("-inf"), emit_diagnostics=True)
    steps = _steps(np.random.default_rng(2), prompt=L + 1)
    fast = ort_driver.decode(str(out), steps, pad=[0, 0], frame_tokens=L)
    dense = ort_driver.decode(fp16_llama, steps, pad=[0, 0])
    for layer in (0, 1):
        assert all(m.all() for m in fast.replay_mask[layer][1:]), "tau=-inf: every token after frame 0 replays"
        assert not fast.replay_mask[layer][0].any(), "prefill never replays"
    assert np.abs(fast.logits[-1].astype(np.float32) - dense.logits[-1].astype(np.float32)).max() > 1e-3
    cache = fast.final_state["past_mlp_cache.0"]
    assert cache.dtype == np.float16 and np.isfinite(cache.astype(np.float32)).all()
    assert (fast.final_state["past_mlp_age.0"] > 0).all()
