"""Does the token world model remember, and what does each cache keep of that memory? Held-out revisit paths
rolled out greedily through the compiled model with every cache variant, scored against the truth.

    python benchmarks/world_memory.py --out DIR                  # 16 held-out paths x 64 frames
    python benchmarks/world_memory.py --quick --out DIR          # 16 paths x 24 frames (about a minute)

Every variant runs the same compiled graph family (the shipped fp16 weights, exported once into the user cache) by
FastCarSession, the 16 paths batched, 1 thread, frame 0 given (the truth's tokens), then one greedy token per step:
- `full`: the whole past in the cache (it grows with the video);
- `window`: the sink + window cache (the first tokens and the last `--window-frames` frames, the oldest token leaves);
- FAST-AR modes under one fixed budget (`--fastar-budget-frames` frames of slots, the same sinks and window, the
  least attention mass leaves): TempCache, AnnSA (sign LSH, int8 buckets) and all of them together;
- `fastcar`: the full cache with FastCar's MLP replay at the tau that replays `--replay` of the MLPs on
  training-split paths (TAS quantile of a diagnostics graph's rollout), and FastCar on the all-modes cache;
- `shift`: the trivial world model, the last frame shifted by the action (the entering strip repeats the edge).
Fidelity: per path, the share of generated tokens equal to the truth's on cells the truth labels revisited (seen
before, not in the previous frame), revisited beyond the window, new (never seen) and previous (in the previous
frame); mean over paths with a 95% Student-t interval. Speed: the batch's frames per second over the early frames
(5-15% of the video) and the last 10%; cache MiB (the session state) at both points and the process RSS.
Variants run one after another in one process, so their speeds share the machine's load only roughly; the
ratios are indicative on a shared machine.
Long videos (`--speed-frames`, default 1000; off with --quick): the bounded caches (sink + window, all FAST-AR
modes together, FastCar on them) over the same number of held-out paths that long, rolled out frame by frame in
lockstep (each variant one frame in turn, so all see the same load), FPS at frames 5-15% and the last 10%
(50-150 and 900-1000), each against the sink + window cache: what a user of a long world pays.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def measure(a) -> dict:
    from fastcar_compile.demo import world
    from fastcar_compile.demo.export import TOKENIZER
    from fastcar_compile.demo.tokenizer import PatchTokenizer
    from fastcar_compile.demo.worldmodel import FRAME_TOKENS
    from fastcar_compile.demo.worldrun import (
        WORLD_CONFIG_FILE,
        WORLD_WEIGHTS,
        rss_mib,
        weights_id,
        world_onnx,
    )
    from fastcar_compile.demo.worldvariants import (
        FASTCAR,
        CacheSettings,
        calibrate_tau,
        frame_windows,
        run_variants,
        variants,
    )

    weights = Path(a.weights or WORLD_WEIGHTS)
    config = weights.with_suffix(".json") if a.weights else WORLD_CONFIG_FILE
    onnx = world_onnx(weights, config, progress=False)
    tok = PatchTokenizer.load(TOKENIZER)
    paths = world.make_paths("eval", a.paths, a.frames, seed=a.seed)
    c = CacheSettings(a.sinks, a.window_frames, a.fastar_budget_frames)
    with tempfile.TemporaryDirectory(prefix="world-memory-") as tmp:
        tau, calib_replay = calibrate_tau(onnx, Path(tmp), tok, a.replay, a.calib_paths, a.calib_frames, a.seed,
                                          a.threads)

    def report(row: dict) -> None:
        print(f"[world-memory] {row['variant']}: revisit {row['revisit']:.3f} far {row['revisit_far']:.3f} new "
              f"{row['new']:.3f} ({row['seconds']:.0f} s)", file=sys.stderr, flush=True)

    chosen = variants(c, every=not a.quick)
    rows, _ = run_variants(onnx, tok, paths, chosen, tau, a.window_frames, a.threads, report)
    long_rows = []
    if a.speed_frames:
        bounded = {k: v for k, v in variants(c, every=True).items() if k in ("window", "fastar", f"{FASTCAR}+fastar")}
        long_paths = world.make_paths("eval", a.paths, a.speed_frames, seed=a.seed)
        long_rows, _ = run_variants(onnx, tok, long_paths, bounded, tau, a.window_frames, a.threads, report,
                                    in_lockstep=True)
        win = next(r for r in long_rows if r["variant"] == "window")
        for r in long_rows:
            r["x_window_late"] = r["fps_late"] / win["fps_late"]
            r["late_over_early"] = r["fps_late"] / r["fps_early"]
    early, late = frame_windows(a.frames)
    wid = weights_id(weights)
    title = (f"token world model {wid}, {a.paths} held-out paths x {a.frames} frames, window {a.window_frames} "
             f"frames + {a.sinks} sinks, FAST-AR budget {a.fastar_budget_frames} frames, FastCar tau {tau:.4g} "
             f"({calib_replay:.0%} replay on training paths)")
    return {"title": title, "weights": wid, "paths": a.paths, "frames": a.frames, "frame_tokens": FRAME_TOKENS,
            "window_frames": a.window_frames, "sinks": a.sinks, "fastar_budget": c.budget, "early_frames": list(early),
            "late_frames": list(late), "tau": tau, "tau_replay_calibration": calib_replay, "threads": a.threads,
            "seed": a.seed, "rss_mib_end": rss_mib(), "rows": rows, "speed_frames": a.speed_frames,
            "speed_windows": [list(w) for w in frame_windows(a.speed_frames)] if a.speed_frames else None,
            "long_rows": long_rows}


def plot(raw: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fastcar_compile.core.atomic import save_figure

    rows = raw["rows"]
    names = [r["variant"] for r in rows]
    keys = [("revisit_far", f"revisited > {raw['window_frames']} frames back"), ("revisit", "revisited"),
            ("new", "new content"), ("previous", "in the previous frame")]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 0.35 * len(rows) * len(keys) / 2 + 2.5),
                                 gridspec_kw={"width_ratios": [2, 1]})
    y = np.arange(len(rows))
    h = 0.8 / len(keys)
    for k, (key, label) in enumerate(keys):
        ax.barh(y + k * h, [r[key] for r in rows], h, xerr=[r[f"{key}_ci"] for r in rows], label=label, capsize=2)
    ax.set_yticks(y + h * (len(keys) - 1) / 2, names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.set_xlabel("token accuracy vs the truth (mean, 95% interval)")
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title(f"{raw['paths']} held-out paths x {raw['frames']} frames", fontsize=9)
    timed = [r for r in rows if r.get("fps_late")]
    yt = np.arange(len(timed))
    bx.barh(yt - 0.2, [r["fps_early"] for r in timed], 0.4, label="early")
    bx.barh(yt + 0.2, [r["fps_late"] for r in timed], 0.4, label="late")
    bx.set_yticks(yt, [r["variant"] for r in timed], fontsize=8)
    bx.invert_yaxis()
    bx.set_xlabel(f"frames / s ({raw['paths']} paths batched, {raw['threads']} thread)")
    bx.legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--paths", type=int, default=16, help="held-out paths (default 16)")
    ap.add_argument("--frames", type=int, help="frames per path, frame 0 given (default 64; --quick: 24)")
    ap.add_argument("--window-frames", type=int, default=4, help="frames the window cache keeps (default 4)")
    ap.add_argument("--sinks", type=int, default=4, help="sink tokens every bounded cache keeps (default 4)")
    ap.add_argument("--fastar-budget-frames", type=int, default=8,
                    help="KV slots of the FAST-AR caches, in frames (default 8)")
    ap.add_argument("--replay", type=float, default=0.5, help="FastCar's target MLP replay (default 0.5)")
    ap.add_argument("--calib-paths", type=int, default=4, help="training-split paths the tau is calibrated on")
    ap.add_argument("--calib-frames", type=int, default=12, help="their frames")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--weights", help="world.safetensors (its .json beside it; default: the shipped model)")
    ap.add_argument("--speed-frames", type=int, help="frames of the long-video speed run of the bounded caches "
                    "(default 1000; --quick: 0, no run)")
    ap.add_argument("--quick", action="store_true", help="24 frames, the variants full, window, all FAST-AR "
                    "modes, FastCar and shift, no long-video run")
    ap.add_argument("--out", type=Path, required=True, help="output folder")
    a = ap.parse_args(argv)
    if a.frames is None:
        a.frames = 24 if a.quick else 64
    if a.speed_frames is None:
        a.speed_frames = 0 if a.quick else 1000
    from fastcar_compile.core.errors import FastCarError

    if a.paths < 2 or a.frames < 8 or a.window_frames < 1 or (a.speed_frames and a.speed_frames < 20):
        raise SystemExit("error: need --paths >= 2, --frames >= 8, --window-frames >= 1 and --speed-frames 0 or "
                         ">= 20")
    a.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        raw = measure(a)
    except FastCarError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    raw["seconds"] = time.perf_counter() - t0
    from fastcar_compile.core.atomic import write_text

    plot(raw, a.out / "plot.png")
    write_text(a.out / "world_memory.json", json.dumps(raw, indent=1, default=float) + "\n")
    print(f"wrote {a.out}/world_memory.json and plot.png ({raw['seconds']:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
