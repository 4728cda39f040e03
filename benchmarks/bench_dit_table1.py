"""FAST-AR's Table 1 on the causal video DiT trained here (training/dit_model/): per mode, quality vs the
dense rollout, density and recall, component and end-to-end speed-up, FPS and memory early vs late.

Every mode streams the same labelled prompt with the same noise seed (the eager FAST-AR runtime,
fastcar_compile.dit.fastar; the dense eager rollout, TorchDiT, is the reference and the baseline), one chunk of
each mode in turn so all see the same machine load. Two runs:
- quality and structure: every mode for --diag-frames frames (past the window, so the cache is full) with a
  dense attention on the side: PSNR / SSIM of the RGB video vs the dense one, self/cross density (executed q.k
  pairs / dense pairs) and recall (the dense softmax mass the mode keeps), FFN replay, resident KV
  (`structure`; the test checks it against a NumPy brute force);
- timed: the dense rollout and every mode interleaved, until --frames or --seconds: the frames reached, ms per
  frame over frames 50-100 (or, short of 150 frames, the 16 after the cache filled) vs the last 50 (16) reached,
  speed-up vs dense there, component seconds (self-attention, cross-attention, FFN) vs the runtime's own dense
  pass, each mode's cache and the process RSS early and late.

    python -m benchmarks dit-table1                       # results/dit-table1/
    python benchmarks/bench_dit_table1.py --diag-frames 24 --seconds 60 --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_dit_fastar import MODES  # noqa: E402

from fastcar_compile.demo.dit_demo import MODEL_DIR, load_trained, parse_prompt  # noqa: E402
from fastcar_compile.demo.dit_train import text_embeds, to_uint8  # noqa: E402
from fastcar_compile.demo.metrics import psnr, ssim  # noqa: E402
from fastcar_compile.dit import modes  # noqa: E402
from fastcar_compile.dit.fastar import FastARDiT, calibrate_tau, totals  # noqa: E402
from fastcar_compile.dit.stream import StreamSettings, TorchDiT, rollout, rss_mib  # noqa: E402

DENSE = "dense (TorchDiT)"
# The paper's points (FAST-AR Table 1) this table is held to.
TARGETS = {"tempcache_density": 0.16, "tempcache_recall": 0.90, "annsa_density": 0.28, "annsa_recall": 0.92,
           "speedup": 5.0, "fps_flat": 0.9, "psnr": 24.0}


def _shown(value) -> str:
    """An argument as the result records it: a path inside the repository relative to its root, so the result
    names no folder of the machine it ran on."""
    if isinstance(value, Path):
        try:
            return str(value.resolve().relative_to(Path(__file__).resolve().parents[1]))
        except ValueError:
            pass
    return str(value)


def fast_settings(kw: dict, model, settings, text, **extra):
    """A mode's runtime settings; a FastCar replay ratio becomes the tau calibrated on this prompt's stream."""
    fa = modes.settings(**kw, **extra)
    if fa.fastcar_ratio is not None:
        fa = dataclasses.replace(fa, fastcar_tau=calibrate_tau(model, fa, settings, text), fastcar_ratio=None)
    return fa


def structure(model, fa, settings, text, keep_video: bool = False):
    """Density, recall, replay and resident KV of one mode's stream, with the dense attention on the side
    (and with keep_video, its uint8 frames: the side pass does not change them)."""
    rt = FastARDiT(model, dataclasses.replace(fa, diagnostics=True))
    video = [to_uint8(c.frames) for c in rollout(rt, settings, text)]
    return (totals(rt.stats), np.concatenate(video)) if keep_video else totals(rt.stats)


def interleave(bk: dict, settings, text, seconds: float | None = None) -> dict:
    """Roll every backend out chunk by chunk in turn (until settings.frames, or a round after `seconds`):
    per-frame ms, uint8 frames, the cache's MiB and the process RSS after each chunk."""
    gens = {n: rollout(b, settings, text) for n, b in bk.items()}
    res = {n: {"frame_ms": [], "video": [], "cache_mib": [], "rss_mib": []} for n in bk}
    t0 = time.perf_counter()
    while seconds is None or time.perf_counter() - t0 < seconds:
        for n, g in gens.items():
            c = next(g, None)
            if c is None:
                return res
            k = c.frames.shape[1]
            r = res[n]
            r["frame_ms"] += [1000 * c.seconds / k] * k
            r["video"].append(to_uint8(c.frames))
            r["cache_mib"] += [c.cache_bytes / 2**20] * k
            r["rss_mib"] += [rss_mib()] * k
    return res


def window_stats(ms: list[float], lo: int, hi: int) -> float:
    return float(np.median(np.asarray(ms[lo:hi])))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", type=Path, default=MODEL_DIR, help="the trained DiT's folder")
    ap.add_argument("--prompt", default="camera=pan_right", help="labels (demo --dit's FIELD=VALUE,... form)")
    ap.add_argument("--diag-frames", type=int, default=24, help="frames of the quality / diagnostics run")
    ap.add_argument("--frames", type=int, default=1000, help="frames the timed run aims for")
    ap.add_argument("--seconds", type=float, default=150.0, help="time budget of the timed run")
    ap.add_argument("--timed-modes", default="", help="comma-separated modes of the timed run besides dense "
                    "(default: every mode); with --diag-frames 0 a long timed run of a few modes alone")
    ap.add_argument("--cfg", type=float, default=2.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--png", type=Path, help="ms per frame over the timed run, density / recall per mode")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model = load_trained(a.weights)
    text = text_embeds(parse_prompt(a.prompt))
    cfg = model.cfg
    settings = StreamSettings(frames=a.frames, seed=0, cfg_scale=a.cfg)
    chosen = [n for n in a.timed_modes.split(",") if n] or list(MODES)
    unknown = sorted(set(chosen) - set(MODES))
    if unknown:
        raise SystemExit(f"error: --timed-modes {unknown[0]!r} is not a mode; modes: {', '.join(MODES)}")
    measured = list(MODES) if a.diag_frames else chosen
    fas = {name: fast_settings(MODES[name], model, settings, text) for name in measured}
    # quality and structure: every mode with the dense attention on the side (not timed)
    diag_settings = dataclasses.replace(settings, frames=a.diag_frames)
    t0 = time.perf_counter()
    diag, videos = {}, {}
    if a.diag_frames:
        dense_video = np.concatenate([to_uint8(c.frames) for c in rollout(TorchDiT(model), diag_settings, text)])
        for name, fa in fas.items():
            diag[name], videos[name] = structure(model, fa, diag_settings, text, keep_video=True)
    t_diag = time.perf_counter() - t0
    # speed: every mode interleaved chunk by chunk, until --frames or --seconds
    bk = {DENSE: TorchDiT(model), **{n: FastARDiT(model, fas[n]) for n in chosen}}
    t0 = time.perf_counter()
    timed = interleave(bk, settings, text, a.seconds)
    t_timed = time.perf_counter() - t0
    reached = len(timed[DENSE]["frame_ms"])
    if reached >= 150:
        early, late = (50, 100), (reached - 50, reached)
    else:  # short of frame 150: the 16 frames after the cache filled, and the last 16
        lo = min(cfg.sink_frames + cfg.window_frames, max(reached // 2 - 1, 0))
        early = (lo, min(lo + 16, max(lo + 1, (lo + reached) // 2)))
        late = (max(early[1], reached - 16), reached) if early[1] < reached else (reached - 1, reached)
    ref_sec = bk["dense (FAST-AR runtime)"].seconds if "dense (FAST-AR runtime)" in bk else None
    rows = []
    for name, r in timed.items():
        e, la = window_stats(r["frame_ms"], *early), window_stats(r["frame_ms"], *late)
        row = {"mode": name, "ms_early": e, "ms_late": la, "fps_early": 1000 / e, "fps_late": 1000 / la,
               "fps_late_over_early": e / la, "speedup_late": window_stats(timed[DENSE]["frame_ms"], *late) / la,
               "cache_mib_early": r["cache_mib"][early[1] - 1], "cache_mib_late": r["cache_mib"][-1]}
        if name in diag:
            video = videos[name]
            row.update({"psnr_vs_dense": psnr(video, dense_video, 255.0),
                        "ssim_vs_dense": ssim(video, dense_video, 255.0), **diag[name]})
            row["tau"] = fas[name].fastcar_tau
        if name in fas and ref_sec is not None:
            sec = bk[name].seconds
            row.update({f"{k}_speedup": (ref_sec[k] / sec[k] if sec[k] > 0 else None)
                        for k in ("self_attention", "cross_attention", "ffn")})
        row["targets"] = check_targets(row)
        rows.append(row)
    rss = timed[DENSE]["rss_mib"]
    title = (f"trained pixel DiT ({cfg.layers} blocks, hidden {cfg.hidden}, {cfg.tokens_per_frame} tokens/frame, "
             f"{cfg.sink_frames} sink + {cfg.window_frames}-frame window), prompt {a.prompt}, CFG {a.cfg:g}")
    title += (f"; quality run {a.diag_frames or 'skipped'} frames; timed run reached frame {reached}: early = frames "
              f"{early[0]}-{early[1]}, late = {late[0]}-{late[1]}; process RSS {rss[early[1] - 1]:.0f} MiB early, "
              f"{rss[-1]:.0f} MiB late")
    doc = {"title": title, "threads": a.threads, "args": {k: _shown(v) for k, v in vars(a).items()},
           "frames": {"diagnostics": a.diag_frames, "timed_reached": reached, "early": list(early),
                      "late": list(late)},
           "seconds": {"diagnostics": t_diag, "timed": t_timed},
           "rss_mib": {"early": rss[early[1] - 1], "late": rss[-1]},
           "targets": TARGETS, "rows": rows, "frame_ms": {k: v["frame_ms"] for k, v in timed.items()}}
    print_table(doc)
    if a.json:
        a.json.write_text(json.dumps(doc, indent=1) + "\n")
    if a.png:
        plot(doc, a.png)


def check_targets(row: dict) -> dict:
    """Each of the paper's points that applies to this mode: met (True) or missed (False)."""
    t, out = TARGETS, {}
    m = row["mode"]
    if m.startswith("TempCache") and row.get("self_density") is not None:
        out["density<=16% at recall>=90%"] = bool(row["self_density"] <= t["tempcache_density"]
                                                  and (row.get("self_recall") or 0) >= t["tempcache_recall"])
    if m.startswith("AnnSA") and row.get("self_density") is not None:
        out["density<=28% at recall>=92%"] = bool(row["self_density"] <= t["annsa_density"]
                                                  and (row.get("self_recall") or 0) >= t["annsa_recall"])
    if m != DENSE:
        out[">=5x at the last frames"] = bool(row["speedup_late"] >= t["speedup"])
    out["FPS flat (late >= 0.9x early)"] = bool(row["fps_late_over_early"] >= t["fps_flat"])
    if "psnr_vs_dense" in row:
        out["PSNR vs dense >= 24 dB"] = bool(row["psnr_vs_dense"] >= t["psnr"])
    return out


def print_table(doc: dict) -> None:
    def f(v, p=2):
        return "" if v is None else f"{v:.{p}f}"

    fr = doc["frames"]
    hdr = ("mode", "PSNR", "SSIM", "self dens", "self recall", "cross dens", "cross recall", "replay", "KV dens",
           "SA x", "CA x", "FFN x", f"ms/frame {fr['early'][0]}-{fr['early'][1]}",
           f"ms/frame {fr['late'][0]}-{fr['late'][1]}", "x dense late", "FPS late/early")
    print("| " + " | ".join(hdr) + " |\n|" + "---|" * len(hdr))
    for r in doc["rows"]:
        print("| " + " | ".join([r["mode"], f(r.get("psnr_vs_dense"), 1), f(r.get("ssim_vs_dense"), 3),
                                 *(f(r.get(k)) for k in ("self_density", "self_recall", "cross_density",
                                                         "cross_recall", "replay_ratio", "kv_density",
                                                         "self_attention_speedup", "cross_attention_speedup",
                                                         "ffn_speedup")),
                                 f(r["ms_early"], 0), f(r["ms_late"], 0), f(r["speedup_late"]),
                                 f(r["fps_late_over_early"])]) + " |")
    print(f"{doc['title']}; frames {fr}; RSS MiB {doc['rss_mib']}")


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(13, 4.5))
    for name, ms in doc["frame_ms"].items():
        k = min(10, len(ms))
        ax[0].plot(np.convolve(ms, np.ones(k) / k, mode="valid"), label=name, lw=1)
    ax[0].set_xlabel("frame")
    ax[0].set_ylabel("ms per frame (10-frame mean)")
    ax[0].legend(fontsize=7)
    rows = [r for r in doc["rows"] if r.get("self_density") is not None]
    x = np.arange(len(rows))
    for i, key in enumerate(("self_density", "self_recall", "cross_density", "cross_recall", "replay_ratio")):
        ax[1].bar(x + (i - 2) * 0.16, [np.nan if r.get(key) is None else r[key] for r in rows], 0.16, label=key)
    ax[1].set_xticks(x, [r["mode"].split(" (")[0] for r in rows], rotation=30, ha="right", fontsize=7)
    ax[1].legend(fontsize=7)
    fig.suptitle(doc["title"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    from fastcar_compile.core.errors import FastCarError

    try:
        main()
    except FastCarError as exc:  # e.g. the trained weights are missing: one line, no traceback
        raise SystemExit(f"error: {exc}") from None
