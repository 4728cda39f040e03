"""PSNR/SSIM of the demo agree with scikit-image (the independent reference) on its own known images."""

from __future__ import annotations

import numpy as np
import pytest

skimage = pytest.importorskip("skimage")
from skimage import data as skdata  # noqa: E402
from skimage.metrics import peak_signal_noise_ratio, structural_similarity  # noqa: E402

from fastcar_compile.core.errors import FastCarError  # noqa: E402
from fastcar_compile.demo.metrics import psnr, ssim  # noqa: E402


def _noisy(img: np.ndarray, sigma: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(img.astype(np.float64) + rng.normal(0, sigma, img.shape), 0, 255).astype(np.uint8)


@pytest.mark.parametrize("name", ["camera", "astronaut", "coffee"])
@pytest.mark.parametrize("sigma", [3.0, 25.0])
def test_uint8_images_match_skimage(name: str, sigma: float) -> None:
    img = getattr(skdata, name)()[::2, ::2]
    other = _noisy(img, sigma, 1)
    assert psnr(img, other) == pytest.approx(peak_signal_noise_ratio(img, other), rel=1e-9)
    kw = {"channel_axis": -1} if img.ndim == 3 else {}
    assert ssim(img, other) == pytest.approx(structural_similarity(img, other, **kw), abs=1e-9)


def test_float_images_and_clips_match_skimage() -> None:
    img = skdata.astronaut()[100:164, 200:264].astype(np.float64) / 255
    other = np.clip(img + np.random.default_rng(0).normal(0, 0.05, img.shape), 0, 1)
    assert psnr(img, other) == pytest.approx(peak_signal_noise_ratio(img, other, data_range=1.0), rel=1e-9)
    assert ssim(img, other) == pytest.approx(structural_similarity(img, other, data_range=1.0, channel_axis=-1),
                                             abs=1e-9)
    clip = np.stack([skdata.chelsea()[i:i + 32, i:i + 32] for i in range(0, 40, 10)])
    noisy = _noisy(clip, 10.0, 2)
    assert psnr(clip, noisy) == pytest.approx(peak_signal_noise_ratio(clip, noisy), rel=1e-9)
    per_frame = np.mean([structural_similarity(a, b, channel_axis=-1) for a, b in zip(clip, noisy, strict=True)])
    assert ssim(clip, noisy) == pytest.approx(per_frame, abs=1e-9)


def test_identical_and_bad_input() -> None:
    img = skdata.camera()[:64, :64]
    assert psnr(img, img) == float("inf")
    assert ssim(img, img) == pytest.approx(1.0)
    with pytest.raises(FastCarError, match="shape"):
        psnr(img, img[:32])
    with pytest.raises(FastCarError, match="window"):
        ssim(img[:5, :5], img[:5, :5])
