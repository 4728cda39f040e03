"""Pictures of a demo run: side-by-side GIF, PNG strip, replay heatmap (all written atomically)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from fastcar_compile.core.atomic import save_figure, write_bytes
from fastcar_compile.demo.evaluate import ClipResult
from fastcar_compile.demo.tokenizer import PATCH, PatchTokenizer

SCALE = 4
COLUMNS = ("ground truth", "dense", "FastCar", "replay map")  # plus each ClipResult.extra video before the map


def columns(r: ClipResult) -> tuple[str, ...]:
    """The labels of `_panels`' columns for this clip."""
    return (*COLUMNS[:3], *r.extra, COLUMNS[3])


def _replay_rgb(share: np.ndarray, frame: int) -> np.ndarray:
    """[L] share of layers that replayed -> RGB tile: dark = computed, orange = replayed."""
    g = int(round(np.sqrt(share.size)))
    s = share.reshape(g, g)
    rgb = np.stack([40 + 215 * s, 40 + 120 * s, 60 - 40 * s], -1).astype(np.uint8)
    return np.kron(rgb, np.ones((frame // g, frame // g, 1), np.uint8))


def _panels(r: ClipResult, tok: PatchTokenizer) -> np.ndarray:
    """[T, H, n W + n - 1, 3]: ground truth | dense | FastCar | each extra video | replay map (`columns`)."""
    videos = [tok.decode(v.tokens) for v in (r.dense, r.fast, *r.extra.values())]
    rm = r.fast.replay_map(tok.tokens_per_frame)
    maps = np.stack([_replay_rgb(rm[t], tok.frame) for t in range(len(rm))])
    sep = np.full((*r.gt.shape[:2], 1, 3), 255, np.uint8)
    return np.concatenate(sum(([v, sep] for v in [r.gt, *videos]), []) + [maps], axis=2)


def _upscale(img: np.ndarray, k: int = SCALE) -> np.ndarray:
    return np.kron(img, np.ones((k, k, 1), np.uint8))


def _header(width: int, names: tuple[str, ...] = COLUMNS) -> np.ndarray:
    im = Image.new("RGB", (width, 14), "white")
    dr = ImageDraw.Draw(im)
    col = width // len(names)
    for i, name in enumerate(names):
        dr.text((i * col + 4, 1), name, fill="black")
    return np.asarray(im)


def write_gif(results: list[ClipResult], tok: PatchTokenizer, path: Path, fps: float = 4.0) -> Path:
    """One GIF: clips stacked vertically, time along the animation."""
    rows = [_upscale(_panels(r, tok)) for r in results]
    T = min(p.shape[0] for p in rows)
    frames = []
    for t in range(T):
        body = np.concatenate([np.concatenate([p[t], np.full((4, p.shape[2], 3), 255, np.uint8)])
                               for p in rows])
        frames.append(Image.fromarray(np.concatenate([_header(body.shape[1], columns(results[0])), body])))
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:], duration=int(1000 / fps), loop=0)
    write_bytes(path, buf.getvalue())
    return path


STRIP_LABEL_W = 110  # px of the label column left of the strip


def write_strip(results: list[ClipResult], tok: PatchTokenizer, path: Path, every: int = 1) -> Path:
    """PNG: for each clip, one row per column of `columns` (ground truth, dense, FastCar, extras, replay) x frames (every `every`-th), each row
    labelled on the left (with the clip's motion and source), frame numbers on top (frame 0 is given)."""
    k, W = 3, tok.frame
    blocks, labels = [], []
    y = 0
    for r in results:
        names = columns(r)
        p = _panels(r, tok)[::every]  # [T, H, n W + n - 1, 3]
        cols = [p[:, :, i * (W + 1): i * (W + 1) + W] for i in range(len(names))]
        rows = [np.concatenate(list(c), axis=1) for c in cols]
        gap = np.full((2, rows[0].shape[1], 3), 255, np.uint8)
        for i, name in enumerate(names):
            sub = f"{r.motion}, {r.source}" if i == 0 else ("orange = replayed" if i == len(names) - 1 else "")
            labels.append((y + i * (W + 2), name, sub))
        blocks.append(np.concatenate(sum(([row, gap] for row in rows), []) + [gap, gap]))
        y += len(names) * (W + 2) + 4
    body = _upscale(np.concatenate(blocks), k)
    head = 16
    canvas = Image.new("RGB", (STRIP_LABEL_W + body.shape[1], head + body.shape[0]), "white")
    canvas.paste(Image.fromarray(body), (STRIP_LABEL_W, head))
    dr = ImageDraw.Draw(canvas)
    for t in range(body.shape[1] // (k * W)):
        dr.text((STRIP_LABEL_W + t * k * W + 4, 2), f"frame {t * every}" + (" (given)" if t == 0 else ""),
                fill="black")
    for top, name, sub in labels:
        dr.text((4, head + k * top + 4), name, fill="black")
        if sub:
            dr.text((4, head + k * top + 18), sub[:18], fill="dimgray")
    buf = io.BytesIO()
    canvas.save(buf, format="PNG")
    write_bytes(path, buf.getvalue())
    return path


def write_heatmap(results: list[ClipResult], tok: PatchTokenizer, path: Path, title: str = "",
                  every: int = 1) -> Path:
    """PNG: replay share per spatial token and frame (every `every`-th), averaged over clips (frame 0 is
    given context)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    L, g = tok.tokens_per_frame, tok.frame // PATCH
    maps = np.mean([r.fast.replay_map(L) for r in results], axis=0)[::every]  # [T, L]
    T = maps.shape[0]
    fig, axes = plt.subplots(1, T + 1, figsize=(1.6 * (T + 1) + 1, 2.4),
                             gridspec_kw={"width_ratios": [1] * T + [0.08]})
    for t in range(T):
        ax = axes[t]
        im = ax.imshow(maps[t].reshape(g, g), vmin=0, vmax=1, cmap="magma")
        ax.set_title(f"frame {t * every}" + (" (given)" if t == 0 else f"\n{100 * maps[t].mean():.0f}%"), fontsize=8)
        ax.set_xticks([])
        ax.set_yticks([])
    fig.colorbar(im, cax=axes[-1], label="replayed")
    fig.suptitle(title or "MLP replay per token position (share of clips and layers)", fontsize=9)
    fig.tight_layout()
    return save_figure(fig, path, dpi=110)
