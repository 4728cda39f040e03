"""Shipped tokenizer: nearest-codeword encoding (NumPy brute force reference), round trip within its
measured PSNR (recorded by the training run in train_log.json)."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("skimage")
pytest.importorskip("sklearn")

from fastcar_compile.demo import data  # noqa: E402
from fastcar_compile.demo.export import ASSETS, TOKENIZER  # noqa: E402
from fastcar_compile.demo.metrics import psnr  # noqa: E402
from fastcar_compile.demo.tokenizer import PATCH, PatchTokenizer  # noqa: E402
from fastcar_compile.errors import FastCarError  # noqa: E402


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


def test_round_trip_within_measured_psnr(tok: PatchTokenizer) -> None:
    log = json.loads((ASSETS / "train_log.json").read_text())
    measured = log["summary"]["tokenizer_psnr_eval"]
    n = log["summary"]["eval_clips"]
    clips = data.make_clips("eval", n, frames=8)
    got = np.mean([psnr(c.frames, tok.decode(tok.encode(c.frames))) for c in clips])
    assert got == pytest.approx(measured, abs=0.05)
    assert got > 20.0  # a tokenizer this coarse still reconstructs the photographs
    # decoding then re-encoding a token grid gives the same tokens (codewords are their own nearest)
    t = tok.encode(clips[0].frames)
    assert (tok.encode(tok.decode(t)) == t).mean() > 0.98


def test_bad_tokens(tok: PatchTokenizer) -> None:
    with pytest.raises(FastCarError, match="token ids"):
        tok.decode(np.full(tok.tokens_per_frame, tok.vocab))
    with pytest.raises(FastCarError, match="frames must be"):
        tok.encode(np.zeros((16, 16, 3), np.uint8))
