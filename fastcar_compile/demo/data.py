"""Deterministic video clips built from images that scikit-image and scikit-learn ship (no downloads).

Why synthetic camera motion over real photographs: the demo needs video with real texture and real
temporal redundancy (pans, zooms, drifts) plus some hard cases (fast motion, scene cuts), and it must be
reproducible offline. Train and evaluation clips come from disjoint source images (and disjoint digits).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image

from fastcar_compile.core.errors import FastCarError

FRAME = 32  # frame side in pixels
MOTIONS: tuple[str, ...] = (
    "pan_left", "pan_right", "pan_up", "pan_down",
    "fast_left", "fast_right", "fast_up", "fast_down",
    "zoom_in", "zoom_out", "drift", "digits", "cut",
)
# `cat` is the same photograph as `chelsea`: only chelsea is used. Evaluation sources never appear in training.
TRAIN_SOURCES: tuple[str, ...] = (
    "astronaut", "chelsea", "immunohistochemistry", "hubble_deep_field", "colorwheel", "retina",
    "camera", "moon", "page", "text", "gravel", "clock", "cell", "logo",
)
EVAL_SOURCES: tuple[str, ...] = ("coffee", "rocket", "coins", "brick", "grass")
_DIGIT_SPLIT = 1400  # sklearn digits [0, 1400) train, [1400, 1797) eval


@dataclass(frozen=True)
class Clip:
    """One clip: uint8 frames [T, H, W, 3] and the motion that made it (the model's prompt)."""

    frames: np.ndarray
    motion: str
    source: str


def _load_source(name: str) -> np.ndarray:
    """Float32 RGB image in [0, 1]; grey images become RGB."""
    import skimage.data

    img = getattr(skimage.data, name)()
    img = np.asarray(img)
    if img.dtype == bool:
        img = img.astype(np.float32)
    else:
        img = img.astype(np.float32) / 255.0
    if img.ndim == 2:
        img = np.repeat(img[..., None], 3, axis=2)
    return np.ascontiguousarray(img[..., :3])


_CACHE: dict[tuple[str, int], np.ndarray] = {}


def source_image(name: str, short: int) -> np.ndarray:
    """Source `name` resized so its short side is `short` pixels (cached: resizing is the slow part)."""
    if (name, short) not in _CACHE:
        _CACHE[(name, short)] = _resize(_load_source(name), short)
    return _CACHE[(name, short)]


def _tint(img: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Grey sources get a random colour tint so every clip is RGB with varied colour."""
    if np.allclose(img[..., 0], img[..., 1]) and np.allclose(img[..., 1], img[..., 2]):
        lo = rng.uniform(0.0, 0.35, size=3)
        hi = rng.uniform(0.65, 1.0, size=3)
        return lo + img * (hi - lo)
    return img


def _resize(img: np.ndarray, short: int) -> np.ndarray:
    h, w = img.shape[:2]
    s = short / min(h, w)
    pil = Image.fromarray((img * 255).astype(np.uint8))
    pil = pil.resize((max(short, round(w * s)), max(short, round(h * s))), Image.LANCZOS)
    return np.asarray(pil, dtype=np.float32) / 255.0


def _view(img: np.ndarray, cx: float, cy: float, scale: float) -> np.ndarray:
    """FRAME x FRAME view centred at (cx, cy), `scale` source pixels per output pixel (bilinear)."""
    pil = Image.fromarray((img * 255).astype(np.uint8))
    a = scale
    c = cx - a * FRAME / 2
    f = cy - a * FRAME / 2
    out = pil.transform((FRAME, FRAME), Image.AFFINE, (a, 0, c, 0, a, f), resample=Image.BILINEAR)
    return np.asarray(out, dtype=np.uint8)


def _fit(img: np.ndarray, need_w: float, need_h: float) -> np.ndarray:
    """`img` upscaled just enough that a pan spanning need_w x need_h pixels stays inside it.

    Why: long clips (16-64 frames) pan further than the 96-160 px sources are wide; a view leaving the image
    would show black borders. Short clips (8 frames) always fit, so their pixels are unchanged.
    """
    h, w = img.shape[:2]
    s = max(need_w / w, need_h / h)
    return img if s <= 1.0 else _resize(img, int(np.ceil(min(h, w) * s)) + 1)


def _camera_clip(img: np.ndarray, motion: str, frames: int, rng: np.random.Generator) -> np.ndarray:
    h, w = img.shape[:2]
    scale = 1.0
    if motion.startswith(("pan_", "fast_")):
        speed = rng.uniform(1.0, 2.5) if motion.startswith("pan_") else rng.uniform(4.0, 7.0)
        d = motion.split("_")[1]
        vx, vy = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}[d]
        vx, vy = vx * speed, vy * speed
        span_x, span_y = abs(vx) * (frames - 1), abs(vy) * (frames - 1)
        margin = FRAME / 2 + 1
        img = _fit(img, span_x + 2 * margin + 1, span_y + 2 * margin + 1)
        h, w = img.shape[:2]
        x0 = rng.uniform(margin + (span_x if vx < 0 else 0), w - margin - (span_x if vx > 0 else 0))
        y0 = rng.uniform(margin + (span_y if vy < 0 else 0), h - margin - (span_y if vy > 0 else 0))
        return np.stack([_view(img, x0 + vx * t, y0 + vy * t, scale) for t in range(frames)])
    if motion in ("zoom_in", "zoom_out"):
        s_big, s_small = rng.uniform(1.6, 2.2), rng.uniform(0.8, 1.1)
        s0, s1 = (s_big, s_small) if motion == "zoom_in" else (s_small, s_big)
        margin = s_big * FRAME / 2 + 1
        cx, cy = rng.uniform(margin, w - margin), rng.uniform(margin, h - margin)
        scales = np.geomspace(s0, s1, frames)
        return np.stack([_view(img, cx, cy, float(s)) for s in scales])
    if motion == "drift":
        steps = rng.normal(0, 0.7, size=(frames, 2))
        steps[0] = 0
        path = np.cumsum(steps, axis=0)
        margin = FRAME / 2 + 8
        cx, cy = rng.uniform(margin, w - margin), rng.uniform(margin, h - margin)
        return np.stack([_view(img, cx + p[0], cy + p[1], scale) for p in path])
    raise FastCarError(f"unknown camera motion {motion!r}; expected one of {MOTIONS}")


def _digits(split: str) -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    d = load_digits()
    images = d.images.astype(np.float32) / 16.0
    return (images[:_DIGIT_SPLIT], d.target[:_DIGIT_SPLIT]) if split == "train" else (
        images[_DIGIT_SPLIT:], d.target[_DIGIT_SPLIT:])


def _digit_clip(bg: np.ndarray, digits: np.ndarray, frames: int, rng: np.random.Generator) -> np.ndarray:
    """1-2 coloured handwritten digits (8x8 -> 12x12) bouncing over a blurred, darkened background view."""
    h, w = bg.shape[:2]
    cx, cy = rng.uniform(24, w - 24), rng.uniform(24, h - 24)
    back = _view(bg, cx, cy, 2.0).astype(np.float32) / 255.0 * 0.55
    n = int(rng.integers(1, 3))
    sprites, pos, vel, col = [], [], [], []
    for _ in range(n):
        g = digits[int(rng.integers(len(digits)))]
        spr = np.asarray(Image.fromarray((g * 255).astype(np.uint8)).resize((12, 12), Image.BILINEAR),
                         dtype=np.float32) / 255.0
        sprites.append(spr)
        pos.append(rng.uniform(0, FRAME - 12, size=2))
        vel.append(rng.uniform(-2.5, 2.5, size=2))
        col.append(rng.uniform(0.6, 1.0, size=3))
    out = []
    for _ in range(frames):
        f = back.copy()
        for i in range(n):
            x, y = (int(round(v)) for v in pos[i])
            a = sprites[i][..., None]
            f[y:y + 12, x:x + 12] = f[y:y + 12, x:x + 12] * (1 - a) + a * col[i]
            pos[i] = pos[i] + vel[i]
            for k in range(2):  # bounce off the borders
                if pos[i][k] < 0 or pos[i][k] > FRAME - 12:
                    vel[i][k] = -vel[i][k]
                    pos[i][k] = float(np.clip(pos[i][k], 0, FRAME - 12))
        out.append((np.clip(f, 0, 1) * 255).astype(np.uint8))
    return np.stack(out)


def make_clip(split: str, index: int, frames: int = 8, seed: int = 0) -> Clip:
    """Clip `index` of `split` ('train' or 'eval'); the same arguments always give the same pixels."""
    if split not in ("train", "eval"):
        raise FastCarError(f"split must be 'train' or 'eval', got {split!r}")
    if frames < 2:
        raise FastCarError(f"a clip needs at least 2 frames, got {frames}")
    rng = np.random.default_rng([seed, 0 if split == "train" else 1, index])
    sources = TRAIN_SOURCES if split == "train" else EVAL_SOURCES
    motion = MOTIONS[int(rng.integers(len(MOTIONS)))]
    name = sources[int(rng.integers(len(sources)))]
    img = _tint(source_image(name, int(rng.choice([96, 128, 160]))), rng)
    if motion == "digits":
        imgs, _ = _digits(split)
        return Clip(_digit_clip(img, imgs, frames, rng), motion, name)
    if motion == "cut":
        cut_at = int(rng.integers(2, frames)) if frames > 2 else 1
        other = sources[int(rng.integers(len(sources)))]
        img2 = _tint(source_image(other, int(rng.choice([96, 128, 160]))), rng)
        a = _camera_clip(img, "pan_" + str(rng.choice(["left", "right", "up", "down"])), frames, rng)
        b = _camera_clip(img2, "pan_" + str(rng.choice(["left", "right", "up", "down"])), frames, rng)
        return Clip(np.concatenate([a[:cut_at], b[cut_at:]]), motion, f"{name}+{other}")
    return Clip(_camera_clip(img, motion, frames, rng), motion, name)


def make_clips(split: str, count: int, frames: int = 8, seed: int = 0, start: int = 0) -> list[Clip]:
    """`count` clips of `split`, from index `start` (deterministic)."""
    return [make_clip(split, start + i, frames, seed) for i in range(count)]
