"""Labelled scene clips for the conditioned video model: camera pans / zooms / rotations over the bundled
photographs with speed changes, several moving and rotating objects, an occluding bar and cuts.

Why a second generator next to `data.make_clip`: the 1-layer and long demo models are trained on
`make_clip`'s single-motion clips and must keep them; the conditioned model needs clips whose motion is
richer (so a model that copies the previous frame is visibly wrong) and described by labels it can be
conditioned on. Every clip records its true camera path, so a pan's per-frame shift is known exactly.
Same split rules as `data`: evaluation photographs and digits never appear in training clips.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image

from fastcar_compile.core.errors import FastCarError
from fastcar_compile.demo.data import EVAL_SOURCES, FRAME, TRAIN_SOURCES, _digits, _fit, _tint, source_image

_PANS = {"pan_left": (-1, 0), "pan_right": (1, 0), "pan_up": (0, -1), "pan_down": (0, 1),
         "pan_up_left": (-1, -1), "pan_up_right": (1, -1), "pan_down_left": (-1, 1), "pan_down_right": (1, 1)}
# Conditioning fields and their values, in prompt order (one token per field). Declared once: the token ids
# (fastcar_compile.demo.condition) are derived from this table.
LABELS: dict[str, tuple[str, ...]] = {
    "camera": ("static", *_PANS, "zoom_in", "zoom_out", "rotate_cw", "rotate_ccw"),
    "speed": ("none", "slow", "fast", "speed_up", "slow_down", "stop_go"),
    "objects": ("objects_0", "objects_1", "objects_2", "objects_3"),
    "occluder": ("no_occluder", "occluder"),
    "cut": ("no_cut", "cut"),
    "scene": ("photo", "texture", "microscopy", "graphic"),
}
# Scene category of each bundled photograph (the scene token: names of held-out photographs are unseen).
SCENES: dict[str, str] = {
    "astronaut": "photo", "chelsea": "photo", "camera": "photo", "moon": "photo", "clock": "photo",
    "coffee": "photo", "rocket": "photo", "coins": "photo",
    "gravel": "texture", "brick": "texture", "grass": "texture",
    "immunohistochemistry": "microscopy", "retina": "microscopy", "cell": "microscopy",
    "hubble_deep_field": "microscopy",
    "colorwheel": "graphic", "page": "graphic", "text": "graphic", "logo": "graphic",
}
MIN_FRAMES = 4


@dataclass(frozen=True)
class SceneClip:
    """uint8 frames [T, H, W, 3], the labels (field -> value, see LABELS), the camera path [T, 4] =
    (centre x, centre y, source pixels per frame pixel, angle in degrees) of the shot at each frame, and
    the frame index of the cut (T when there is none)."""

    frames: np.ndarray
    labels: dict[str, str]
    camera: np.ndarray
    cut_at: int
    source: str


def _view(pil: Image.Image, cx: float, cy: float, scale: float, angle: float) -> np.ndarray:
    """FRAME x FRAME view of `pil` centred at (cx, cy), `scale` source pixels per frame pixel, rotated by
    `angle` degrees (bilinear). At angle 0 it samples exactly the pixels `data._view` does."""
    t = np.deg2rad(angle)
    a, b, d, e = scale * np.cos(t), -scale * np.sin(t), scale * np.sin(t), scale * np.cos(t)
    h = FRAME / 2
    c, f = cx - a * h - b * h, cy - d * h - e * h
    out = pil.transform((FRAME, FRAME), Image.AFFINE, (a, b, c, d, e, f), resample=Image.BILINEAR)
    return np.asarray(out, dtype=np.uint8)


def _profile(speed: str, frames: int, rng: np.random.Generator) -> np.ndarray:
    """Per-step speed multipliers (frames - 1 of them) of a speed label, mean about 1 (0 for `none`)."""
    n = frames - 1
    if speed == "none":
        return np.zeros(n)
    if speed in ("slow", "fast"):
        return np.ones(n)
    if speed == "speed_up":
        return np.linspace(0.2, 1.8, n)
    if speed == "slow_down":
        return np.linspace(1.8, 0.2, n)
    # stop_go: blocks of 2-4 steps alternately moving (x2) and still
    out, moving = np.zeros(n), bool(rng.integers(2))
    i = 0
    while i < n:
        k = int(rng.integers(2, 5))
        out[i:i + k] = 2.0 if moving else 0.0
        moving, i = not moving, i + k
    return out


def _camera_path(img: np.ndarray, camera: str, speed: str, frames: int,
                 rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(image, path [T, 4]) for a shot; the image is upscaled when the path would leave it."""
    prof = _profile(speed, frames, rng)
    steps = np.concatenate([[0.0], np.cumsum(prof)])  # "distance travelled" in units of the base speed
    base = {"none": 0.0, "slow": rng.uniform(0.7, 1.6), "fast": rng.uniform(3.0, 5.0)}.get(
        speed, rng.uniform(1.2, 2.5))
    scale0 = rng.uniform(0.9, 1.3)
    vx = vy = 0.0
    scale = np.full(frames, scale0)
    angle = np.zeros(frames)
    if camera in _PANS:
        dx, dy = _PANS[camera]
        norm = np.hypot(dx, dy)
        vx, vy = dx / norm * base, dy / norm * base
    elif camera in ("zoom_in", "zoom_out"):
        # scale factor 1 + 0.02 base per unit step, held once it reaches 0.6 or 2.6 px/px (long clips)
        log_s = np.log(1.0 + 0.02 * base) * steps
        if camera == "zoom_in":
            scale = np.exp(np.maximum(np.log(1.8 * scale0) - log_s, np.log(0.6)))
        else:
            scale = np.exp(np.minimum(np.log(scale0) + log_s, np.log(2.6)))
    elif camera in ("rotate_cw", "rotate_ccw"):
        angle = (1 if camera == "rotate_ccw" else -1) * 3.0 * base * steps
    xs, ys = vx * steps, vy * steps
    margin = float(scale.max()) * FRAME * 0.75 + 1  # covers the corners of a view rotated by any angle
    span_x, span_y = xs.max() - xs.min(), ys.max() - ys.min()
    img = _fit(img, span_x + 2 * margin + 1, span_y + 2 * margin + 1)
    h, w = img.shape[:2]
    x0 = rng.uniform(margin - xs.min(), w - margin - xs.max())
    y0 = rng.uniform(margin - ys.min(), h - margin - ys.max())
    return img, np.stack([x0 + xs, y0 + ys, scale, angle], axis=1)


def _sprites(n: int, split: str, sources: tuple[str, ...], rng: np.random.Generator) -> list[np.ndarray]:
    """n RGBA float sprites: coloured handwritten digits or discs/squares cut from a photograph."""
    out = []
    for _ in range(n):
        size = int(rng.integers(8, 15))
        if rng.random() < 0.5:
            imgs, _ = _digits(split)
            g = imgs[int(rng.integers(len(imgs)))]
            a = np.asarray(Image.fromarray((g * 255).astype(np.uint8)).resize((size, size), Image.BILINEAR),
                           dtype=np.float32) / 255.0
            rgb = np.broadcast_to(rng.uniform(0.5, 1.0, size=3), (size, size, 3))
        else:
            img = _tint(source_image(sources[int(rng.integers(len(sources)))], 96), rng)
            y, x = (int(rng.integers(0, s - size)) for s in img.shape[:2])
            rgb = img[y:y + size, x:x + size]
            yy, xx = np.mgrid[:size, :size] - (size - 1) / 2
            a = ((yy**2 + xx**2) <= (size / 2) ** 2).astype(np.float32) if rng.random() < 0.5 else \
                np.ones((size, size), np.float32)
        out.append(np.concatenate([rgb, a[..., None]], axis=2).astype(np.float32))
    return out


def _rotate(sprite: np.ndarray, angle: float) -> np.ndarray:
    """RGBA sprite rotated about its centre, on a canvas big enough for every angle (premultiplied)."""
    s = sprite.shape[0]
    big = int(np.ceil(s * 1.42)) | 1
    pad = (big - s) // 2
    canvas = np.zeros((big, big, 4), np.float32)
    canvas[pad:pad + s, pad:pad + s] = sprite
    canvas[..., :3] *= canvas[..., 3:]
    chans = [np.asarray(Image.fromarray(canvas[..., k]).rotate(angle, resample=Image.BILINEAR))
             for k in range(4)]
    return np.stack(chans, axis=2)


def _paste(frame: np.ndarray, sprite: np.ndarray, x: float, y: float) -> None:
    """Composite a premultiplied RGBA sprite with its centre at (x, y), clipped to the frame, in place."""
    s = sprite.shape[0]
    x0, y0 = int(round(x)) - s // 2, int(round(y)) - s // 2
    fx0, fy0, fx1, fy1 = max(x0, 0), max(y0, 0), min(x0 + s, FRAME), min(y0 + s, FRAME)
    if fx0 >= fx1 or fy0 >= fy1:
        return
    p = sprite[fy0 - y0:fy1 - y0, fx0 - x0:fx1 - x0]
    region = frame[fy0:fy1, fx0:fx1]
    frame[fy0:fy1, fx0:fx1] = region * (1 - p[..., 3:]) + p[..., :3]


def _shot(img: np.ndarray, labels: dict[str, str], frames: int, split: str, sources: tuple[str, ...],
          rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """One uninterrupted shot: camera over `img`, objects (moving, bouncing, rotating, speed changes, drawn
    in z order so they occlude each other) and optionally a bar sweeping across in front of everything."""
    img, path = _camera_path(img, labels["camera"], labels["speed"], frames, rng)
    n = LABELS["objects"].index(labels["objects"])
    sprites = _sprites(n, split, sources, rng)
    pos = [rng.uniform(4, FRAME - 4, size=2) for _ in range(n)]
    vel = [rng.uniform(-2.5, 2.5, size=2) for _ in range(n)]
    spin = [float(rng.choice([0.0, rng.uniform(-20, 20)])) for _ in range(n)]
    change = [int(rng.integers(1, frames)) for _ in range(n)]  # the frame an object changes speed
    factor = [float(rng.choice([0.0, 0.5, 2.0])) for _ in range(n)]
    bar = None
    if labels["occluder"] == "occluder":
        width, vertical = int(rng.integers(5, 10)), bool(rng.integers(2))
        colour = rng.uniform(0.0, 1.0, size=3)
        start, v = (-width, rng.uniform(1.5, 3.5)) if rng.random() < 0.5 else (FRAME, -rng.uniform(1.5, 3.5))
        bar = (width, vertical, colour, start, v)
    pil, out = Image.fromarray((img * 255).astype(np.uint8)), []
    for t in range(frames):
        f = _view(pil, *path[t]).astype(np.float32) / 255.0
        for i in range(n):
            _paste(f, _rotate(sprites[i], spin[i] * t), *pos[i])
            if t + 1 == change[i]:
                vel[i] = vel[i] * factor[i]
            pos[i] = pos[i] + vel[i]
            for k in range(2):  # bounce off the borders
                if not 2 <= pos[i][k] <= FRAME - 2:
                    vel[i][k] = -vel[i][k]
                    pos[i][k] = float(np.clip(pos[i][k], 2, FRAME - 2))
        if bar is not None:
            width, vertical, colour, start, v = bar
            a = int(round(start + v * t))
            lo, hi = max(a, 0), min(a + width, FRAME)
            if lo < hi:
                if vertical:
                    f[:, lo:hi] = colour
                else:
                    f[lo:hi, :] = colour
        out.append((np.clip(f, 0, 1) * 255 + 0.5).astype(np.uint8))
    return np.stack(out), path


def _pick_source(sources: tuple[str, ...], scene: str | None, rng: np.random.Generator) -> str:
    pool = [s for s in sources if scene is None or SCENES[s] == scene] or list(sources)
    return pool[int(rng.integers(len(pool)))]


def make_scene_clip(split: str, index: int, frames: int = 16, seed: int = 0,
                    labels: dict[str, str] | None = None) -> SceneClip:
    """Clip `index` of `split` ('train' or 'eval'): the same arguments always give the same pixels.
    `labels` fixes some fields (e.g. {"camera": "pan_right", "objects": "objects_0"}); the rest are drawn."""
    if split not in ("train", "eval"):
        raise FastCarError(f"split must be 'train' or 'eval', got {split!r}")
    if frames < MIN_FRAMES:
        raise FastCarError(f"a scene clip needs at least {MIN_FRAMES} frames, got {frames}")
    for k, v in (labels or {}).items():
        if k not in LABELS or v not in LABELS[k]:
            raise FastCarError(f"unknown label {k}={v!r}; fields and values: {LABELS}")
    rng = np.random.default_rng([seed, 2 if split == "train" else 3, index])
    sources = TRAIN_SOURCES if split == "train" else EVAL_SOURCES
    lab = {k: str(rng.choice(v)) for k, v in LABELS.items()}
    lab["cut"] = "cut" if rng.random() < 0.15 else "no_cut"
    lab["occluder"] = "occluder" if rng.random() < 0.25 else "no_occluder"
    lab.update(labels or {})
    if lab["camera"] == "static":
        lab["speed"] = "none"
    elif lab["speed"] == "none":
        lab["speed"] = "slow"
    name = _pick_source(sources, None if split == "eval" else lab["scene"], rng)
    lab["scene"] = SCENES[name]
    img = _tint(source_image(name, int(rng.choice([96, 128, 160]))), rng)
    shot, path = _shot(img, lab, frames, split, sources, rng)
    cut_at, source = frames, name
    if lab["cut"] == "cut":
        cut_at = int(rng.integers(MIN_FRAMES // 2, frames - 1))
        other = _pick_source(tuple(s for s in sources if s != name), lab["scene"], rng)
        img2 = _tint(source_image(other, int(rng.choice([96, 128, 160]))), rng)
        shot2, path2 = _shot(img2, lab, frames - cut_at, split, sources, rng)
        shot, path = np.concatenate([shot[:cut_at], shot2]), np.concatenate([path[:cut_at], path2])
        source = f"{name}+{other}"
    return SceneClip(shot, lab, path, cut_at, source)


def make_scene_clips(split: str, count: int, frames: int = 16, seed: int = 0, start: int = 0) -> list[SceneClip]:
    """`count` clips of `split`, from index `start` (deterministic)."""
    return [make_scene_clip(split, start + i, frames, seed) for i in range(count)]
