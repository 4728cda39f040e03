"""float16 models replay in float16: the cached MLP branch values stay finite float16 and change the logits.

(tau = +inf equivalence and state dtypes of a float16 export: test_pass_equivalence.py.)
"""

from __future__ import annotations

import numpy as np
import ort_driver

import fastcar_compile as fc

L = 4


def test_fp16_replay_uses_cached_branch(zoo_model, tmp_path):
    """At tau = -inf every eligible token replays (and prefill never does); the cache holds float16 values."""
    src = str(zoo_model("llama", "dynamo20", "float16"))
    out = tmp_path / "fast.onnx"
    fc.compile(src, out, frame_tokens=L, threshold=float("-inf"), emit_diagnostics=True)
    rng = np.random.default_rng(2)
    steps = [rng.integers(0, 100, (2, L + 1))] + [rng.integers(0, 100, (2, 1)) for _ in range(3 * L)]
    fast = ort_driver.decode(str(out), steps, pad=[0, 0], frame_tokens=L)
    dense = ort_driver.decode(src, steps, pad=[0, 0])
    for layer in (0, 1):
        assert all(m.all() for m in fast.replay_mask[layer][1:]), "tau=-inf: every token after frame 0 replays"
        assert not fast.replay_mask[layer][0].any(), "prefill never replays"
    assert np.abs(fast.logits[-1].astype(np.float32) - dense.logits[-1].astype(np.float32)).max() > 1e-3
    cache = fast.final_state["past_mlp_cache.0"]
    assert cache.dtype == np.float16 and np.isfinite(cache.astype(np.float32)).all()
    assert (fast.final_state["past_mlp_age.0"] > 0).all()
