"""VQ image tokenizer: a k-means codebook over 4x4 RGB patches (32x32 frame -> 8x8 = 64 tokens).

Why k-means and not a VQ-VAE: it trains in seconds on CPU, is exactly reproducible, and a frame's tokens
sit on a fixed raster grid, which is what FastCar's slot = position-in-frame assumption needs.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from fastcar_compile.core.atomic import atomic_path
from fastcar_compile.core.errors import FastCarError

PATCH = 4


def check_tokens(tokens: np.ndarray, per_frame: int, vocab: int) -> np.ndarray:
    """`tokens` as an array [..., per_frame] of ids in [0, vocab), or a one-line error saying what is wrong."""
    tokens = np.asarray(tokens)
    if tokens.shape[-1] != per_frame:
        raise FastCarError(f"expected {per_frame} tokens per frame, got {tokens.shape[-1]}")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab):
        raise FastCarError(f"token ids must lie in [0, {vocab}); got {tokens.min()}..{tokens.max()}")
    return tokens


class PatchTokenizer:
    """Frame [H, W, 3] uint8 <-> token grid [H/PATCH * W/PATCH] int64 (raster order)."""

    def __init__(self, codebook: np.ndarray, frame: int = 32) -> None:
        codebook = np.asarray(codebook, dtype=np.float32)
        if codebook.ndim != 2 or codebook.shape[1] != PATCH * PATCH * 3:
            raise FastCarError(f"codebook must be [K, {PATCH * PATCH * 3}], got {codebook.shape}")
        if frame % PATCH:
            raise FastCarError(f"frame size {frame} is not a multiple of the patch size {PATCH}")
        self.codebook = codebook
        self.frame = frame
        self._norms = (codebook**2).sum(1)

    @property
    def vocab(self) -> int:
        return int(self.codebook.shape[0])

    @property
    def tokens_per_frame(self) -> int:
        return (self.frame // PATCH) ** 2

    def _patches(self, frames: np.ndarray) -> np.ndarray:
        frames = np.asarray(frames)
        if frames.shape[-3:] != (self.frame, self.frame, 3):
            raise FastCarError(f"frames must be [..., {self.frame}, {self.frame}, 3], got {frames.shape}")
        lead = frames.shape[:-3]
        g = self.frame // PATCH
        x = frames.reshape(-1, g, PATCH, g, PATCH, 3).transpose(0, 1, 3, 2, 4, 5)
        return x.reshape(*lead, g * g, PATCH * PATCH * 3).astype(np.float32) / 255.0

    def encode(self, frames: np.ndarray) -> np.ndarray:
        """[..., H, W, 3] uint8 -> [..., L] int64 codes (nearest codeword, squared error)."""
        p = self._patches(frames)
        flat = p.reshape(-1, p.shape[-1])
        out = np.empty(len(flat), dtype=np.int64)
        for i in range(0, len(flat), 65536):  # chunks keep the distance matrix small
            x = flat[i:i + 65536]
            d = self._norms[None, :] - 2.0 * x @ self.codebook.T
            out[i:i + 65536] = d.argmin(1)
        return out.reshape(p.shape[:-1])

    def decode(self, tokens: np.ndarray) -> np.ndarray:
        """[..., L] codes -> [..., H, W, 3] uint8."""
        tokens = check_tokens(tokens, self.tokens_per_frame, self.vocab)
        lead = tokens.shape[:-1]
        g = self.frame // PATCH
        p = self.codebook[tokens.reshape(-1, g * g)].reshape(-1, g, g, PATCH, PATCH, 3)
        img = p.transpose(0, 1, 3, 2, 4, 5).reshape(*lead, self.frame, self.frame, 3)
        return (np.clip(img, 0, 1) * 255 + 0.5).astype(np.uint8)

    def save(self, path: str | os.PathLike) -> None:
        """Atomic save as .npz."""
        with atomic_path(path, ".npz") as tmp:
            np.savez(tmp, codebook=self.codebook.astype(np.float16), frame=np.int64(self.frame))

    @classmethod
    def load(cls, path: str | os.PathLike) -> PatchTokenizer:
        if not Path(path).exists():
            raise FastCarError(f"tokenizer file {path} not found; run scripts/train_demo.py to create it")
        z = np.load(path)
        return cls(z["codebook"].astype(np.float32), int(z["frame"]))


def train_tokenizer(frames: np.ndarray, codes: int = 512, seed: int = 0, max_patches: int = 200_000,
                    frame: int = 32) -> PatchTokenizer:
    """Fit a k-means codebook on patches of `frames` [N, H, W, 3] uint8 (sub-sampled, seeded)."""
    from sklearn.cluster import MiniBatchKMeans

    tok = PatchTokenizer(np.zeros((1, PATCH * PATCH * 3), np.float32), frame)
    p = tok._patches(frames).reshape(-1, PATCH * PATCH * 3)
    rng = np.random.default_rng(seed)
    if len(p) > max_patches:
        p = p[rng.choice(len(p), max_patches, replace=False)]
    km = MiniBatchKMeans(n_clusters=codes, random_state=seed, batch_size=8192, n_init=1, max_iter=60)
    km.fit(p)
    # round through float16 now so the shipped (fp16) codebook is exactly the one measured
    return PatchTokenizer(km.cluster_centers_.astype(np.float16).astype(np.float32), frame)
