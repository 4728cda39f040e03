"""FastCar and TempCache compiled into a DiT step graph against the same graph compiled dense: ms per frame of
the stream runtime (dit/stream.OrtDiT), replay and merge ratios (docs/dit.md).

    python benchmarks/experiments/dit_modes_compiled.py [--out DIR] [--frames 16] [--reps 3]

The model: a random-weight DiT whose FFN dominates a block (hidden 192, FFN 1536, 4 layers, 64 tokens per
frame, 2-frame chunks, 1 sink + 4-frame window), exported once into DIR. FastCar at taus calibrated by
`--calibrate-replay` for each `--ratios` entry (over a 4-frame probe stream); TempCache at `--tempcache` SIM.
Timing: every graph streams the same `--frames` frames (CFG 3, same seed, 1 thread each), the graphs in turn,
`--reps` rounds (interleaved: machine load hits them alike); the median per graph and its ratio to dense.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from fastcar_compile.core.atomic import write_text

CONFIG = {"layers": 4, "hidden": 192, "heads": 4, "ffn": 1536, "text_dim": 64, "in_channels": 4, "latent_h": 16,
          "latent_w": 16, "text_len": 32, "chunk_frames": 2, "sink_frames": 1, "window_frames": 4, "freq_dim": 64}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="fastcar-out/dit_modes", help="folder for the export, graphs and table.md")
    ap.add_argument("--frames", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ratios", default="0.25,0.5,0.75", help="FastCar replay ratios to calibrate for")
    ap.add_argument("--tempcache", type=float, default=0.5, help="TempCache SIM of the TempCache row")
    a = ap.parse_args()
    from fastcar_compile.api import calibrate_dit as calibrate_threshold
    from fastcar_compile.api import compile as compile_dit
    from fastcar_compile.cli import main as cli
    from fastcar_compile.dit.stream import OrtDiT, StreamSettings, rollout

    out = Path(a.out)
    (out / "model").mkdir(parents=True, exist_ok=True)
    (out / "model" / "config.json").write_text(json.dumps(CONFIG))
    src = out / "export" / "dit.onnx"
    if not src.is_file():
        assert cli(["export", "--dit", str(out / "model"), "-o", str(src)]) == 0
    runs: dict[str, dict] = {"dense": {}}
    for r in (float(x) for x in a.ratios.split(",")):
        runs[f"FastCar (calibrated for {r:.0%})"] = {"threshold": (calibrate_threshold(src, r, frames=4),)}
    runs[f"TempCache SIM {a.tempcache:g}"] = {"tempcache": a.tempcache}
    models = {}
    for i, (name, kw) in enumerate(runs.items()):
        path = out / f"graph{i}" / "dit.onnx"
        compile_dit(src, path, **kw)
        models[name] = OrtDiT(path, threads=1)
    settings = StreamSettings(frames=a.frames, seed=1)
    times: dict[str, list[float]] = {n: [] for n in models}
    for _ in range(a.reps):
        for name, m in models.items():
            t0 = time.perf_counter()
            for _ in rollout(m, settings):
                pass
            times[name].append(time.perf_counter() - t0)
    dense = float(np.median(times["dense"]))
    lines = ["| graph | tau | replay ratio | merge ratio | ms per frame | dense / this |", "|---|---|---|---|---|---|"]
    for name, m in models.items():
        med = float(np.median(times[name]))
        merges = m.cache.merges[0] / max(m.cache.merges[1], 1)
        tau = f"{m.tau:.4g}" if m.tau is not None else "-"
        lines.append(f"| {name} | {tau} | {m.replayed[0] / max(m.replayed[1], 1):.2f} | {merges:.2f} | "
                     f"{1000 * med / a.frames:.1f} | {dense / med:.2f}x |")
    write_text(out / "table.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
