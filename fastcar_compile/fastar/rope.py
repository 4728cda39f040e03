"""LLaMA's default RoPE (rotate-half convention, as transformers' LlamaRotaryEmbedding)."""

from __future__ import annotations

import numpy as np


def inv_freq(head_dim: int, theta: float = 10000.0) -> np.ndarray:
    return 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)


def apply_rope(x: np.ndarray, pos: np.ndarray | int, theta: float | None = 10000.0) -> np.ndarray:
    """Rotate x [..., n, d] (or [..., d] with scalar pos) to positions pos [n]; computed in float64.

    theta=None means no position encoding (NoPE): identity. Tests use it where identical keys must stay
    identical across positions (the TempCache lemma is exact only for identical post-RoPE keys).
    """
    x = np.asarray(x, np.float64)
    if theta is None:
        return x
    d = x.shape[-1]
    ang = np.asarray(pos, np.float64)[..., None] * inv_freq(d, theta)  # [n, d/2]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
    rot = np.concatenate([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + rot * sin
