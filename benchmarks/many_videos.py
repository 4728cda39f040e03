"""Many videos per minute: `fastcar-compile generate`'s in-process loop against Ray Data actor pools of 1 and 2
actors on this machine, and the per-video latency distribution.

The `tiny` DiT preset (random weights) is exported and compiled dense (`fastcar-compile dit.onnx -o fast.onnx`),
and the same prompts are rendered three ways into fresh folders, one after the other: the loop in this process,
Ray with 1 actor, Ray with 2 actors (1 ONNX Runtime thread each; a local Ray cluster started once for both). Wall
time covers the whole render, Ray's actor start-up and model loads included (what a user waits for); the videos
per minute is rendered videos / wall. Each video's own time (its trace) gives the latency quantiles, and the
traces give each actor's model-load time and memory (RSS after its last video).

    python benchmarks/many_videos.py --videos 24 --frames 24 --out many.json
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--videos", type=int, default=24)
    ap.add_argument("--frames", type=int, default=24, help="latent frames per video")
    ap.add_argument("--quick", action="store_true", help="6 videos of 8 frames")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if a.quick:
        a.videos, a.frames = 6, 8
    import ray

    from fastcar_compile.dit.config import PRESETS
    from fastcar_compile.many_videos import generate_many, video_path

    cfg = PRESETS["tiny"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        fc = [sys.executable, "-m", "fastcar_compile"]
        subprocess.run([*fc, "export", "--dit", "tiny", "-o", str(t / "dit.onnx")], check=True, capture_output=True)
        subprocess.run([*fc, str(t / "dit.onnx"), "-o", str(t / "fast.onnx")], check=True, capture_output=True)
        prompts = np.random.default_rng(0).standard_normal((a.videos, 6, cfg.text_dim)).astype(np.float32)
        ray.init(num_cpus=2, object_store_memory=100 << 20, include_dashboard=False, log_to_driver=False,
                 logging_level=logging.ERROR)
        try:
            for name, kw in (("in-process loop", {}), ("ray, 1 actor", {"ray": True, "actors": 1}),
                             ("ray, 2 actors", {"ray": True, "actors": 2})):
                out = t / name.replace(" ", "_").replace(",", "")
                s = generate_many(t / "fast.onnx", prompts, a.frames, out, threads=1, **kw)
                traces = []
                for i in range(a.videos):
                    with np.load(video_path(out, i)) as z:
                        traces.append(json.loads(str(z["trace"])))
                workers = {tr["worker"]["pid"]: tr["worker"] for tr in traces}
                lat = np.array([tr["seconds"] for tr in traces])
                rows.append({"variant": name, "videos": s["rendered"], "wall_s": s["wall_s"],
                             "videos_per_min": s["videos_per_min"], "p50_s": float(np.quantile(lat, 0.5)),
                             "p90_s": float(np.quantile(lat, 0.9)), "max_s": float(lat.max()),
                             "workers": len(workers),
                             "load_s": float(np.mean([w["load_s"] for w in workers.values()])),
                             "worker_rss_mib": float(np.mean([w["rss_mib"] for w in workers.values()]))})
                print(f"{name}: {s['rendered']} videos in {s['wall_s']:.1f} s = {s['videos_per_min']:.1f}/min, "
                      f"p50 {rows[-1]['p50_s']:.3f} s", flush=True)
        finally:
            ray.shutdown()
    base = rows[0]["videos_per_min"]
    for r in rows:
        r["x_loop"] = r["videos_per_min"] / base
    Path(a.out).write_text(json.dumps({"videos": a.videos, "frames": a.frames, "model": "tiny DiT, compiled dense",
                                       "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
