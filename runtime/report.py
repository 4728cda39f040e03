"""Pictures of a run: replay heatmap (layer x frame) and per-frame latency, as PNG next to run.json.

Both pictures are drawn first and then written together through a staged folder (fileio.staged_dir), so a
failure leaves neither picture (nor a folder made for them) behind.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np

from fastcar_compile.fileio import staged_dir
from fastcar_compile.runtime.stats import RunStats


def _png(fig) -> bytes:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    try:
        fig.savefig(buf, format="png", dpi=120, bbox_inches="tight")
    finally:
        plt.close(fig)
    return buf.getvalue()


def render_report(stats: RunStats, stem: str = "run") -> dict[str, bytes]:
    """{file name: PNG bytes}: <stem>.replay.png (FastCar runs) and <stem>.latency.png."""
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
        ax.set_xlabel("frame")
        ax.set_ylabel("layer")
        ax.set_title(f"MLP replay % (overall {100 * stats.replay_ratio:.1f}%, tau={stats.threshold})")
        fig.colorbar(im, ax=ax, label="replay %")
        pictures[f"{stem}.replay.png"] = _png(fig)
    fig, ax = plt.subplots(figsize=(6, 3))
    if stats.frame_ms:
        ax.bar(range(len(stats.frame_ms)), stats.frame_ms, color="tab:blue")
    ax.set_xlabel("frame")
    ax.set_ylabel("decode ms")
    ax.set_title(f"per-frame latency ({stats.ms_per_step:.2f} ms/step, prefill {stats.prefill_ms:.0f} ms)")
    pictures[f"{stem}.latency.png"] = _png(fig)
    return pictures


def write_report(stats: RunStats, out_dir: str | os.PathLike, stem: str = "run") -> list[Path]:
    """Write <stem>.replay.png (FastCar runs) and <stem>.latency.png, both or none; return the paths."""
    pictures = render_report(stats, stem)
    out = Path(out_dir)
    with staged_dir(out) as tmp:
        for name, data in pictures.items():
            (tmp / name).write_bytes(data)
    return [out / name for name in pictures]
