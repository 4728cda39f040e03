"""Pictures of a run: replay heatmap (layer x frame) and per-frame latency, as PNG next to run.json."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from fastcar_compile.atomic import save_figure
from fastcar_compile.runtime.stats import RunStats


def _save(fig, path: Path) -> None:
    save_figure(fig, path, dpi=120, bbox_inches="tight")


def write_report(stats: RunStats, out_dir: str | os.PathLike, stem: str = "run") -> list[Path]:
    """Write <stem>.replay.png (FastCar runs) and <stem>.latency.png; return the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stats.finalize()
    written: list[Path] = []
    if stats.layers and stats.replay_layer_frame:
        m = 100 * np.asarray(stats.replay_layer_frame, dtype=float)
        fig, ax = plt.subplots(figsize=(max(4.5, 1.2 + 0.35 * m.shape[1]), max(2.5, 1.0 + 0.3 * m.shape[0])))
        im = ax.imshow(m, aspect="auto", cmap="viridis", vmin=0, vmax=100, interpolation="nearest")
        ax.set_yticks(range(len(stats.layers)), [str(n) for n in stats.layers])
        ax.set_xticks(range(m.shape[1]))
        ax.set_xlabel("frame")
        ax.set_ylabel("layer")
        ax.set_title(f"MLP replay % (overall {100 * stats.replay_ratio:.1f}%, tau={stats.threshold})")
        fig.colorbar(im, ax=ax, label="replay %")
        p = out / f"{stem}.replay.png"
        _save(fig, p)
        plt.close(fig)
        written.append(p)
    fig, ax = plt.subplots(figsize=(6, 3))
    if stats.frame_ms:
        ax.bar(range(len(stats.frame_ms)), stats.frame_ms, color="tab:blue")
    ax.set_xlabel("frame")
    ax.set_ylabel("decode ms")
    ax.set_title(f"per-frame latency ({stats.ms_per_step:.2f} ms/step, prefill {stats.prefill_ms:.0f} ms)")
    p = out / f"{stem}.latency.png"
    _save(fig, p)
    plt.close(fig)
    written.append(p)
    return written
