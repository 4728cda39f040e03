"""Are prompt tokens attention anchors? Dense attention mass on the prompt prefix, per layer and head, on the
long-video demo model; and what --prune-prompt P would skip there (docs/semantics.md section 6).

The demo's prompt is [BOS, motion, VIDEO_START] (3 tokens before video_start; the LLaMA-style zoo models are
random-weight test graphs with no prompt structure, so they are not measured). On a trace of the 4-layer model
(`demo.trace.demo_trace(long=True)`: teacher-forced real clip, or its own greedy continuation), for every
query of video frames >= 1 the dense softmax (RoPE applied, causal) gives the mass on positions < video_start.
Reported per layer: mean prompt mass, its share of the per-token mean a uniform distribution would give
(prompt mass / (3 / (p + 1))), the mass per prompt token, and the per-head maximum. Then each prompt token's
"hit" in a frame = its largest weight over that frame's queries of a KV head; the table gives the share of
(frame, token, head) cells whose hit stays below P: what --prune-prompt P would skip the next frame, if
pruning never compounded. The pruning itself (density, recall) is then run on the same traces through the
NumPy reference (`fastar.attention.run_trace`, config `prune_prompt=P`).

    python benchmarks/experiments/prompt_anchors.py   # 2 eval clips x 16 frames -> fastcar-out/bench/prompt_anchors.{md,json,png}
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

THRESHOLDS = (0.001, 0.01, 0.05, 0.1)


def softmax_rows(q_post: np.ndarray, k_post: np.ndarray) -> np.ndarray:
    """Causal softmax [T, T] of one head (q, k post-RoPE [T, d])."""
    T, d = q_post.shape
    s = q_post @ k_post.T / np.sqrt(d)
    s[np.triu_indices(T, 1)] = -np.inf
    w = np.exp(s - s.max(1, keepdims=True))
    return w / w.sum(1, keepdims=True)


def layer_anchors(tr, theta: float, L: int, vs: int) -> dict:
    """Prompt mass per head of one layer trace over queries in frames >= 1, and hits per frame."""
    from fastcar_compile.fastar.rope import apply_rope

    T, hq, _ = tr.q.shape
    hkv = tr.k.shape[1]
    pos = np.arange(T)
    qp = apply_rope(np.swapaxes(tr.q, 0, 1), pos, theta)
    kp = apply_rope(np.swapaxes(tr.k, 0, 1), pos, theta)
    first = vs + L
    mass, per_tok, uniform_ratio = [], [], []
    frames = (T - vs) // L
    hits = np.zeros((frames, hkv, vs))  # max weight a prompt token got from a frame's queries (KV head group)
    for h in range(hq):
        w = softmax_rows(qp[h], kp[h // (hq // hkv)])
        pm = w[first:, :vs].sum(1)
        mass.append(float(pm.mean()))
        per_tok.append(w[first:, :vs].mean(0).tolist())
        uniform_ratio.append(float((pm / (vs / (pos[first:] + 1))).mean()))
        for f in range(frames):
            rows = w[vs + f * L: vs + (f + 1) * L, :vs]
            hits[f, h // (hq // hkv)] = np.maximum(hits[f, h // (hq // hkv)], rows.max(0))
    below = {str(p): float((hits[:-1] < p).mean()) for p in THRESHOLDS}  # the last frame has no next frame
    return {"prompt_mass": float(np.mean(mass)), "prompt_mass_per_head": mass,
            "mass_per_prompt_token": np.mean(per_tok, 0).tolist(), "vs_uniform": float(np.mean(uniform_ratio)),
            "hit_below": below}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fastcar_compile.core.atomic import save_figure

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for i, r in enumerate(rows):
        x = np.arange(r["layers"]) + 0.4 * i
        ax[0].bar(x, 100 * np.asarray(r["prompt_mass"]), 0.4, label=f"{r['source']}: mean over heads")
        ax[0].scatter(x, 100 * np.asarray(r["prompt_mass_max_head"]), marker="_", s=200, color="k")
        ax[1].plot([str(p) for p in THRESHOLDS], [100 * (1 - np.mean(r["prune"][str(p)]["recall"]))
                                                  for p in THRESHOLDS], marker="o", label=f"{r['source']}")
    ax[0].set_xticks(np.arange(rows[0]["layers"]) + 0.2 * (len(rows) - 1), range(rows[0]["layers"]))
    ax[0].set_xlabel("layer")
    ax[0].set_ylabel("dense attention mass on the 3 prompt tokens (%)")
    ax[0].set_title("prompt mass per query (bar: mean over heads, tick: max head)", fontsize=9)
    ax[0].legend(fontsize=7)
    ax[1].set_xlabel("--prune-prompt P")
    ax[1].set_ylabel("recall lost (%, mean over layers)")
    ax[1].set_title("what pruning the prompt costs (NumPy reference)", fontsize=9)
    ax[1].legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    from fastcar_compile.core.atomic import write_text
    from fastcar_compile.demo.trace import demo_trace
    from fastcar_compile.fastar.attention import run_trace
    from fastcar_compile.fastar.config import KVCompressConfig

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clips", type=int, default=2)
    ap.add_argument("--frames", type=int, default=16)
    ap.add_argument("--sources", default="clip,generated")
    ap.add_argument("--out", type=Path, default=Path("fastcar-out/bench"))
    ap.add_argument("--replot", action="store_true", help="redraw prompt_anchors.png from --out's JSON, no run")
    a = ap.parse_args(argv)
    if a.replot:
        plot(json.loads((a.out / "prompt_anchors.json").read_text()), a.out / "prompt_anchors.png")
        return 0
    rows = []
    for source in a.sources.split(","):
        per_clip = []
        for clip in range(a.clips):
            t = demo_trace(a.frames, clip, source, long=True)
            L, vs = t.frame_tokens, t.video_start
            layers = [layer_anchors(tr, t.rope_theta, L, vs) for tr in t.layers]
            prune = {}
            for p in THRESHOLDS:
                cfg = KVCompressConfig(prune_prompt=p, frame_tokens=L, video_start=vs)
                ms = [run_trace(tr.q, tr.k, tr.v, cfg, t.rope_theta, measure_from=vs + L).metrics for tr in t.layers]
                prune[str(p)] = {"density": [m.density for m in ms], "recall": [m.recall for m in ms],
                                 "out_err": [m.out_err for m in ms]}
            per_clip.append({"layers": layers, "prune": prune})
            print(f"{source} clip {clip}: prompt mass per layer "
                  f"{[round(x['prompt_mass'], 4) for x in layers]}", file=sys.stderr, flush=True)
        n_layers = len(per_clip[0]["layers"])

        def avg(get, pc=per_clip):
            return np.mean([get(c) for c in pc], 0).tolist()

        rows.append({
            "source": source, "clips": a.clips, "frames": a.frames,
            "prompt_mass": avg(lambda c: [x["prompt_mass"] for x in c["layers"]]),
            "prompt_mass_max_head": avg(lambda c: [max(x["prompt_mass_per_head"]) for x in c["layers"]]),
            "mass_per_prompt_token": avg(lambda c: [x["mass_per_prompt_token"] for x in c["layers"]]),
            "vs_uniform": avg(lambda c: [x["vs_uniform"] for x in c["layers"]]),
            "hit_below": {str(p): avg(lambda c, p=p: [x["hit_below"][str(p)] for x in c["layers"]])
                          for p in THRESHOLDS},
            "prune": {str(p): {k: avg(lambda c, p=p, k=k: c["prune"][str(p)][k]) for k in ("density", "recall",
                                                                                              "out_err")}
                      for p in THRESHOLDS},
            "layers": n_layers})
    md = [f"Prompt tokens as attention anchors, long demo model ({a.clips} eval clips x {a.frames} frames; prompt = "
          "BOS, motion, VIDEO_START; queries of frames >= 1; `python benchmarks/experiments/prompt_anchors.py`).", "",
          "| trace | layer | prompt mass | max over heads | per token (BOS / motion / VIDEO_START) | x uniform share |",
          "|---|---|---|---|---|---|"]
    for r in rows:
        for li in range(r["layers"]):
            tok = " / ".join(f"{100 * x:.2f}%" for x in r["mass_per_prompt_token"][li])
            md.append(f"| {r['source']} | {li} | {100 * r['prompt_mass'][li]:.2f}% | "
                      f"{100 * r['prompt_mass_max_head'][li]:.2f}% | {tok} | {r['vs_uniform'][li]:.1f}x |")
    md += ["", "--prune-prompt P on the same traces (NumPy reference, `run_trace`; density and recall over all "
           "keys; (frame, token, KV head) cells whose best weight in a frame is below P):", "",
           "| trace | P | cells below P per layer | density per layer | recall per layer | out rel. err per layer |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        for p in THRESHOLDS:
            pr = r["prune"][str(p)]
            md.append(f"| {r['source']} | {p:g} | {' / '.join(f'{100 * x:.0f}%' for x in r['hit_below'][str(p)])} | "
                      f"{' / '.join(f'{100 * x:.2f}%' for x in pr['density'])} | "
                      f"{' / '.join(f'{100 * x:.2f}%' for x in pr['recall'])} | "
                      f"{' / '.join(f'{x:.4f}' for x in pr['out_err'])} |")
    text = "\n".join(md) + "\n"
    a.out.mkdir(parents=True, exist_ok=True)
    write_text(a.out / "prompt_anchors.md", text)
    write_text(a.out / "prompt_anchors.json", json.dumps(rows, indent=1))
    plot(rows, a.out / "prompt_anchors.png")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
