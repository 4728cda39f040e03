"""TempCache compiled into the trained DiT's step graph, per correspondence (aligned, lsh, int8: dit/tempcache.py):
the cache write's cost per chunk, the resident slots against a dense cache, the merges' agreement with an
exhaustive top-1 match, and (eager runtime, dense attention on the side) the attention recall.

    python benchmarks/experiments/dit_tempcache_match.py [--frames 32] [--sim 0.9] [--out DIR] [--eager-recall]

The model: training/dit_model (64 tokens per frame, 4 blocks of 4 heads of 32, 2 sink frames + a 14-frame
window), exported and compiled with `--tempcache SIM --tempcache-match M` into DIR; the prompt is
`camera=pan_right` (dit-table1's), CFG 2, seed 0, 1 thread. The three compiled graphs stream chunk by chunk
in turn (interleaved: machine load hits them alike). Per chunk: the write's seconds (RingCache.write: the
merge and the copy into the ring) and the whole chunk's (5 passes of the step graph + the write); medians.
- kv density: resident slots / the slots a dense cache of the same frames holds, averaged over the chunks
  once the window is full (the last chunk's too).
- exhaustive recall: of the written keys whose best cosine over ALL live slots of the previous frame
  exceeds SIM (what an exact top-1 would merge), the share merged into that very slot; precision: the
  share of the merges that went to it.
- attention recall (--eager-recall): the eager runtime's TempCache at the same settings with the dense
  attention on the side (dit/fastar.FastARDiT, diagnostics), its kv density checked against the compiled one.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common
from _common import in_turn  # noqa: E402

from fastcar_compile.core.atomic import write_text  # noqa: E402
from fastcar_compile.dit import tempcache  # noqa: E402
from fastcar_compile.dit.cache import RingCache  # noqa: E402
from fastcar_compile.dit.stream import OrtDiT, StreamSettings, rollout  # noqa: E402

MATCHES = ("aligned", "lsh", "int8")


class MeasuredRing(RingCache):
    """A RingCache that times its writes and, outside the timed part, compares each merge with the
    exhaustive top-1 over the previous frame's live slots."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.write_s: list[float] = []
        self.exhaustive = [0, 0, 0]  # exact top-1 would merge, this merge found that slot, merges made
        self._side = 0.0

    def write(self, first_frame, kv):
        self._side = 0.0
        t0 = time.perf_counter()
        super().write(first_frame, kv)
        self.write_s.append(time.perf_counter() - t0 - self._side)

    def _merge(self, i, k_pre, value, src):
        if src is not None:
            t0 = time.perf_counter()
            old = slice(src * self.tokens, (src + 1) * self.tokens)
            live = torch.from_numpy(self.counts[i][:, :, old] > 0)
            k, prev = torch.from_numpy(k_pre.copy()), torch.from_numpy(self.last_pre[i])
            zero = torch.zeros((*k_pre.shape[:3], 1), dtype=torch.int64)  # one bucket for all: every live slot
            best = tempcache.targets(k, prev, live, self.tempcache, zero, zero)
            codes = None if self.match is None else torch.from_numpy(self.match.codes(k_pre))
            last = None if codes is None else torch.from_numpy(self.last_codes[i])
            got = tempcache.targets(k, prev, live, self.tempcache, codes, last)
            self.exhaustive[0] += int((best >= 0).sum())
            self.exhaustive[1] += int(((best >= 0) & (got == best)).sum())
            self.exhaustive[2] += int((got >= 0).sum())
            self._side += time.perf_counter() - t0
        return super()._merge(i, k_pre, value, src)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("fastcar-out/dit_tempcache_match"))
    ap.add_argument("--frames", type=int, default=32)
    ap.add_argument("--sim", type=float, default=0.9)
    ap.add_argument("--prompt", default="camera=pan_right")
    ap.add_argument("--eager-recall", action="store_true", help="also the eager runtime's attention recall")
    a = ap.parse_args()
    from fastcar_compile.cli import main as cli
    from fastcar_compile.cli.demo_dit import MODEL_DIR, parse_prompt
    from fastcar_compile.demo.dit_train import text_embeds

    a.out.mkdir(parents=True, exist_ok=True)
    src = a.out / "export" / "dit.onnx"
    if not src.is_file():
        assert cli(["export", "--dit", str(MODEL_DIR), "-o", str(src)]) == 0
    text = text_embeds(parse_prompt(a.prompt))
    settings = StreamSettings(frames=a.frames, seed=0, cfg_scale=2.0)
    models, caches = {}, {}
    for m in MATCHES:
        path = a.out / m / "dit.onnx"
        if not path.is_file():
            assert cli([str(src), "-o", str(path), "--tempcache", str(a.sim), "--tempcache-match", m]) == 0
        rt = OrtDiT(path, threads=1)

        def new_cache(layers, tokens, sinks, window, rt=rt, m=m):
            caches[m] = MeasuredRing(layers, tokens, sinks, window, tempcache=rt.sim, match=rt.hasher)
            rt.cache = caches[m]
            return caches[m]

        rt.new_cache = new_cache
        models[m] = rt
    cfg = models["aligned"].cfg
    full = cfg.sink_frames + cfg.window_frames  # frames resident once the window is full
    chunk_s = {m: [] for m in MATCHES}
    density = {m: [] for m in MATCHES}
    for m, c in in_turn({m: rollout(rt, settings, text) for m, rt in models.items()}):
        chunk_s[m].append(c.seconds - caches[m]._side)
        if len(c.resident) >= full:
            density[m].append(caches[m].kv_density)
    rows = {}
    base = float(np.median(caches["aligned"].write_s))
    for m in MATCHES:
        c = caches[m]
        e = c.exhaustive
        rows[m] = {"write_ms_per_chunk": 1000 * float(np.median(c.write_s)),
                   "write_vs_aligned": float(np.median(c.write_s)) / base,
                   "chunk_ms": 1000 * float(np.median(chunk_s[m])),
                   "merge_ratio": c.merges[0] / c.merges[1],
                   "kv_density_full_window": float(np.mean(density[m])) if density[m] else None,
                   "kv_density_last": c.kv_density,
                   "exhaustive_recall": e[1] / e[0] if e[0] else None,
                   "exhaustive_precision": e[1] / e[2] if e[2] else None}
    if a.eager_recall:
        import torch

        from fastcar_compile.cli.demo_dit import load_trained
        from fastcar_compile.dit import modes
        from fastcar_compile.dit.fastar import FastARDiT, totals

        torch.set_num_threads(1)
        model = load_trained(MODEL_DIR)
        for m in MATCHES:
            rt = FastARDiT(model, modes.settings(tempcache=a.sim, tempcache_match=m, diagnostics=True))
            for _ in rollout(rt, settings, text):
                pass
            t = totals(rt.stats)
            rows[m]["eager_self_recall"] = t["self_recall"]
            rows[m]["eager_kv_density_last"] = t["kv_density"]
    doc = {"frames": a.frames, "sim": a.sim, "prompt": a.prompt, "cfg": 2.0, "threads": 1, "rows": rows}
    write_text(a.out / "result.json", json.dumps(doc, indent=1))
    print(f"{a.frames} frames, SIM {a.sim:g}, prompt {a.prompt}, CFG 2, 1 thread")
    print("| match | write ms/chunk | x aligned | chunk ms | merged | KV density (full window) | KV density (last) "
          "| exhaustive recall / precision | attention recall (eager) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    def pct(x: float | None) -> str:  # None: not measured (window never full, no exact merge, no --eager-recall)
        return "-" if x is None else f"{100 * x:.1f}%"

    for m, r in rows.items():
        print(f"| {m} | {r['write_ms_per_chunk']:.2f} | {r['write_vs_aligned']:.2f} | {r['chunk_ms']:.1f} | "
              f"{pct(r['merge_ratio'])} | {pct(r['kv_density_full_window'])} | {pct(r['kv_density_last'])} | "
              f"{pct(r['exhaustive_recall'])} / {pct(r['exhaustive_precision'])} | {pct(r.get('eager_self_recall'))} |")


if __name__ == "__main__":
    main()
