"""Shipped tokenizer: nearest-codeword encoding and the round trip against NumPy brute-force references."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("skimage")
pytest.importorskip("sklearn")

from fastcar_compile.core.errors import FastCarError  # noqa: E402
from fastcar_compile.demo import data  # noqa: E402
from fastcar_compile.demo.export import TOKENIZER  # noqa: E402
from fastcar_compile.demo.metrics import psnr  # noqa: E402
from fastcar_compile.demo.tokenizer import PATCH, PatchTokenizer  # noqa: E402


@pytest.fixture(scope="module")
def tok() -> PatchTokenizer:
    return PatchTokenizer.load(TOKENIZER)


def test_encode_is_nearest_codeword(tok: PatchTokenizer) -> None:
    frame = data.make_clip("eval", 1, frames=2).frames[0]
    codes = tok.encode(frame)
    assert codes.shape == (tok.tokens_per_frame,) and tok.tokens_per_frame >= 64
    g = tok.frame // PATCH
    for idx in [0, 9, 27, 63]:
        r, c = divmod(idx, g)
        patch = frame[r * PATCH:(r + 1) * PATCH, c * PATCH:(c + 1) * PATCH].reshape(-1).astype(np.float64) / 255
        d = ((tok.codebook.astype(np.float64) - patch) ** 2).sum(1)
        assert d[codes[idx]] <= d.min() + 1e-6


def _reference_round_trip(codebook: np.ndarray, frame: np.ndarray) -> np.ndarray:
    """Quantise a frame patch by patch in float64 (nearest codeword, explicit loops) and paint it back."""
    out = np.zeros(frame.shape, np.float64)
    cb = codebook.astype(np.float64)
    for r in range(0, frame.shape[0], PATCH):
        for c in range(0, frame.shape[1], PATCH):
            patch = frame[r:r + PATCH, c:c + PATCH].astype(np.float64) / 255
            best = cb[((cb - patch.reshape(-1)) ** 2).sum(1).argmin()]
            out[r:r + PATCH, c:c + PATCH] = best.reshape(PATCH, PATCH, 3)
    return np.round(np.clip(out, 0, 1) * 255).astype(np.uint8)


def test_round_trip_equals_a_brute_force_quantiser(tok: PatchTokenizer) -> None:
    """decode(encode(x)) against a float64 loop quantiser; PSNR against scikit-image's."""
    from skimage.metrics import peak_signal_noise_ratio

    clips = data.make_clips("eval", 2, frames=4)
    frames = np.concatenate([c.frames for c in clips])
    got = tok.decode(tok.encode(frames))
    want = np.stack([_reference_round_trip(tok.codebook, f) for f in frames])
    assert (np.abs(got.astype(int) - want.astype(int)) <= 1).mean() > 0.999  # rounding / argmin ties only
    ours = psnr(frames, got)
    theirs = peak_signal_noise_ratio(frames, want, data_range=255)
    assert ours == pytest.approx(theirs, abs=0.05)
    assert ours > 20.0  # a tokenizer this coarse still reconstructs the photographs
    # decoding then re-encoding a token grid gives the same tokens (codewords are their own nearest)
    t = tok.encode(clips[0].frames)
    assert (tok.encode(tok.decode(t)) == t).mean() > 0.98


def test_bad_tokens(tok: PatchTokenizer) -> None:
    with pytest.raises(FastCarError, match="token ids"):
        tok.decode(np.full(tok.tokens_per_frame, tok.vocab))
    with pytest.raises(FastCarError, match="frames must be"):
        tok.encode(np.zeros((16, 16, 3), np.uint8))
