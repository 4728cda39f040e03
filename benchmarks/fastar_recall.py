"""FAST-AR modes on real attention: density, recall and KV bytes per mode on the bundled demo model.

    python benchmarks/fastar_recall.py                  # 16 held-out clips x 12 frames (771 tokens), all modes
    python benchmarks/fastar_recall.py --frames 6 --quick
    python benchmarks/fastar_recall.py --long --frames 16 --quick   # the 4-layer long-video model, per layer

The demo model (1-layer LLaMA, 6 heads, 64 tokens per frame) generates `--frames` frames greedily from an
eval clip's first frame; its per-layer q/k/v are captured (fastcar_compile.demo.trace) and replayed through
the NumPy reference (fastcar_compile.fastar.attention) with dense attention on the side. Metrics are over the
decode steps of frames >= 2 (so every mode has a full frame of history to work with). Every figure is the mean
over the held-out clips (`--clips`, eval clips 0..N-1) with the half width of its 95% interval. Definitions: the module
docstring of fastcar_compile/fastar/attention.py. FAST-AR's own figures (AR video diffusion, not token AR):
TempCache ~16% KV density at ~90% recall, AnnSA ~28% density at ~92% recall.

Writes --out-dir/fastar_recall.{md,json,png}.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

from fastcar_compile.core.atomic import save_figure, write_text
from fastcar_compile.demo.trace import TRACE_SOURCES, demo_trace
from fastcar_compile.fastar.attention import run_trace, slot_bytes
from fastcar_compile.fastar.config import KVCompressConfig

PAPER = {"TempCache (paper)": (0.16, 0.90), "AnnSA (paper)": (0.28, 0.92)}  # FAST-AR's (density, recall) points


def plot_paper_points(ax) -> None:
    """The paper's points as red stars on a density / recall plot, with the axes every such plot shares."""
    for name, (d, rc) in PAPER.items():
        ax.scatter(d, rc, marker="*", s=140, color="tab:red")
        ax.annotate(name, (d, rc), fontsize=7, color="tab:red", xytext=(4, -9), textcoords="offset points")
    ax.set_xlabel("density (executed q.k pairs / dense)")
    ax.set_xlim(0, 1.05)
    ax.grid(alpha=0.3)


def modes(frame_tokens: int, video_start: int, quick: bool, kv_heads: int,
          per_head: bool = True) -> dict[str, KVCompressConfig | list]:
    lay = {"frame_tokens": frame_tokens, "video_start": video_start}
    win = frame_tokens + 16  # covers the demo's copy heads (offsets 55..71): the local window StreamingLLM keeps
    m = {
        "dense": KVCompressConfig(**lay),
        f"window S3+W{win} C{win + 3 + 32} oldest": KVCompressConfig(budget=win + 3 + 32, sinks=3, window=win,
                                                                   eviction="oldest", **lay),
        f"window S3+W{win} C{win + 3 + 32} mass": KVCompressConfig(budget=win + 3 + 32, sinks=3, window=win,
                                                                 eviction="mass", **lay),
        "tempcache 0.999": KVCompressConfig(tempcache_sim=0.999, **lay),
        "tempcache 0.99": KVCompressConfig(tempcache_sim=0.99, **lay),
        "tempcache 0.9": KVCompressConfig(tempcache_sim=0.9, **lay),
        "tempcache 0.999 +top1": KVCompressConfig(tempcache_sim=0.999, correspondence="aligned+top1", **lay),
        "annsa lsh 8x4": KVCompressConfig(lsh_bits=8, lsh_tables=4, sinks=3, window=16, **lay),
        "annsa lsh 6x4": KVCompressConfig(lsh_bits=6, lsh_tables=4, sinks=3, window=16, **lay),
    }
    if not quick:
        m.update({
            "tempcache 0.995": KVCompressConfig(tempcache_sim=0.995, **lay),
            "tempcache 0.99 +top1": KVCompressConfig(tempcache_sim=0.99, correspondence="aligned+top1", **lay),
            f"tempcache 0.999 C{2 * frame_tokens} mass": KVCompressConfig(budget=2 * frame_tokens, sinks=3, window=win,
                                                                       tempcache_sim=0.999, eviction="mass", **lay),
            f"tempcache 0.999 C{2 * frame_tokens} oldest": KVCompressConfig(budget=2 * frame_tokens, sinks=3, window=win,
                                                                         tempcache_sim=0.999, eviction="oldest",
                                                                         **lay),
            "annsa lsh 8x8": KVCompressConfig(lsh_bits=8, lsh_tables=8, sinks=3, window=16, **lay),
            "annsa lsh 10x8": KVCompressConfig(lsh_bits=10, lsh_tables=8, sinks=3, window=16, **lay),
            "annsa lsh 4x2": KVCompressConfig(lsh_bits=4, lsh_tables=2, sinks=3, window=16, **lay),
            f"annsa lsh 8x4 W{win}": KVCompressConfig(lsh_bits=8, lsh_tables=4, sinks=3, window=win, **lay),
            "tempcache 0.999 + annsa 8x4": KVCompressConfig(tempcache_sim=0.999, lsh_bits=8, lsh_tables=4, sinks=3,
                                                            window=16, **lay),
        })
    if not per_head:
        return m
    # Per-head modes: the demo's first five heads read fixed offsets (copy heads, DemoConfig.copy_offsets) and
    # lose nothing to a window; the last reads by content and keeps its recall under TempCache (see docs).
    window = KVCompressConfig(budget=win + 3 + 32, sinks=3, window=win, eviction="mass", **lay)
    for sim in (0.999, 0.9, 0.5):
        m[f"per-head: window (h0-{kv_heads - 2}) + tempcache {sim} (h{kv_heads - 1})"] = (
            [window] * (kv_heads - 1) + [KVCompressConfig(tempcache_sim=sim, **lay)])
    # the same with head 5's cache bounded too (every head flat): C = 2 frames, sinks 3, window 16
    m[f"per-head: window (h0-{kv_heads - 2}) + tempcache 0.9 C{2 * frame_tokens} (h{kv_heads - 1})"] = (
        [window] * (kv_heads - 1) + [KVCompressConfig(tempcache_sim=0.9, budget=2 * frame_tokens, sinks=3, window=16,
                                                      eviction="mass", **lay)])
    return m


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [3, 2]})
    for r in rows:
        kind = r["mode"].split()[0]
        color = {"dense": "k", "window": "tab:gray", "tempcache": "tab:blue", "annsa": "tab:orange",
                 "per-head:": "tab:purple"}.get(kind, "tab:green")
        ax.scatter(r["density"], r["recall"], color=color, s=30, marker="o" if r["source"] == "generated" else "^")
        ax.annotate(r["mode"], (r["density"], r["recall"]), fontsize=6, xytext=(3, 2), textcoords="offset points")
    plot_paper_points(ax)
    ax.set_ylabel("attention recall (dense softmax mass kept)")
    ax.set_title("FAST-AR modes on the demo model's attention (o: generated, ^: clip)", fontsize=10)
    shown = ("dense", "window", "tempcache 0.999", "annsa lsh 8x4 W", "per-head: window (h0-4) + tempcache 0.9 ")
    for r in rows:
        if r["layer"] == 0 and any(r["mode"].startswith(s) for s in shown):
            frames = np.arange(1, len(r["kv_bytes_per_frame"]) + 1)
            ax2.plot(frames, np.asarray(r["kv_bytes_per_frame"]) / 1024, "-" if r["source"] == "clip" else "--",
                     marker=".", label=f"{r['source']}: {r['mode']}")
    ax2.set_xlabel("frame")
    ax2.set_ylabel("resident KV (KiB, fp16, layer 0)")
    ax2.set_title("KV memory per frame (-: clip, --: generated)", fontsize=10)
    ax2.legend(fontsize=6)
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    save_figure(fig, path, dpi=130)


def over_clips(clips: list[dict]) -> dict:
    """One mode's figures over the clips: each number the mean, `<key>_ci` the half width of its 95% interval
    (Student t), per-head recall averaged, the first clip's KV curve and config, `clips` the count."""
    from fastcar_compile.runtime.calib_stats import ci95

    out = {"clips": len(clips), "kv_bytes_per_frame": clips[0]["kv_bytes_per_frame"], "config": clips[0]["config"]}
    for key, v in clips[0].items():
        if key in out:
            continue
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            values = np.array([c[key] for c in clips], float)
            out[key] = float(values.mean())
            out[f"{key}_ci"] = ci95(values) if len(values) > 1 else None
        elif isinstance(v, list) and v and all(isinstance(x, (int, float)) for x in v):
            out[key] = np.mean([c[key] for c in clips], axis=0).tolist()
        else:
            out[key] = v
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=12, help="frames in the trace (<= 15: 1024 positions)")
    ap.add_argument("--clips", type=int, default=16, help="eval clips 0..N-1 (each clip's first frame seeds its "
                    "generation); figures are means over them with 95%% intervals")
    ap.add_argument("--source", choices=TRACE_SOURCES, nargs="+", default=list(TRACE_SOURCES),
                    help="generated: greedy continuation (nearly static videos); clip: teacher-forced real clip")
    ap.add_argument("--quick", action="store_true", help="fewer modes")
    ap.add_argument("--long", action="store_true",
                    help="the 4-layer long-video model (frames up to 64; no per-head modes: those are the 1-layer "
                         "model's head layout); writes fastar_recall_long.*")
    ap.add_argument("--out-dir", type=Path, default=Path("fastcar-out/bench"))
    a = ap.parse_args(argv)
    top = 64 if a.long else 15
    if not 3 <= a.frames <= top:
        print(f"error: --frames must be in 3..{top} ({'4099' if a.long else '1024'} positions), got {a.frames}",
              file=sys.stderr)
        return 2
    stem = "fastar_recall_long" if a.long else "fastar_recall"
    if a.clips < 1:
        print(f"error: --clips must be >= 1, got {a.clips}", file=sys.stderr)
        return 2
    rows = []
    notes = []
    for source in a.source:
        per_clip: dict[tuple[str, int], list[dict]] = {}
        for clip in range(a.clips):
            tr = demo_trace(a.frames, clip, source, long=a.long)
            start = tr.video_start + 2 * tr.frame_tokens
            hkv = tr.layers[0].k.shape[1]
            for name, cfg in tqdm(modes(tr.frame_tokens, tr.video_start, a.quick, hkv, per_head=not a.long).items(),
                                  desc=f"modes ({source}, clip {clip})", unit="mode", disable=None):
                for li, layer in enumerate(tr.layers):
                    res = run_trace(layer.q, layer.k, layer.v, cfg, theta=tr.rope_theta, measure_from=start)
                    m = res.metrics
                    per_slot = np.array([slot_bytes(c.cfg, layer.k.shape[-1], 2) for c in res.caches])
                    ends = [tr.video_start + (f + 1) * tr.frame_tokens - 1 for f in range(a.frames)]
                    per_clip.setdefault((name, li), []).append({
                        **m.to_dict(), "kv_ratio": m.kv_bytes / m.dense_kv_bytes,
                        "kv_bytes_per_frame": [float(res.slots[e] @ per_slot) for e in ends],
                        "config": [c.cfg.to_dict() for c in res.caches] if isinstance(cfg, list) else cfg.to_dict()})
        for (name, li), clips in per_clip.items():
            rows.append({"source": source, "mode": name, "layer": li, **over_clips(clips)})
        notes.append(f"{source}: {len(tr.tokens)} tokens ({tr.frame_tokens} per frame), metrics over positions >= {start}")
    head = ("| trace | mode | layer | density | recall | recall per head | kept mass | out rel. err | KV bytes (fp16) "
            "| KV vs dense | merges | evicted |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    body = "".join(f"| {r['source']} | {r['mode']} | {r['layer']} | {r['density']:.1%} | {r['recall']:.1%} | "
                   f"{' '.join(f'{x:.0%}' for x in r['recall_per_head'])} | {r['kept_mass']:.1%} | "
                   f"{r['out_err']:.3f} | {r['kv_bytes']} | {r['kv_ratio']:.1%} | {r['merges']} | {r['evicted']} |\n"
                   for r in rows)
    if a.long:  # one line per mode: the mean over layers and each layer's recall
        body += "\n| trace | mode | density (mean) | recall (mean) | recall per layer | KV vs dense |\n|---|---|---|---|---|---|\n"
        for key in dict.fromkeys((r["source"], r["mode"]) for r in rows):
            sel = [r for r in rows if (r["source"], r["mode"]) == key]
            per_layer = " / ".join(f"{r['recall']:.0%}" for r in sel)
            body += (f"| {key[0]} | {key[1]} | {np.mean([r['density'] for r in sel]):.1%} | "
                     f"{np.mean([r['recall'] for r in sel]):.1%} | {per_layer} | "
                     f"{np.mean([r['kv_ratio'] for r in sel]):.1%} |\n")
    note = (f"\n{'Long-video' if a.long else 'Demo'} model, eval clips 0-{a.clips - 1} (means), {a.frames} frames; " + "; ".join(notes) + ". FAST-AR (paper, AR video diffusion): TempCache ~16% density at "
            "~90% recall; AnnSA ~28% at ~92%.\n")
    table = head + body + note
    print(table)
    write_text(a.out_dir / f"{stem}.md", f"# FAST-AR modes: density vs recall\n\n`python benchmarks/fastar_recall.py "
               f"{'--long ' if a.long else ''}--frames {a.frames} --clips {a.clips} --source {' '.join(a.source)}"
               f"{' --quick' if a.quick else ''}`\n\n" + table)
    write_text(a.out_dir / f"{stem}.json", json.dumps(rows, indent=1))
    plot(rows, a.out_dir / f"{stem}.png")
    print(f"wrote {a.out_dir}/{stem}.md, .json, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
