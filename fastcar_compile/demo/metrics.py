"""PSNR and SSIM with scikit-image's definitions (so numbers compare with published ones).

PSNR pools the squared error over the whole array (a clip's PSNR is from its mean MSE, as
`skimage.metrics.peak_signal_noise_ratio` does for any array). SSIM follows
`skimage.metrics.structural_similarity` defaults: 7x7 uniform window, K1 = 0.01, K2 = 0.03, sample
covariance, border of 3 pixels cropped, mean over channels; for a clip, the mean over frames.
"""

from __future__ import annotations

import numpy as np
from scipy.ndimage import uniform_filter

from fastcar_compile.core.errors import FastCarError


def _check(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        raise FastCarError(f"images differ in shape: {a.shape} vs {b.shape}")
    return a, b


def _range(a: np.ndarray, data_range: float | None) -> float:
    if data_range is not None:
        return float(data_range)
    if a.dtype == np.uint8:
        return 255.0
    if np.issubdtype(a.dtype, np.floating):
        return 2.0 if a.min() < 0 else 1.0
    raise FastCarError(f"give data_range for dtype {a.dtype}")


def psnr(a: np.ndarray, b: np.ndarray, data_range: float | None = None) -> float:
    """Peak signal-to-noise ratio in dB (inf when equal)."""
    a, b = _check(a, b)
    r = _range(a, data_range)
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else float(10 * np.log10(r * r / mse))


def _ssim_2d(x: np.ndarray, y: np.ndarray, r: float, win: int) -> float:
    c1, c2 = (0.01 * r) ** 2, (0.03 * r) ** 2
    n = win * win
    cov = n / (n - 1.0)
    ux, uy = uniform_filter(x, win), uniform_filter(y, win)
    uxx, uyy, uxy = uniform_filter(x * x, win), uniform_filter(y * y, win), uniform_filter(x * y, win)
    vx, vy, vxy = cov * (uxx - ux * ux), cov * (uyy - uy * uy), cov * (uxy - ux * uy)
    s = ((2 * ux * uy + c1) * (2 * vxy + c2)) / ((ux**2 + uy**2 + c1) * (vx + vy + c2))
    pad = (win - 1) // 2
    return float(s[pad:-pad, pad:-pad].mean())


def ssim(a: np.ndarray, b: np.ndarray, data_range: float | None = None, win: int = 7) -> float:
    """Structural similarity of [H, W], [H, W, C] or a clip [T, H, W, C] (mean over frames)."""
    a, b = _check(a, b)
    r = _range(a, data_range)
    if min(a.shape[-3:-1] if a.ndim >= 3 else a.shape) < win:
        raise FastCarError(f"images of shape {a.shape} are smaller than the {win}x{win} SSIM window")
    x, y = a.astype(np.float64), b.astype(np.float64)
    if x.ndim == 2:
        return _ssim_2d(x, y, r, win)
    if x.ndim == 3:
        return float(np.mean([_ssim_2d(x[..., c], y[..., c], r, win) for c in range(x.shape[-1])]))
    if x.ndim == 4:
        return float(np.mean([ssim(x[t], y[t], r, win) for t in range(x.shape[0])]))
    raise FastCarError(f"ssim takes [H,W], [H,W,C] or [T,H,W,C]; got shape {a.shape}")


def copy_rate(codes: np.ndarray) -> float:
    """Fraction of tokens equal to the token at the same position one frame earlier, codes [..., T, L]
    (frames 1.. of every clip): how much of a video "holds still" at the token level."""
    codes = np.asarray(codes)
    if codes.ndim < 2 or codes.shape[-2] < 2:
        raise FastCarError(f"copy rate needs codes [..., frames >= 2, tokens], got shape {codes.shape}")
    return float((codes[..., 1:, :] == codes[..., :-1, :]).mean())
