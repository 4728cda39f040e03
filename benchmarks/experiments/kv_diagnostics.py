"""FAST-AR modes through the compiler's op on the long-video demo model, measured by the op itself
(`--kv-diagnostics`: dense attention on the side): density, recall and resident KV per layer, as a table and a
picture.

Each mode is compiled from the 4-layer long demo model (`fastcar_compile.demo.longvideo.long_onnx`) with
`--kv-budget ...` plus `--kv-diagnostics M` at tau=+inf (attention only; FastCar's replay is orthogonal), and
greedy-decodes held-out clips from their given frame 0 with FastCarSession (native kernel). Density = executed
q.k pairs / dense pairs; recall = dense softmax mass kept (merged slots shared by their members);
`fastcar_compile/fastar/attention.py` defines both and tests/test_kv_compress.py checks the kernel against it.

    python benchmarks/experiments/kv_diagnostics.py                 # 2 clips x 16 frames -> fastcar-out/bench/kv_diagnostics.{md,json,png}
    python benchmarks/experiments/kv_diagnostics.py --only "per layer" --out /tmp/kvd   # the --kv-layer modes alone
    python benchmarks/experiments/kv_diagnostics.py --replot        # redraw the picture from fastcar-out/bench/kv_diagnostics.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

# (name, compiler options); budget 4100 > any context here = no eviction. Every layer is compiled with FastCar
# (at tau=+inf), so every window covers a frame of 64 tokens (the compiler refuses less: the gate's aligned key)
MODES = [
    ("window S4+W124 C129", ["--kv-budget", "129", "--kv-sinks", "4", "--kv-window", "124", "--kv-eviction", "oldest"]),
    ("TempCache 0.95", ["--kv-budget", "4100", "--kv-window", "64", "--tempcache", "0.95"]),
    ("TempCache 0.95 C256 S4+W64", ["--kv-budget", "256", "--kv-sinks", "4", "--kv-window", "64", "--tempcache", "0.95"]),
    ("AnnSA lsh 8x4 S4+W64", ["--kv-budget", "4100", "--kv-sinks", "4", "--kv-window", "64",
                              "--sparse-attention", "lsh:8x4"]),
    ("all: C256 S4+W64 TempCache 0.95 lsh 8x4", ["--kv-budget", "256", "--kv-sinks", "4", "--kv-window", "64",
                                                "--tempcache", "0.95", "--sparse-attention", "lsh:8x4"]),
    # AnnSA by 8-bit quantised buckets (fastar/int8.py): DIRS directions x TABLES tables, same sinks + window as lsh
    ("AnnSA int8 2x4 S4+W64", ["--kv-budget", "4100", "--kv-sinks", "4", "--kv-window", "64",
                               "--sparse-attention", "int8:2x4"]),
    ("AnnSA int8 4x8 S4+W64", ["--kv-budget", "4100", "--kv-sinks", "4", "--kv-window", "64",
                               "--sparse-attention", "int8:4x8"]),
    ("AnnSA int8 8x16 S4+W64", ["--kv-budget", "4100", "--kv-sinks", "4", "--kv-window", "64",
                                "--sparse-attention", "int8:8x16"]),
    # AnnCA's decoder-only counterpart: prompt keys (BOS, motion, VIDEO_START) no query of the last frame hit
    ("prune-prompt 0.01", ["--kv-budget", "4100", "--kv-window", "64", "--prune-prompt", "0.01"]),
    ("prune-prompt 0.1", ["--kv-budget", "4100", "--kv-window", "64", "--prune-prompt", "0.1"]),
    # per layer (--kv-layer): layer 0 reads by position (a window keeps its mass), layers 1-3 by content
    ("per layer: L0 window S4+W124 C129, L1-3 TempCache 0.95",
     ["--kv-layer", "0:budget=129,sinks=4,window=124,eviction=oldest", "--kv-layer", "1-3:budget=4100,window=64,tempcache=0.95"]),
    ("per layer: L0 window S4+W124 C129, L1-3 TempCache 0.95 C256 S4+W64",
     ["--kv-layer", "0:budget=129,sinks=4,window=124,eviction=oldest",
      "--kv-layer", "1-3:budget=256,sinks=4,window=64,tempcache=0.95"]),
]


def run_mode(path: Path, clips, tok, frames: int) -> dict:
    """Greedy decode of every clip; kv_stats summed per layer, resident slots per layer after each frame."""
    from fastcar_compile.demo.model import CODES, VIDEO_START, prompt
    from fastcar_compile.runtime import FastCarSession
    from fastcar_compile.runtime.stats import RunStats

    sess = FastCarSession(path, threads=1)
    L = tok.tokens_per_frame
    stats = RunStats(model=str(path), fastcar=False, frame_tokens=L, layers=[], batch=1, video_start=VIDEO_START,
                     num_frames=frames)
    layers = sorted(int(k) for k in (sess.fastcar.kv_compress or {}).get("layers", []))
    slots = np.zeros((len(clips), frames, len(layers)))
    for c, clip in enumerate(clips):
        ids = np.asarray([prompt(clip.motion) + [int(t) for t in tok.encode(clip.frames)[0]]], np.int64)
        out = sess.step(sess.new_state(1, video_start=VIDEO_START), ids)
        stats.add_kv_stats(out.extra)
        tok_next = int(out.logits[0, -1, :CODES].argmax())
        for k in range((frames - 1) * L):
            out = sess.step(out.state, np.array([[tok_next]], np.int64), check=False)
            stats.add_kv_stats(out.extra)
            tok_next = int(out.logits[0, -1, :CODES].argmax())
            if (k + 1) % L == 0:
                f = (k + 1) // L
                slots[c, f] = [(out.state.arrays[f"past_kv_slots.{n}"][..., 0] > 0).sum(-1).mean() for n in layers]
        slots[c, 0] = slots[c, 1]  # (frame 0 is the prompt step)
    per_layer = stats.kv_ratios()  # step-by-step run, no finalize: the ratios come from the running sums
    return {"layers": layers, "density": [per_layer[str(n)]["density"] for n in layers],
            "recall": [per_layer[str(n)]["recall"] for n in layers],
            "slots_per_frame": slots.mean(0).tolist(), "tokens_per_frame": L}


def plot(rows: list[dict], path: Path, frames: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
    width = 0.8 / len(rows)
    for i, r in enumerate(rows):
        x = np.arange(len(r["layers"])) + i * width
        color = plt.cm.tab20(i % 20)  # more modes than the default 10-colour cycle
        ax[0].bar(x, r["density"], width, label=r["mode"], color=color)
        ax[1].bar(x, r["recall"], width, label=r["mode"], color=color)
        slots = np.asarray(r["slots_per_frame"]).mean(1)
        ax[2].plot(np.arange(frames), slots, marker="o", ms=3, label=r["mode"], color=color)
    L = rows[0]["tokens_per_frame"]
    ax[2].plot(np.arange(frames), 3 + L * (np.arange(frames) + 1), "k--", label="dense KV (tokens)")
    for a, t in zip(ax, ("density (executed / dense q.k)", "recall (dense softmax mass kept)",
                         "resident KV slots per head (mean over layers)"), strict=True):
        a.set_title(t, fontsize=10)
    for a in ax[:2]:
        a.set_xlabel("layer")
        a.set_xticks(np.arange(len(rows[0]["layers"])) + 0.4 - width / 2, rows[0]["layers"])
        a.set_ylim(0, 1.05)
    ax[2].set_xlabel("frame")
    ax[2].legend(fontsize=7)
    fig.suptitle("FAST-AR modes through ai.fastcar CompressedAttention (--kv-diagnostics), long demo model")
    fig.tight_layout()
    from fastcar_compile.core.atomic import save_figure

    save_figure(fig, path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    from fastcar_compile.cli import main as cli
    from fastcar_compile.core.atomic import write_text
    from fastcar_compile.demo import data
    from fastcar_compile.demo.evaluate import load_tokenizer
    from fastcar_compile.demo.longvideo import long_onnx

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clips", type=int, default=2)
    ap.add_argument("--frames", type=int, default=16)
    ap.add_argument("--out", type=Path, default=Path("fastcar-out/bench"))
    ap.add_argument("--only", help="run only the modes whose name contains this text (e.g. 'per layer')")
    ap.add_argument("--replot", action="store_true", help="redraw kv_diagnostics.png from --out's JSON, no run")
    a = ap.parse_args(argv)
    if a.replot:
        rows = json.loads((a.out / "kv_diagnostics.json").read_text())
        plot(rows, a.out / "kv_diagnostics.png", len(rows[0]["slots_per_frame"]))
        return 0
    tok = load_tokenizer()
    L = tok.tokens_per_frame
    clips = data.make_clips("eval", a.clips, a.frames, seed=0)
    src = long_onnx()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for name, opts in [m for m in MODES if a.only is None or a.only in m[0]]:
            path = Path(d) / "m.onnx"
            args = [str(src), "-o", str(path), "--frame-tokens", str(L), "--threshold=inf",
                    "--kv-diagnostics", str(8 + (a.frames + 1) * L), *opts]
            if cli(args) != 0:
                raise SystemExit(f"compile failed for {name}")
            rows.append({"mode": name, "options": " ".join(opts), **run_mode(path, clips, tok, a.frames)})
            r = rows[-1]
            print(f"{name}: density {np.round(r['density'], 3).tolist()}, recall {np.round(r['recall'], 3).tolist()}",
                  file=sys.stderr, flush=True)
    dense_tokens = 3 + a.frames * L
    head = (f"FAST-AR modes through the op (`--kv-diagnostics`), long demo model, {a.clips} held-out clips x "
            f"{a.frames} frames of {L} tokens, greedy, tau=+inf (`python benchmarks/experiments/kv_diagnostics.py`).\n\n"
            "| mode | density per layer | recall per layer | resident slots per head, last frame (dense: "
            f"{dense_tokens}) |\n|---|---|---|---|\n")
    body = "".join(f"| {r['mode']} | {', '.join(f'{x:.1%}' for x in r['density'])} | "
                   f"{', '.join(f'{x:.1%}' for x in r['recall'])} | "
                   f"{np.mean(r['slots_per_frame'][-1]):.0f} |\n" for r in rows)
    a.out.mkdir(parents=True, exist_ok=True)
    write_text(a.out / "kv_diagnostics.md", head + body)
    write_text(a.out / "kv_diagnostics.json", json.dumps(rows, indent=1))
    plot(rows, a.out / "kv_diagnostics.png", a.frames)
    print(head + body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
