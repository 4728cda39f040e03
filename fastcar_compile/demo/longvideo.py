"""The long-video demo model (`fastcar-compile demo --long`): its ONNX, per-layer replay and per-frame quality.

The 4-layer model ships as fp16 safetensors only (the 20 MiB asset budget holds the 1-layer model's ONNX
already); its decoder.onnx is exported once into the user cache, keyed by the weights' hash, so a changed
model never reuses a stale export.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from fastcar_compile.core.errors import FastCarError
from fastcar_compile.demo.evaluate import ClipResult
from fastcar_compile.demo.export import LONG_CONFIG, LONG_WEIGHTS, export_onnx, load_model
from fastcar_compile.demo.metrics import psnr
from fastcar_compile.demo.tokenizer import PATCH, PatchTokenizer

LONG_FRAMES = 64
LONG_CLIPS = 4
# post-RoPE TAS threshold giving ~80% replay on the long model's dense generations (docs/demo.md: how it was
# calibrated; re-run `python benchmarks/experiments/long_video.py --calibrate` after retraining)
DEFAULT_LONG_TAU = -2.75


def cache_dir() -> Path:
    from fastcar_compile.runtime.native.build import CACHE_ROOT

    return CACHE_ROOT / "demo-long"


def long_onnx(weights: Path = LONG_WEIGHTS, config: Path = LONG_CONFIG, progress: bool = True,
              name: str = "the long-video model") -> Path:
    """A model's decoder.onnx in the user cache, exported from its fp16 weights on first use (default: the
    long model's shipped weights)."""
    if not Path(weights).exists() or not Path(config).exists():
        raise FastCarError(f"weights of {name} not found at {weights}; run scripts/train_demo.py --long")
    h = hashlib.sha256(Path(weights).read_bytes() + Path(config).read_bytes()).hexdigest()[:16]
    path = cache_dir() / f"decoder-{h}.onnx"
    if not path.exists():
        import torch

        if progress:
            print(f"exporting {name} once to {path} (~1 min) ...", flush=True)
        torch.set_num_threads(1)
        export_onnx(load_model(weights, config), path)
    return path


def layer_replay(results: list[ClipResult], L: int) -> np.ndarray:
    """[layers, frames, L] replay share per layer, frame and token position, averaged over clips."""
    maps = []
    for r in results:
        rep = r.fast.replay  # [steps, layers]; step k fed generated token k (frame 1 starts at token 0)
        T = r.fast.tokens.shape[0]
        m = np.zeros((rep.shape[1], T * L), np.float32)
        m[:, L:L + rep.shape[0]] = rep.T
        maps.append(m.reshape(rep.shape[1], T, L))
    return np.mean(maps, axis=0)


def psnr_per_frame(results: list[ClipResult], tok: PatchTokenizer) -> dict[str, np.ndarray]:
    """Mean PSNR vs truth per generated frame (1..T-1): dense, FastCar and holding the given frame."""
    out: dict[str, list[np.ndarray]] = {"dense": [], "FastCar": [], "hold frame 0": []}
    for r in results:
        gt = r.gt[1:]
        d, f = tok.decode(r.dense.tokens)[1:], tok.decode(r.fast.tokens)[1:]
        hold = np.repeat(tok.decode(r.dense.tokens[:1]), len(gt), axis=0)
        for name, v in (("dense", d), ("FastCar", f), ("hold frame 0", hold)):
            out[name].append(np.array([min(psnr(gt[t], v[t]), 100.0) for t in range(len(gt))]))
    return {k: np.mean(v, axis=0) for k, v in out.items()}


def write_layer_plots(results: list[ClipResult], tok: PatchTokenizer, path: Path, title: str = "") -> Path:
    """PNG: top, replay share per layer along the video (frames); bottom, per layer, where in the frame
    (token position on the 8x8 grid) replay happens, over frames 1.."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fastcar_compile.core.atomic import save_figure

    L, g = tok.tokens_per_frame, tok.frame // PATCH
    m = layer_replay(results, L)  # [layers, T, L]
    n, T = m.shape[0], m.shape[1]
    fig = plt.figure(figsize=(max(8.0, 2.0 * n), 6.2))
    gs = fig.add_gridspec(2, n, height_ratios=[1.2, 1])
    ax = fig.add_subplot(gs[0, :])
    for i in range(n):
        ax.plot(np.arange(1, T), 100 * m[i, 1:].mean(axis=1), label=f"layer {i} ({100 * m[i, 1:].mean():.0f}%)")
    ax.set_xlabel("frame (frame 0 given)")
    ax.set_ylabel("MLPs replayed (%)")
    ax.set_ylim(0, 102)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=min(n, 4))
    ax.set_title(title or "FastCar replay per layer", fontsize=9)
    for i in range(n):
        a = fig.add_subplot(gs[1, i])
        im = a.imshow(m[i, 1:].mean(axis=0).reshape(g, g), vmin=0, vmax=1, cmap="magma")
        a.set_title(f"layer {i}: per position", fontsize=8)
        a.set_xticks([])
        a.set_yticks([])
    fig.colorbar(im, ax=fig.axes[1:], shrink=0.8, label="replayed")
    return save_figure(fig, path, dpi=110)


def write_psnr_plot(curves: dict[str, np.ndarray], path: Path, title: str = "") -> Path:
    """PNG: PSNR vs truth per generated frame (does quality hold along the video?)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fastcar_compile.core.atomic import save_figure

    fig, ax = plt.subplots(figsize=(7, 3.6))
    for name, y in curves.items():
        ax.plot(np.arange(1, len(y) + 1), y, label=f"{name} (mean {y.mean():.2f} dB)",
                ls="--" if name.startswith("hold") else "-")
    ax.set_xlabel("generated frame")
    ax.set_ylabel("PSNR vs truth (dB)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title or "quality along the video", fontsize=9)
    fig.tight_layout()
    return save_figure(fig, path, dpi=110)
