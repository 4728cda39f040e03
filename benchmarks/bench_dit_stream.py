"""Per-frame time of the dense chunk-causal DiT stream: ONNX Runtime vs eager PyTorch, same loop, interleaved.

The `tiny` preset (random weights, seed 0) is exported with `fastcar_compile.dit.export`, then the streaming
rollout (fastcar_compile.dit.stream: 4 flow-matching steps + the cache pass per chunk, CFG on two rows) runs
once per backend, chunk by chunk alternately (ORT chunk, eager chunk, ...), so both see the same machine
load. A chunk's time is shared by its frames. Runs with the model's rolling window (1 sink + 4 frames) and
without (window 0: the cache grows with the video). Prints per-frame medians around frame 50 and over the
last 50 frames, the ORT / eager ratio, the cache size, and the target "ORT at least as fast as eager PyTorch
per frame" as met / missed; --json writes the per-frame lists.

    python benchmarks/bench_dit_stream.py                      # 200 frames, 1 thread each
    python benchmarks/bench_dit_stream.py --frames 1000        # the growth to 1000 frames
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import torch

from fastcar_compile.dit.config import PRESETS
from fastcar_compile.dit.export import export_dit
from fastcar_compile.dit.model import build
from fastcar_compile.dit.stream import OrtDiT, StreamSettings, TorchDiT, rollout, rss_mib


def interleaved(backends: dict, settings: StreamSettings) -> dict:
    """Per-frame ms and cache MiB of each backend, one chunk of each in turn; checks they generate the same."""
    gens = {name: rollout(b, settings) for name, b in backends.items()}
    out = {name: {"frame_ms": [], "cache_mib": [], "rss_mib": []} for name in backends}
    worst = 0.0
    while True:
        chunks = {}
        for name, g in gens.items():
            res = next(g, None)
            if res is None:
                return {**out, "max_abs_diff": worst}
            chunks[name] = res
            n = res.frames.shape[1]
            out[name]["frame_ms"] += [1000 * res.seconds / n] * n
            out[name]["cache_mib"] += [res.cache_bytes / 2**20] * n
            out[name]["rss_mib"] += [rss_mib()] * n
        a, b = chunks.values()
        worst = max(worst, float(np.abs(a.frames - b.frames).max()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1, help="threads of each backend (the machine is shared)")
    ap.add_argument("--json", type=Path, help="write the per-frame lists here")
    a = ap.parse_args()
    cfg = PRESETS["tiny"]
    model = build(cfg, seed=0)
    tmp = Path(tempfile.mkdtemp(prefix="bench_dit_"))
    step, text = export_dit(model, tmp / "dit.onnx")
    torch.set_num_threads(a.threads)
    backends = {"ort": OrtDiT(step, text, threads=a.threads), "eager": TorchDiT(model, threads=a.threads)}
    results = {}
    print(f"tiny DiT ({cfg.layers} layers, hidden {cfg.hidden}, {cfg.tokens_per_frame} tokens/frame, chunk "
          f"{cfg.chunk_frames}), {a.frames} frames, {a.threads} thread(s) each, CFG 3, 4 steps + cache pass")
    print(f"{'window':>12} {'frames':>9} {'ORT ms/frame':>13} {'eager ms/frame':>15} {'ORT/eager':>10} "
          f"{'cache MiB':>10}")
    met = True
    for label, window in (("1 sink + 4", None), ("none (grows)", 0)):
        r = interleaved(backends, StreamSettings(frames=a.frames, seed=0, window_frames=window))
        results[label] = r
        spans = [("40-60", slice(40, 60))] if a.frames >= 60 else []
        spans.append((f"last {min(50, a.frames)}", slice(-min(50, a.frames), None)))
        for span, sl in spans:
            o, e = (float(np.median(r[k]["frame_ms"][sl])) for k in ("ort", "eager"))
            met &= o <= e
            print(f"{label:>12} {span:>9} {o:13.2f} {e:15.2f} {o / e:10.2f} {r['ort']['cache_mib'][sl][-1]:10.2f}")
        print(f"{'':>12} ONNX vs eager rollout: max abs diff {r['max_abs_diff']:.1e}; RSS "
              f"{r['ort']['rss_mib'][-1]:.0f} MiB (one process, both backends)")
    print(f"target ORT per frame <= eager PyTorch per frame: {'met' if met else 'missed'}")
    if a.json:
        a.json.write_text(json.dumps(results) + "\n")


if __name__ == "__main__":
    main()
