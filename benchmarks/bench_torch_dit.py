"""TempCache on the PyTorch DiT (`fastcar_compile.torch.apply_dit`) with its dead slots compacted out of the
cache vs kept until their frame leaves (`compact_cache = False`, the uncompacted layout), on the causal DiT trained
here (training/dit_model), in one process: the two rollouts run interleaved chunk by chunk on the same prompt
and seed. Per variant: ms per chunk (the lower quartile over the video's second half, where the cache is full), cache MiB
and the self-attention keys per query (summed over layers) after the last chunk, and the max |difference|
between the two videos (compaction reorders keys only: float rounding).

    python benchmarks/bench_torch_dit.py --frames 64    # the model's 2 sinks + 14-frame window, then every frame kept
    python -m benchmarks torch-dit                      # the same, as results/torch-dit
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import lower_quartile_ms, save_results  # noqa: E402

from fastcar_compile.cli.demo_dit import MODEL_DIR, load_trained, parse_prompt  # noqa: E402
from fastcar_compile.demo.dit_train import text_embeds  # noqa: E402
from fastcar_compile.dit.stream import StreamSettings, rollout  # noqa: E402
from fastcar_compile.torch import apply_dit  # noqa: E402

MiB = 1 << 20


def measure(model, settings: StreamSettings, text: np.ndarray, **options) -> dict:
    """Both variants' rollouts interleaved chunk by chunk: per variant the per-chunk seconds, cache bytes and
    self-attention keys, and the videos' max |difference|."""
    runs = {}
    for name, compact in (("compacted", True), ("uncompacted", False)):
        fast = apply_dit(model, **options)
        fast.compact_cache = compact
        runs[name] = (fast, rollout(fast, settings, text))
    out = {name: {"seconds": [], "bytes": [], "keys": []} for name in runs}
    diff = 0.0
    for chunks in zip(*(r for _, r in runs.values()), strict=True):
        for (name, (fast, _)), chunk in zip(runs.items(), chunks, strict=True):
            rec = out[name]
            rec["seconds"].append(chunk.seconds)
            rec["bytes"].append(fast.cache.nbytes)
            rec["keys"].append(sum(k.shape[2] for k in fast.cache.key))
        diff = max(diff, float(np.abs(chunks[0].frames - chunks[1].frames).max()))
    for name, (fast, _) in runs.items():
        out[name]["stats"] = fast.stats
    return {"variants": out, "max_abs_diff": diff}


def summary(raw: dict, window: int) -> list[dict]:
    rows = []
    for name, rec in raw["variants"].items():
        late = rec["seconds"][len(rec["seconds"]) // 2:]
        rows.append({"window": window, "variant": name, "ms_per_chunk": lower_quartile_ms({0: late})[0],
                     "cache_mib": rec["bytes"][-1] / MiB, "peak_cache_mib": max(rec["bytes"]) / MiB,
                     "keys": rec["keys"][-1], "merge_ratio": rec["stats"]["merge_ratio"],
                     "kv_density": rec["stats"]["kv_density"]})
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--weights", type=Path, default=MODEL_DIR)
    p.add_argument("--frames", type=int, default=64)
    p.add_argument("--windows", default="model,0", help="window frames per run ('model': the model's; 0: all)")
    p.add_argument("--sim", type=float, default=0.9, help="TempCache's SIM")
    p.add_argument("--threshold", type=float, default=None, help="FastCar's TAS threshold (default: off)")
    p.add_argument("--cfg", type=float, default=2.0)
    p.add_argument("--prompt", default="camera=pan_right")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    model = load_trained(a.weights)
    text = text_embeds(parse_prompt(a.prompt))
    runs, rows = [], []
    for w in a.windows.split(","):
        window = model.cfg.window_frames if w == "model" else int(w)
        settings = StreamSettings(frames=a.frames, seed=0, cfg_scale=a.cfg, window_frames=window)
        raw = measure(model, settings, text, tempcache=a.sim, threshold=a.threshold)
        runs.append({"window": window, **raw})
        rows += summary(raw, window)
        print(f"{a.frames} frames, SIM {a.sim}, {model.cfg.sink_frames} sinks + window {window}, {a.threads} "
              f"thread(s); max |compacted - uncompacted| {raw['max_abs_diff']:.2e}")
        for r in rows[-2:]:
            print(f"  {r['variant']:12s} {r['ms_per_chunk']:8.1f} ms/chunk (second half, lower quartile)  cache "
                  f"{r['cache_mib']:.2f} MiB (peak {r['peak_cache_mib']:.2f})  self-attention keys {r['keys']}  "
                  f"merge ratio {r['merge_ratio']:.3f}  KV density {r['kv_density']:.3f}")
    if a.json:
        save_results(a.json, {"command": ["bench_torch_dit.py", *(argv or sys.argv[1:])], "rows": rows, "runs": runs})


if __name__ == "__main__":
    sys.exit(main())
