"""The best recall any key selection can reach at a given density: exact top-k attention on the long demo model.

AnnSA-style modes choose which keys a query scores; no selector can keep more softmax mass at density f than
the exact top f * (p + 1) keys of that query. This computes that ceiling per layer from dense attention (RoPE,
causal) on traces of the 4-layer long-video model (`demo.trace.demo_trace(long=True)`: teacher-forced clips
and the model's own greedy continuation), over the queries of frames >= 2 (as the other recall measurements),
and draws it next to the op's measured modes (fastcar-out/bench/kv_diagnostics.json) and FAST-AR's AnnSA point (28% / 92%).
If the ceiling at 28% is below 92%, the paper's figure is out of reach on this model for any ANN index.

    python benchmarks/experiments/oracle_recall.py   # 2 eval clips x 16 frames -> fastcar-out/bench/oracle_recall.{md,json,png}
    python benchmarks/experiments/oracle_recall.py --replot   # redraw the picture (e.g. after kv_diagnostics.json changed)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

DENSITIES = (0.05, 0.1, 0.15, 0.2, 0.28, 0.4, 0.6)


def ceiling(tr, theta: float, first: int) -> list[float]:
    """Mean over queries p >= first and heads of the dense mass in the top round(f (p + 1)) keys, per density f."""
    from fastcar_compile.fastar.rope import apply_rope

    T, hq, d = tr.q.shape
    group = hq // tr.k.shape[1]
    pos = np.arange(T)
    qp = apply_rope(np.swapaxes(tr.q, 0, 1), pos, theta)
    kp = apply_rope(np.swapaxes(tr.k, 0, 1), pos, theta)
    kept = np.zeros(len(DENSITIES))
    n = 0
    for h in range(hq):
        s = qp[h] @ kp[h // group].T / np.sqrt(d)
        for p in range(first, T):
            w = np.exp(s[p, : p + 1] - s[p, : p + 1].max())
            top = np.cumsum(np.sort(w / w.sum())[::-1])
            kept += [top[max(1, round(f * (p + 1))) - 1] for f in DENSITIES]
            n += 1
    return (kept / n).tolist()


def plot(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fastcar_compile.core.atomic import save_figure

    fig, ax = plt.subplots(figsize=(7, 4.5))
    x = 100 * np.asarray(DENSITIES)
    for r in rows:
        ls = "-" if r["source"] == "clip" else "--"
        for li, rec in enumerate(r["recall"]):
            ax.plot(x, 100 * np.asarray(rec), ls=ls, lw=0.8, color=plt.cm.tab10(li),
                    label=f"ceiling, layer {li} ({r['source']})")
        ax.plot(x, 100 * np.mean(r["recall"], 0), ls=ls, lw=2.2, color="k", label=f"ceiling, mean ({r['source']})")
    measured = out / "kv_diagnostics.json"
    if measured.exists():
        ann = [m for m in json.loads(measured.read_text()) if "AnnSA" in m["mode"]]
        for i, m in enumerate(ann):
            px, py = 100 * np.mean(m["density"]), 100 * np.mean(m["recall"])
            ax.scatter(px, py, marker="x", color="k", s=30)
            ax.annotate(m["mode"].replace(" S4+W64", ""), (px, py), fontsize=7, xytext=(4, -10 - 9 * i),
                        textcoords="offset points")
    ax.scatter([28], [92], marker="*", s=150, color="k", label="FAST-AR AnnSA (28% / 92%)")
    ax.set_xlabel("density (% of dense q.k pairs)")
    ax.set_ylabel("recall (% of dense softmax mass)")
    ax.set_title("best possible selection (exact top-k) vs the op's AnnSA modes (x: mean over layers)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, loc="lower right", ncol=2)
    fig.tight_layout()
    save_figure(fig, out / "oracle_recall.png", dpi=110)


def main(argv: list[str] | None = None) -> int:
    from fastcar_compile.core.atomic import write_text
    from fastcar_compile.demo.trace import demo_trace

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clips", type=int, default=2)
    ap.add_argument("--frames", type=int, default=16)
    ap.add_argument("--out", type=Path, default=Path("fastcar-out/bench"))
    ap.add_argument("--replot", action="store_true", help="redraw oracle_recall.png from --out's JSON, no run")
    a = ap.parse_args(argv)
    if a.replot:
        plot(json.loads((a.out / "oracle_recall.json").read_text()), a.out)
        return 0
    rows = []
    for source in ("clip", "generated"):
        per_clip = []
        for clip in range(a.clips):
            t = demo_trace(a.frames, clip, source, long=True)
            per_clip.append([ceiling(tr, t.rope_theta, t.video_start + 2 * t.frame_tokens) for tr in t.layers])
            print(f"{source} clip {clip} done", file=sys.stderr, flush=True)
        rows.append({"source": source, "densities": list(DENSITIES), "recall": np.mean(per_clip, 0).tolist()})
    md = [f"Recall ceiling: dense softmax mass in each query's exact top-k keys, k = density x (p + 1); long demo "
          f"model, {a.clips} eval clips x {a.frames} frames, queries of frames >= 2 "
          "(`python benchmarks/experiments/oracle_recall.py`).", "",
          "| trace | layer | " + " | ".join(f"{100 * f:.0f}%" for f in DENSITIES) + " |",
          "|---|---|" + "---|" * len(DENSITIES)]
    for r in rows:
        per_layer = np.asarray(r["recall"])
        for li, rec in enumerate(per_layer):
            md.append(f"| {r['source']} | {li} | " + " | ".join(f"{100 * x:.1f}%" for x in rec) + " |")
        md.append(f"| {r['source']} | mean | " + " | ".join(f"{100 * x:.1f}%" for x in per_layer.mean(0)) + " |")
    text = "\n".join(md) + "\n"
    a.out.mkdir(parents=True, exist_ok=True)
    write_text(a.out / "oracle_recall.md", text)
    write_text(a.out / "oracle_recall.json", json.dumps(rows, indent=1))
    plot(rows, a.out)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
