"""Pictures of a run, as PNG next to run.json: replay heatmap (layer x frame), per-frame latency (with the
dense run's bars beside it when one is given), and a per-token replay heatmap when the frame is a grid.

All pictures are drawn first and then written together through a staged folder (fileio.staged_dir), so a
failure leaves none of them (nor a folder made for them) behind.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np

from fastcar_compile.errors import FastCarError
from fastcar_compile.fileio import staged_dir
from fastcar_compile.runtime.stats import RunStats

PICTURES = ("replay", "latency", "tokens")  # <stem>.<kind>.png
MAX_TOKEN_CELLS = 1 << 24  # frames x tokens per frame of the per-token picture (256 MiB of float64 counters)


def picture_name(stem: str, kind: str) -> str:
    return f"{stem}.{kind}.png"


def _png(fig) -> bytes:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    try:
        fig.savefig(buf, format="png", dpi=120, bbox_inches="tight")
    finally:
        plt.close(fig)
    return buf.getvalue()


def parse_frame_shape(text: str | None, frame_tokens: int) -> tuple[int, int] | None:
    """'16x16' -> (16, 16), checked against the frame size L."""
    if not text:
        return None
    try:
        h, w = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise FastCarError(f"--frame-shape {text!r}: give HxW, e.g. 16x16") from None
    if h < 1 or w < 1:
        raise FastCarError(f"--frame-shape {text}: height and width must be >= 1, e.g. 16x16")
    if h * w != frame_tokens:
        raise FastCarError(f"--frame-shape {text}: {h}x{w} = {h * w} tokens, but the run has {frame_tokens} "
                           "tokens per frame")
    return h, w


def comparison(fast: RunStats, dense: RunStats) -> str:
    """Lines comparing a FastCar run with a dense run of the same prompts."""
    sp = dense.ms_per_token / fast.ms_per_token if fast.ms_per_token else float("nan")
    return (f"decode ms/token: dense {dense.ms_per_token:.3f}, FastCar {fast.ms_per_token:.3f} -> speed-up "
            f"{sp:.2f}x (runtime step incl. Python; {dense.videos} + {fast.videos} videos)\n"
            f"replay {100 * fast.replay_ratio:.1f}% of all decode steps (frame 0 included), "
            f"{100 * fast.replay_ratio_eligible:.1f}% of eligible steps (frame 0 excluded)")


def render_report(stats: RunStats, stem: str = "run", dense: RunStats | None = None,
                  frame_shape: tuple[int, int] | None = None) -> dict[str, bytes]:
    """{file name: PNG bytes}: <stem>.replay.png (FastCar runs), <stem>.latency.png (dense bars beside
    FastCar's when `dense` is given) and, with `frame_shape`, <stem>.tokens.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stats.finalize()
    pictures: dict[str, bytes] = {}
    if stats.layers and stats.replay_layer_frame:
        m = 100 * np.asarray(stats.replay_layer_frame, dtype=float)
        fig, ax = plt.subplots(figsize=(max(4.5, 1.2 + 0.35 * m.shape[1]), max(2.5, 1.0 + 0.3 * m.shape[0])))
        im = ax.imshow(m, aspect="auto", cmap="viridis", vmin=0, vmax=100, interpolation="nearest")
        ax.set_yticks(range(len(stats.layers)), [str(n) for n in stats.layers])
        ax.set_xticks(range(m.shape[1]))
        ax.set_xlabel("frame (0 never replays)")
        ax.set_ylabel("layer")
        ax.set_title(f"MLP replay % (overall {100 * stats.replay_ratio:.1f}%, tau={stats.threshold})")
        fig.colorbar(im, ax=ax, label="replay %")
        pictures[picture_name(stem, "replay")] = _png(fig)
    pictures[picture_name(stem, "latency")] = _latency(plt, stats, dense)
    if frame_shape is not None and stats.layers:
        cells = max(stats.frames_done, 1) * stats.frame_tokens
        if cells > MAX_TOKEN_CELLS:  # [frames, L] float64 twice: 2^31 tokens per frame would need 32 GiB
            raise FastCarError(f"--frame-shape: {max(stats.frames_done, 1)} frames x {stats.frame_tokens} tokens "
                               f"are too many to draw per token (at most {MAX_TOKEN_CELLS}); drop --frame-shape")
        pictures[picture_name(stem, "tokens")] = _tokens(plt, stats, frame_shape)
    return pictures


def write_report(stats: RunStats, out_dir: str | os.PathLike, stem: str = "run", dense: RunStats | None = None,
                 frame_shape: tuple[int, int] | None = None) -> list[Path]:
    """Write the pictures of `render_report`, all or none; return the paths."""
    pictures = render_report(stats, stem, dense, frame_shape)
    out = Path(out_dir)
    with staged_dir(out) as tmp:
        for name, data in pictures.items():
            (tmp / name).write_bytes(data)
    return [out / name for name in pictures]


def _latency(plt, stats: RunStats, dense: RunStats | None) -> bytes:
    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    per_tok = np.asarray(stats.ms_per_token_by_frame())
    x = np.arange(len(per_tok))
    if dense is not None and dense.step_ms:
        dense.finalize()
        d = np.asarray(dense.ms_per_token_by_frame()[: len(x)])
        ax.bar(x[: len(d)] - 0.2, d, width=0.4, color="tab:gray", label=f"dense ({dense.ms_per_token:.2f} ms/token)")
        ax.bar(x + 0.2, per_tok, width=0.4, color="tab:blue",
               label=f"FastCar ({stats.ms_per_token:.2f} ms/token, {100 * stats.replay_ratio:.0f}% replay)")
        ax.legend(fontsize=8)
        sp = dense.ms_per_token / stats.ms_per_token if stats.ms_per_token else float("nan")
        title = f"decode time per token and frame: {sp:.2f}x vs dense"
    else:
        ax.bar(x, per_tok, color="tab:blue")
        title = f"per-frame latency ({stats.ms_per_token:.2f} ms/token, prefill {stats.prefill_ms:.0f} ms)"
    ax.set_xticks(x)
    ax.set_xlabel("generated frame" + (f" (after {stats.given_video_tokens} given video tokens)"
                                       if stats.given_video_tokens else ""))
    ax.set_ylabel("decode ms per token (group medians)")
    ax.set_title(title, fontsize=10)
    return _png(fig)


def _tokens(plt, stats: RunStats, shape: tuple[int, int]) -> bytes:
    """One panel per frame: share of layers x rows that replayed each token position."""
    m = stats.per_token_replay()
    frames = m.shape[0]
    fig, axes = plt.subplots(1, frames + 1, figsize=(1.8 * frames + 1.2, 2.4),
                             gridspec_kw={"width_ratios": [1] * frames + [0.08]})
    im = None
    for f in range(frames):
        ax = axes[f]
        im = ax.imshow(m[f].reshape(shape), vmin=0, vmax=1, cmap="magma", interpolation="nearest")
        ax.set_title(f"frame {f}\n{100 * m[f].mean():.0f}%", fontsize=8)
        ax.set_xticks([])
        ax.set_yticks([])
    fig.colorbar(im, cax=axes[-1], label="replayed share")
    tau = stats.threshold if isinstance(stats.threshold, list) else f"{stats.threshold:.4g}"
    given = f"; frames counted after {stats.given_video_tokens} given video tokens" if stats.given_video_tokens else ""
    fig.suptitle(f"MLP replay per token position ({shape[0]}x{shape[1]}), tau={tau}{given}", fontsize=9)
    return _png(fig)
