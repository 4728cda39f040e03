"""Per-frame time of the dense chunk-causal DiT stream: the compiled ONNX graph (cache read in place), the plain
export (cache concatenated into its inputs) and eager PyTorch, same loop, interleaved.

The `tiny` preset (random weights, seed 0) is exported with `fastcar_compile.dit.export` and compiled with
`fastcar_compile.compile` (tau = +inf: dense), then the streaming rollout (fastcar_compile.dit.stream:
4 flow-matching steps + the cache pass per chunk, CFG on two rows) runs once per backend, chunk by chunk in
turn (compiled, export, eager, ...), so all see the same machine load. A chunk's time is shared by its frames.
Runs with the model's rolling window (1 sink + 4 frames) and without (window 0: the cache grows with the
video). Prints per-frame medians around frame 50 and over the last 50 frames, the compiled / eager ratio, each
backend's cache size (the compiled graph's preallocated ring; the frames the others keep), the process RSS
after the span (all three backends live in it), and the target "compiled ORT at least as fast as eager
PyTorch per frame" as met / missed; --json writes the per-frame lists.

    python benchmarks/bench_dit_stream.py                      # 200 frames, 1 thread each
    python benchmarks/bench_dit_stream.py --frames 1000        # the growth to 1000 frames
    python benchmarks/bench_dit_stream.py --frames 1000 --alone compiled   # one backend: its own RSS
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import torch

from fastcar_compile.api import compile as compile_dit
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
        if "eager" in chunks:
            ref = chunks["eager"].frames
            worst = max(worst, *(float(np.abs(c.frames - ref).max()) for c in chunks.values()))


BACKENDS = ("compiled", "export", "eager")
CACHE_LABEL = {"compiled": "ring MiB", "export": "kept MiB", "eager": "kept MiB"}  # the cache each backend holds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1, help="threads of each backend (the machine is shared)")
    ap.add_argument("--alone", choices=BACKENDS, help="run only this backend, so that the process RSS is its own "
                    "(times are then not interleaved with the others')")
    ap.add_argument("--json", type=Path, help="write the per-frame lists here")
    a = ap.parse_args()
    cfg = PRESETS["tiny"]
    model = build(cfg, seed=0)
    tmp = Path(tempfile.mkdtemp(prefix="bench_dit_"))
    step, text = export_dit(model, tmp / "dit.onnx")
    compile_dit(step, tmp / "fast.onnx", threshold=float("inf"))
    torch.set_num_threads(a.threads)
    make = {"compiled": lambda: OrtDiT(tmp / "fast.onnx", threads=a.threads),
            "export": lambda: OrtDiT(step, text, threads=a.threads), "eager": lambda: TorchDiT(model, threads=a.threads)}
    names = [a.alone] if a.alone else list(BACKENDS)
    backends = {name: make[name]() for name in names}
    results = {}
    print(f"tiny DiT ({cfg.layers} layers, hidden {cfg.hidden}, {cfg.tokens_per_frame} tokens/frame, chunk "
          f"{cfg.chunk_frames}), {a.frames} frames, {a.threads} thread(s) each, CFG 3, 4 steps + cache pass")
    print("ms per frame (medians); cache: the compiled graph's ring buffers, the frames the others keep; RSS: the "
          "process "
          + (f"({a.alone} alone)" if a.alone else "(all three backends)"))
    ratio = "compiled" in backends and "eager" in backends
    print(f"{'window':>12} {'frames':>9} " + " ".join(f"{n:>9}" for n in names) + (" comp/eager" if ratio else "")
          + "  " + " ".join(f"{CACHE_LABEL[n]:>10}" for n in names) + f" {'RSS MiB':>8}")
    met = True
    for label, window in (("1 sink + 4", None), ("none (grows)", 0)):
        r = interleaved(backends, StreamSettings(frames=a.frames, seed=0, window_frames=window))
        results[label] = r
        spans = [("40-60", slice(40, 60))] if a.frames >= 60 else []
        spans.append((f"last {min(50, a.frames)}", slice(-min(50, a.frames), None)))
        for span, sl in spans:
            ms = {k: float(np.median(r[k]["frame_ms"][sl])) for k in names}
            line = f"{label:>12} {span:>9} " + " ".join(f"{ms[k]:9.2f}" for k in names)
            if ratio:
                met &= ms["compiled"] <= ms["eager"]
                line += f" {ms['compiled'] / ms['eager']:10.2f}"
            line += "  " + " ".join(f"{r[k]['cache_mib'][sl][-1]:10.2f}" for k in names)
            print(line + f" {r[names[0]]['rss_mib'][sl][-1]:8.0f}")
        if "eager" in backends and len(names) > 1:
            print(f"{'':>12} ONNX rollouts vs eager: max abs diff {r['max_abs_diff']:.1e}")
    if ratio:
        print(f"target compiled ORT per frame <= eager PyTorch per frame: {'met' if met else 'missed'}")
    if a.json:
        a.json.write_text(json.dumps(results) + "\n")


if __name__ == "__main__":
    main()
