"""Pictures of a run, as PNG next to run.json: replay heatmap (layer x frame), per-frame latency (with the input
model's and the compiled model's tau=+inf bars beside it when given), KV cache diagnostics (--kv-diagnostics
runs), and a per-token replay heatmap when the frame is a grid.

All pictures are drawn first and then written together through a staged folder (fileio.staged_dir), so a
failure leaves none of them (nor a folder made for them) behind.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np

from fastcar_compile.core.errors import FastCarError
from fastcar_compile.core.fileio import staged_dir
from fastcar_compile.core.options import ascii_int
from fastcar_compile.runtime.stats import RunStats

PICTURES = ("replay", "latency", "kv", "tokens")  # <stem>.<kind>.png
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


def parse_frame_shape(text: str | None, frame_tokens: int | None) -> tuple[int, int] | None:
    """'16x16' -> (16, 16), checked against the frame size L (None: the shape gives L)."""
    if not text:
        return None
    try:
        h, w = (ascii_int(x) for x in text.lower().split("x"))
    except ValueError:
        raise FastCarError(f"--frame-shape {text!r}: give HxW, e.g. 16x16") from None
    if h < 1 or w < 1:
        raise FastCarError(f"--frame-shape {text}: height and width must be >= 1, e.g. 16x16")
    if frame_tokens is not None and h * w != frame_tokens:
        raise FastCarError(f"--frame-shape {text}: {h}x{w} = {h * w} tokens, but the run has {frame_tokens} "
                           "tokens per frame")
    return h, w


def speedups(dense: RunStats | None, compiled_inf: RunStats | None, fast: RunStats) -> dict[str, float | None]:
    """The speed-up as its factors (decode ms per token ratios, runs of the same prompts): `speedup_graph` = the
    input model over the compiled model at tau=+inf (graph and attention fusions, net of the gate), `speedup_replay`
    = the compiled model at tau=+inf over FastCar at its tau (what replay alone gains), `speedup` = the input model
    over FastCar (their product). A factor whose run is missing is None."""
    def ratio(a: RunStats | None, b: RunStats | None) -> float | None:
        return a.ms_per_token / b.ms_per_token if a is not None and b is not None and b.ms_per_token else None

    return {"speedup_graph": ratio(dense, compiled_inf), "speedup_replay": ratio(compiled_inf, fast),
            "speedup": ratio(dense, fast)}


def speedup_text(gains: dict[str, float | None]) -> str:
    """'graph/attention 1.40x x replay 1.10x = 1.54x', with the factors that were measured."""
    g, r, t = gains["speedup_graph"], gains["speedup_replay"], gains["speedup"]
    parts = [f"graph/attention {g:.2f}x (compiled at tau=+inf vs the input model)" if g is not None else None,
             f"replay {r:.2f}x (FastCar vs the same compiled model at tau=+inf)" if r is not None else None]
    text = " x ".join(p for p in parts if p)
    return f"{text} = {t:.2f}x in all" if t is not None and g is not None and r is not None else \
        text or (f"{t:.2f}x vs the input model" if t is not None else "not measured")


def spread_text(gains: list[dict[str, float | None]]) -> str:
    """'graph/attention 1.09x (1.02-1.15) x replay 1.66x (...) = 1.81x (...), median (lowest-highest) of N
    interleaved rounds', with the factors that were measured."""
    import numpy as np

    def one(key: str) -> str | None:
        v = [g[key] for g in gains if g[key] is not None]
        return f"{np.median(v):.2f}x ({min(v):.2f}-{max(v):.2f})" if v else None

    g, r, t = one("speedup_graph"), one("speedup_replay"), one("speedup")
    parts = [f"graph/attention {g} (compiled at tau=+inf vs the input model)" if g else None,
             f"replay {r} (FastCar vs the same compiled model at tau=+inf)" if r else None]
    text = " x ".join(p for p in parts if p) + (f" = {t} in all" if t and g and r else "")
    return f"{text or t}; median (lowest-highest) of {len(gains)} interleaved rounds"


def comparison(fast: RunStats, dense: RunStats | None, compiled_inf: RunStats | None = None,
               rounds: list[dict[str, float | None]] | None = None) -> str:
    """Lines comparing a FastCar run with the input model's run and/or the compiled model's tau=+inf run of the
    same prompts: ms per token of each and the speed-up as its factors (`rounds`: each round's factors, printed
    as their median and range)."""
    times = [f"{name} {r.ms_per_token:.3f}" for name, r in (("input model", dense), ("compiled at tau=+inf",
                                                                                    compiled_inf), ("FastCar", fast))
             if r is not None]
    videos = " + ".join(str(r.videos) for r in (dense, compiled_inf, fast) if r is not None)
    return (f"decode ms/token: {', '.join(times)} (runtime step incl. Python; {videos} videos, same prompts)\n"
            f"speed-up: {spread_text(rounds) if rounds and len(rounds) > 1 else speedup_text(speedups(dense, compiled_inf, fast))}\n"
            f"replay {100 * fast.replay_ratio:.1f}% of all decode steps (frame 0 included), "
            f"{100 * fast.replay_ratio_eligible:.1f}% of eligible steps (frame 0 excluded)")


def kv_table(stats: RunStats) -> list[dict]:
    """Per compressed layer of a --kv-diagnostics run: {layer, density, recall, kv_share, kv_bytes, dense_kv_bytes}
    over all videos, and `videos`: the same numbers per video (missing numbers are None)."""
    diag = stats.kv_diagnostics if isinstance(stats.kv_diagnostics, dict) else {}
    per_video = [v for v in (stats.kv_diagnostics_per_video or []) if isinstance(v, dict)]

    def numbers(acc: dict) -> dict:
        out = {k: float(acc[k]) if isinstance(acc.get(k), int | float) else None
               for k in ("density", "recall", "kv_bytes", "dense_kv_bytes")}
        out["kv_share"] = out["kv_bytes"] / out["dense_kv_bytes"] if out["kv_bytes"] is not None and \
            out["dense_kv_bytes"] else None
        return out

    rows = []
    for layer in sorted((k for k, v in diag.items() if isinstance(v, dict)), key=lambda k: (len(k), k)):
        rows.append({"layer": layer, **numbers(diag[layer]),
                     "videos": [numbers(v[layer]) for v in per_video if isinstance(v.get(layer), dict)]})
    return rows


def kv_summary(stats: RunStats) -> str | None:
    """Lines of a --kv-diagnostics run: per compressed layer density, recall and resident KV over all videos,
    with the range over the videos beside each; None for a run without them."""
    rows = kv_table(stats)
    if not rows:
        return None
    n = max(len(r["videos"]) for r in rows)
    lines = [f"KV cache against dense attention on the side, over {n or stats.videos} video(s) "
             f"(pooled; per-video range in brackets):"]
    for r in rows:
        def part(key: str, label: str, r=r) -> str:
            if r[key] is None:
                return f"{label} -"
            vals = [v[key] for v in r["videos"] if v[key] is not None]
            spread = f" [{100 * min(vals):.1f}-{100 * max(vals):.1f}]" if len(vals) > 1 else ""
            return f"{label} {100 * r[key]:.1f}%{spread}"
        kv = "" if r["kv_bytes"] is None or r["dense_kv_bytes"] is None else \
            f" ({r['kv_bytes'] / 1024:.1f} of {r['dense_kv_bytes'] / 1024:.1f} KiB per video)"
        lines.append(f"  layer {r['layer']}: {part('density', 'density')}, {part('recall', 'recall')}, "
                     f"{part('kv_share', 'resident KV')}{kv}")
    return "\n".join(lines)


def _kv(plt, stats: RunStats) -> bytes:
    """Density, recall and resident KV share per compressed layer: bars over all videos, a dot per video."""
    rows = kv_table(stats)
    fig, axes = plt.subplots(1, 3, figsize=(10, 3.2))
    x = np.arange(len(rows))
    n = max(len(r["videos"]) for r in rows)
    for ax, (key, title) in zip(axes, (("density", "density (executed / dense q.k pairs)"),
                                       ("recall", "recall (dense softmax mass kept)"),
                                       ("kv_share", "resident KV / dense KV, end of video")), strict=True):
        ax.bar(x, [100 * (r[key] or 0.0) for r in rows], color="tab:blue", width=0.6,
               label=f"all {n} videos" if n else "run")
        for i, r in enumerate(rows):
            vals = [100 * v[key] for v in r["videos"] if v[key] is not None]
            if len(vals) > 1:
                ax.plot(i + np.linspace(-0.2, 0.2, len(vals)), vals, "k.", ms=3,
                        label="each video" if i == 0 else None)
        ax.set_xticks(x, [f"L{r['layer']}" for r in rows])
        ax.set_ylim(0, 105)
        ax.set_ylabel("%")
        ax.set_title(title, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"KV cache diagnostics per compressed layer, {Path(stats.model).name}", fontsize=10)
    fig.tight_layout()
    return _png(fig)


def render_report(stats: RunStats, stem: str = "run", dense: RunStats | None = None,
                  frame_shape: tuple[int, int] | None = None, compiled_inf: RunStats | None = None) -> dict[str, bytes]:
    """{file name: PNG bytes}: <stem>.replay.png (FastCar runs), <stem>.latency.png (the input model's and the
    compiled model's tau=+inf bars beside FastCar's when given), <stem>.kv.png (--kv-diagnostics runs) and,
    with `frame_shape`, <stem>.tokens.png."""
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
        ax.set_xlabel(stats.frame_axis_label(), fontsize=8)
        ax.set_ylabel("layer")
        ax.set_title(f"MLP replay % (overall {100 * stats.replay_ratio:.1f}%, tau={stats.tau_text})")
        fig.colorbar(im, ax=ax, label="replay %")
        pictures[picture_name(stem, "replay")] = _png(fig)
    pictures[picture_name(stem, "latency")] = _latency(plt, stats, dense, compiled_inf)
    if kv_table(stats):
        pictures[picture_name(stem, "kv")] = _kv(plt, stats)
    if frame_shape is not None and stats.layers:
        cells = max(stats.frames_done, 1) * stats.frame_tokens
        if cells > MAX_TOKEN_CELLS:  # [frames, L] float64 twice: 2^31 tokens per frame would need 32 GiB
            raise FastCarError(f"--frame-shape: {max(stats.frames_done, 1)} frames x {stats.frame_tokens} tokens "
                               f"are too many to draw per token (at most {MAX_TOKEN_CELLS}); drop --frame-shape")
        pictures[picture_name(stem, "tokens")] = _tokens(plt, stats, frame_shape)
    return pictures


def write_report(stats: RunStats, out_dir: str | os.PathLike, stem: str = "run", dense: RunStats | None = None,
                 frame_shape: tuple[int, int] | None = None, compiled_inf: RunStats | None = None) -> list[Path]:
    """Write the pictures of `render_report`, all or none; return the paths."""
    pictures = render_report(stats, stem, dense, frame_shape, compiled_inf)
    out = Path(out_dir)
    with staged_dir(out) as tmp:
        for name, data in pictures.items():
            (tmp / name).write_bytes(data)
    return [out / name for name in pictures]


def _latency(plt, stats: RunStats, dense: RunStats | None, compiled_inf: RunStats | None = None) -> bytes:
    fig, ax = plt.subplots(figsize=(7, 3.4))
    per_tok = np.asarray(stats.ms_per_token_by_frame())
    x = np.arange(len(per_tok))
    others = [(r, name, color) for r, name, color in ((dense, "input model", "tab:gray"),
                                                      (compiled_inf, "compiled, tau=+inf", "tab:orange"))
              if r is not None and r.step_ms]
    if others:
        width = 0.8 / (len(others) + 1)
        for i, (r, name, color) in enumerate(others):
            r.finalize()
            d = np.asarray(r.ms_per_token_by_frame()[: len(x)])
            ax.bar(x[: len(d)] + (i - len(others) / 2) * width, d, width=width, color=color,
                   label=f"{name} ({r.ms_per_token:.2f} ms/token)")
        ax.bar(x + len(others) / 2 * width, per_tok, width=width, color="tab:blue",
               label=f"FastCar ({stats.ms_per_token:.2f} ms/token, {100 * stats.replay_ratio:.0f}% replay)")
        ax.legend(fontsize=7)
        g = speedups(dense, compiled_inf, stats)
        factors = [f"graph/attention {g['speedup_graph']:.2f}x" if g["speedup_graph"] else None,
                   f"replay {g['speedup_replay']:.2f}x" if g["speedup_replay"] else None]
        title = "decode time per token and frame: " + " x ".join(f for f in factors if f)
        if g["speedup"] and g["speedup_graph"] and g["speedup_replay"]:
            title += f" = {g['speedup']:.2f}x"
        elif g["speedup"]:
            title += f"{g['speedup']:.2f}x vs the input model"
    else:
        ax.bar(x, per_tok, color="tab:blue")
        title = f"per-frame latency ({stats.ms_per_token:.2f} ms/token, prefill {stats.prefill_ms:.0f} ms)"
    ax.set_xticks(x)
    ax.set_xlabel("generated frame" + (f" (after {stats.given_video_tokens} given video tokens)"
                                       if stats.given_video_tokens else ""))
    ax.set_ylabel("decode ms per token (group medians)")
    ax.set_title(title, fontsize=9)
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
    given = f"; frames counted after {stats.given_video_tokens} given video tokens" if stats.given_video_tokens else ""
    fig.suptitle(f"MLP replay per token position ({shape[0]}x{shape[1]}), tau={stats.tau_text}{given}", fontsize=9)
    return _png(fig)
