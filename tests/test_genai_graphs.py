"""onnxruntime-genai builder graphs (issue 11): the fixtures themselves, then compiling them.

The genai graph is built from the same seeded transformers model the eager reference runs, so the plain
graph must reproduce transformers' logits (fp32) before anything of ours is involved.
"""

from __future__ import annotations

import numpy as np
import ort_driver
import pytest

pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (pip install '.[genai]')")
genai_zoo = pytest.importorskip("genai_zoo", reason="the genai graphs need torch and transformers")
from reference import plain_logits  # noqa: E402

HEAD_DIM = 16


def _steps(batch: int = 2, prompt: int = 5, decode: int = 6, seed: int = 3) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, genai_zoo.GENAI_VOCAB, (batch, prompt))] + [
        rng.integers(3, genai_zoo.GENAI_VOCAB, (batch, 1)) for _ in range(decode)]


@pytest.mark.parametrize("family", ["llama"])
def test_genai_graph_equals_transformers(genai_model, family):
    """The builder's graph (GroupQueryAttention, packed QKV, fused rotary) = the transformers model, fp32."""
    folder = genai_model(family, "fp32")
    steps = _steps()
    got = ort_driver.decode(folder / "model.onnx", steps, head_dim=HEAD_DIM)
    want = plain_logits(genai_zoo.build_model(family), steps)
    for g, w in zip(got.logits, want, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-4)
