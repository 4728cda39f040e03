"""VQ-VAE frame tokenizer: codes are the nearest codebook vectors of the encoder output (NumPy float64
reference), training lowers reconstruction error, save/load keeps the codes, the loader tells it from k-means."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("skimage")
pytest.importorskip("sklearn")

from fastcar_compile.core.errors import FastCarError  # noqa: E402
from fastcar_compile.demo import scenes  # noqa: E402
from fastcar_compile.demo.metrics import psnr  # noqa: E402
from fastcar_compile.demo.tokenizer import PatchTokenizer, train_tokenizer  # noqa: E402
from fastcar_compile.demo.vqvae import VQVAETokenizer, load_frame_tokenizer, train_vqvae  # noqa: E402


@pytest.fixture(scope="module")
def frames() -> np.ndarray:
    return np.concatenate([c.frames for c in scenes.make_scene_clips("train", 6, frames=8)])


def test_codes_are_nearest_and_training_helps(frames, tmp_path) -> None:
    untrained = train_vqvae(frames, codes=64, steps=1, seed=0)
    tok = train_vqvae(frames, codes=64, steps=60, seed=0, batch=32)
    assert psnr(frames, tok.decode(tok.encode(frames))) > psnr(frames, untrained.decode(untrained.encode(frames)))
    codes = tok.encode(frames[:3])
    assert codes.shape == (3, tok.tokens_per_frame) and codes.dtype == np.int64
    with torch.no_grad():
        x = torch.from_numpy(frames[:3]).float().div(255).permute(0, 3, 1, 2) - 0.5
        z = tok.net.enc(x).permute(0, 2, 3, 1).reshape(3, -1, tok.net.codebook.shape[1]).double().numpy()
    cb = tok.net.codebook.double().numpy()
    d = ((z[:, :, None, :] - cb[None, None]) ** 2).sum(-1)
    picked = np.take_along_axis(d, codes[..., None], -1)[..., 0]
    assert (picked <= d.min(-1) + 1e-6).all()
    tok.save(tmp_path / "vq.npz")
    back = load_frame_tokenizer(tmp_path / "vq.npz")
    assert isinstance(back, VQVAETokenizer)
    np.testing.assert_array_equal(back.encode(frames[:3]), codes)
    np.testing.assert_array_equal(back.decode(codes), tok.decode(codes))
    with pytest.raises(FastCarError, match="token ids"):
        tok.decode(np.full(tok.tokens_per_frame, tok.vocab))


def test_loader_keeps_kmeans_tokenizers(frames, tmp_path) -> None:
    km = train_tokenizer(frames, codes=16, seed=0)
    km.save(tmp_path / "km.npz")
    back = load_frame_tokenizer(tmp_path / "km.npz")
    assert isinstance(back, PatchTokenizer)
    np.testing.assert_array_equal(back.codebook, km.codebook)
    with pytest.raises(FastCarError, match="not found"):
        load_frame_tokenizer(tmp_path / "missing.npz")
