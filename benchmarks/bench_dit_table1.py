"""FAST-AR's Table 1 on the causal video DiT trained here (training/dit_model/): per mode, quality vs the
dense rollout, density and recall, component and end-to-end speed-up, FPS and memory early (frames 50-150) vs
late (the last 100: 900-1000 at frame 1000).

The baseline is the paper's: the dense rollout whose KV cache grows (every frame attends to every earlier
frame, `window_frames` 0), which slows down and grows in memory as the video goes on. The model's own capped
context (its sink frames + a rolling window) is an extra row: as cheap as a bounded cache, but it forgets.
The modes run on the full context too, their own compression bounding the cache (TempCache's merges with its
slot budget, --tempcache-budget; AnnSA / AnnCA / FastCar alone leave the cache growing).

Every mode streams the same labelled prompt with the same noise seed (the eager FAST-AR runtime,
fastcar_compile.dit.fastar; the dense eager rollout, TorchDiT, is the reference and the baseline), one chunk of
each in turn so all see the same machine load. Two runs:
- quality and structure, over --paths held-out paths (path k: a camera label of its own and noise seed k + 1;
  FastCar's tau is calibrated on the timed run's prompt and seed 0, never on a held-out path): every mode for
  --diag-frames frames with a dense attention on the side: PSNR / SSIM of the RGB video vs the full-context
  dense one of the same path, self/cross density (executed q.k pairs / dense pairs) and recall (the dense
  softmax mass the mode keeps), FFN replay, resident KV (`structure`; the test checks it against a NumPy brute
  force); each as the mean over the paths with the half width of its 95% interval (Student t);
- timed: frame by frame in lockstep, the --long-modes and the capped dense rollout to --frames, the other modes
  to the end of the early window; the full-context dense rollout for real to --dense-frames, and past that
  (it takes ~2.3 s per frame at frame 1000 on one core: ~25 minutes to get there) --dense-late-chunks chunks in
  the late window, each over a cache holding the K/V of every earlier frame as the capped rollout's clean pass
  wrote them (the dense step's cost depends on the cache's length, not its values). Per mode: ms per frame
  early and late, speed-up vs dense there, component seconds over the first frames vs the runtime's own dense
  pass, the cache's MiB early and late, the process RSS.

    python -m benchmarks dit-table1                       # results/dit-table1/
    python -m benchmarks dit-table1 --size full           # every mode and the dense rollout for real to 1000
    python benchmarks/bench_dit_table1.py --diag-frames 24 --frames 300 --json out.json
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

from fastcar_compile.cli.demo_dit import MODEL_DIR, load_trained, parse_prompt  # noqa: E402
from fastcar_compile.core.atomic import write_text  # noqa: E402
from fastcar_compile.demo.dit_train import text_embeds, to_uint8  # noqa: E402
from fastcar_compile.demo.metrics import psnr, ssim  # noqa: E402
from fastcar_compile.dit import modes  # noqa: E402
from fastcar_compile.dit.cache import FrameCache  # noqa: E402
from fastcar_compile.dit.fastar import FastARDiT, calibrate_tau, totals  # noqa: E402
from fastcar_compile.dit.stream import (  # noqa: E402
    StreamSettings,
    TorchDiT,
    generate_chunk,
    prompt_rows,
    rollout,
    rss_mib,
)

DENSE = "dense, full context (TorchDiT)"
CAPPED = "dense, capped context (TorchDiT)"
RUNTIME_DENSE = "dense (FAST-AR runtime)"
ALL = "all (TempCache-LSH + AnnSA-LSH + AnnCA where they pay)"
LONG_MODES = (ALL,)  # the default size's mode rolled out to --frames (besides the capped dense): the target's
# The paper's points (FAST-AR Table 1) this table is held to; memory flat: the cache late <= 1.1x early.
TARGETS = {"tempcache_density": 0.16, "tempcache_recall": 0.90, "annsa_density": 0.28, "annsa_recall": 0.92,
           "speedup": 5.0, "fps_flat": 0.9, "memory_flat": 1.1, "psnr": 24.0}
EARLY = (50, 150)  # the paper's early frames; late = the last LATE_SPAN frames reached
LATE_SPAN = 100
PSNR_CAP = 100.0  # dB: identical videos (infinite PSNR) count as this in the means over paths


def frame_windows(reached: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(early, late) frame ranges [lo, hi) of a run that reached `reached` frames: frames 50-150 and the last
    100 (900-1000 at frame 1000); a run too short for both (under 250 frames), its second and last fifths."""
    if reached >= EARLY[1] + LATE_SPAN:
        return EARLY, (reached - LATE_SPAN, reached)
    n = max(1, reached // 5)
    return (n, 2 * n), (reached - n, reached)


def late_starts(late: tuple[int, int], chunk: int, n: int) -> list[int]:
    """`n` chunk starts spread over the late window (first, last and evenly between), chunk-aligned."""
    first, last = -(-late[0] // chunk) * chunk, (late[1] - chunk) // chunk * chunk
    if last < first:
        return [max(0, last)]
    return sorted({int(round(x / chunk)) * chunk for x in np.linspace(first, last, max(1, n))})


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
    if fa.calibrate_replay is not None:
        fa = dataclasses.replace(fa, threshold=calibrate_tau(model, fa, settings, text), calibrate_replay=None)
    return fa


def structure(model, fa, settings, text, keep_video: bool = False):
    """Density, recall, replay and resident KV of one mode's stream, with the dense attention on the side
    (and with keep_video, its uint8 frames: the side pass does not change them)."""
    rt = FastARDiT(model, dataclasses.replace(fa, diagnostics=True))
    video = [to_uint8(c.frames) for c in rollout(rt, settings, text)]
    return (totals(rt.stats), np.concatenate(video)) if keep_video else totals(rt.stats)


class ArchivingCache(FrameCache):
    """The model's capped cache that also hands every frame's K/V, as the clean pass wrote them, to `archive`
    (a FrameCache keeping every frame): the cache the full-context dense step is timed over, late."""

    archive: FrameCache

    def write(self, first_frame: int, kv: list) -> None:
        self.archive.write(first_frame, kv)
        super().write(first_frame, kv)


class ArchivedDiT(TorchDiT):
    """The eager model with an ArchivingCache (the capped-context dense rollout of the timed run)."""

    def __init__(self, model, archive: FrameCache):
        super().__init__(model)
        self.archive = archive

    def new_cache(self, layers: int, tokens: int, sinks: int, window: int) -> FrameCache:
        cache = ArchivingCache(layers, tokens, sinks, window)
        cache.archive = self.archive
        return cache


def dense_full_context(model, settings, text, real_frames: int, sampled: list[int], archive: FrameCache | None):
    """The full-context dense rollout (window 0): chunk by chunk for real to `real_frames`, then one chunk at
    each start in `sampled` over a cache of every earlier frame's K/V taken from `archive` (as another rollout
    wrote them; yielded only when the caller has archived those frames)."""
    backend, cfg = TorchDiT(model), model.cfg
    cross = backend.text_kv(prompt_rows(cfg, text, settings.cfg_scale != 1.0, settings.seed))
    cache = FrameCache(cfg.layers, cfg.tokens_per_frame, cfg.sink_frames, 0)
    rng = np.random.default_rng(settings.seed)
    for start in range(0, real_frames, cfg.chunk_frames):
        yield generate_chunk(backend, settings, start, cache, cross, rng)
    del cache
    for start in sampled:
        late = FrameCache(cfg.layers, cfg.tokens_per_frame, cfg.sink_frames, 0)
        late.frames = {f: archive.frames[f] for f in range(start)}  # shared, not copied
        late.written = start
        yield generate_chunk(backend, settings, start, late, cross, rng)


def lockstep(schedule: dict, frames: int, chunk: int, seconds: float | None, snapshot_at: int,
             runtimes: dict) -> tuple[dict, int]:
    """Run every backend's chunks frame by frame in turn: at each chunk start, each backend whose schedule
    holds it runs its next chunk. Per backend and frame: ms (NaN where not run), uint8 frames, cache MiB,
    process RSS; `runtimes`' component seconds snapshotted once the frames before `snapshot_at` are done.
    Returns (results, frames reached)."""
    res = {n: {"frame_ms": np.full(frames, np.nan), "cache_mib": np.full(frames, np.nan),
               "rss_mib": np.full(frames, np.nan), "video": [], "components": None} for n in schedule}
    t0 = time.perf_counter()
    reached = 0
    for start in range(0, frames, chunk):
        if seconds and time.perf_counter() - t0 > seconds:
            break
        for name, (gen, starts) in schedule.items():
            if start not in starts:
                continue
            c = next(gen)
            k = c.frames.shape[1]
            sl = slice(c.first_frame, c.first_frame + k)
            r = res[name]
            r["frame_ms"][sl] = 1000 * c.seconds / k
            r["cache_mib"][sl] = c.cache_bytes / 2**20
            r["rss_mib"][sl] = rss_mib()
            r["video"].append(to_uint8(c.frames))
        reached = start + chunk
        if reached == snapshot_at:
            for name, rt in runtimes.items():
                res[name]["components"] = dict(rt.seconds)
    for name, rt in runtimes.items():
        if res[name]["components"] is None:
            res[name]["components"] = dict(rt.seconds)
    return res, min(reached, frames)


def window_ms(ms: np.ndarray, lo: int, hi: int) -> float | None:
    """Median ms per frame over frames [lo, hi) that ran (None: none did)."""
    part = ms[lo:hi]
    part = part[np.isfinite(part)]
    return float(np.median(part)) if part.size else None


def last_value(a: np.ndarray, hi: int) -> float | None:
    """The last measured value before frame hi."""
    part = a[:hi][np.isfinite(a[:hi])]
    return float(part[-1]) if part.size else None


def main() -> None:
    budget = modes.BY_NAME["tempcache_budget"]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", type=Path, default=MODEL_DIR, help="the trained DiT's folder")
    ap.add_argument("--prompt", default="camera=pan_right", help="labels (demo --dit's FIELD=VALUE,... form)")
    ap.add_argument("--diag-frames", type=int, default=24, help="frames of the quality / diagnostics run")
    ap.add_argument("--paths", type=int, default=16, help="held-out paths (prompt, noise seed) of the quality run")
    ap.add_argument("--frames", type=int, default=1000, help="frames the long rollouts reach")
    ap.add_argument("--seconds", type=float, default=0.0, help="stop the timed run after this long (0: never)")
    ap.add_argument("--long-modes", default=",".join(LONG_MODES), help="comma-separated modes rolled out to "
                    "--frames besides the capped dense rollout ('every': all); the others stop after the early "
                    f"window (default: {', '.join(LONG_MODES)})")
    ap.add_argument("--dense-frames", type=int, default=0, help="frames the full-context dense rollout runs for "
                    "real (default: to the end of the early window); past them, --dense-late-chunks chunks in "
                    "the late window over the archived cache")
    ap.add_argument("--dense-late-chunks", type=int, default=3, help="timed full-context dense chunks late")
    ap.add_argument(budget.flag, type=int, default=None, metavar=budget.metavar,
                    help=f"{budget.help} (here default: the model's window_frames, the capped cache's size)")
    ap.add_argument("--cfg", type=float, default=2.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--png", type=Path, help="ms per frame over the timed run, density / recall per mode")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model = load_trained(a.weights)
    text = text_embeds(parse_prompt(a.prompt))
    cfg = model.cfg
    chunk = cfg.chunk_frames
    a.tempcache_budget = cfg.window_frames if a.tempcache_budget is None else a.tempcache_budget
    full = StreamSettings(frames=a.frames, seed=0, cfg_scale=a.cfg, window_frames=0)
    capped = dataclasses.replace(full, window_frames=None)  # the model's sinks + window
    long_modes = list(MODES) if a.long_modes == "every" else [n for n in a.long_modes.split(",") if n]
    unknown = sorted(set(long_modes) - set(MODES))
    if unknown:
        raise SystemExit(f"error: --long-modes {unknown[0]!r} is not a mode; modes: {', '.join(MODES)}")

    def mode_settings(kw):
        extra = {"tempcache_budget": a.tempcache_budget} if kw.get("tempcache") else {}
        return fast_settings(kw, model, full, text, **extra)

    fas = {name: mode_settings(kw) for name, kw in MODES.items()}
    # quality and structure over held-out paths: every mode with the dense attention on the side (not timed)
    t0 = time.perf_counter()
    paths = held_out_paths(a.paths) if a.diag_frames else []
    per_path: dict[str, list[dict]] = {}
    for prompt, seed in paths:
        ptext = text_embeds(parse_prompt(prompt))
        d_full = dataclasses.replace(full, frames=a.diag_frames, seed=seed)
        dense_video = np.concatenate([to_uint8(c.frames) for c in rollout(TorchDiT(model), d_full, ptext)])
        chunks = list(rollout(TorchDiT(model), dataclasses.replace(capped, frames=a.diag_frames, seed=seed), ptext))
        video = np.concatenate([to_uint8(c.frames) for c in chunks])
        runs = {CAPPED: ({"kv_density": len(chunks[-1].resident) / a.diag_frames}, video)}
        for name, fa in fas.items():
            runs[name] = structure(model, fa, d_full, ptext, keep_video=True)
        for name, (numbers, video) in runs.items():
            per_path.setdefault(name, []).append({**numbers, "psnr_vs_dense": min(psnr(video, dense_video, 255.0),
                                                                                  PSNR_CAP),
                                                  "ssim_vs_dense": ssim(video, dense_video, 255.0)})
    diag = {name: mean_with_interval(rows) for name, rows in per_path.items()}
    t_diag = time.perf_counter() - t0

    # speed: frame by frame in lockstep
    early_plan = frame_windows(a.frames)[0]
    short_end = -(-early_plan[1] // chunk) * chunk
    dense_real = min(a.frames, a.dense_frames or short_end)
    sampled = late_starts(frame_windows(a.frames)[1], chunk, a.dense_late_chunks) if dense_real < a.frames else []
    sampled = [s for s in sampled if s >= dense_real]
    archive = FrameCache(cfg.layers, cfg.tokens_per_frame, cfg.sink_frames, 0) if sampled else None
    runtimes = {n: FastARDiT(model, fas[n]) for n in MODES}
    capped_backend = ArchivedDiT(model, archive) if archive is not None else TorchDiT(model)
    every = range(0, a.frames, chunk)
    schedule = {DENSE: (dense_full_context(model, full, text, dense_real, sampled, archive),
                        set(range(0, dense_real, chunk)) | set(sampled)),
                CAPPED: (rollout(capped_backend, capped, text), set(every))}
    for name, rt in runtimes.items():
        limit = a.frames if name in long_modes else min(a.frames, short_end)
        schedule[name] = (rollout(rt, dataclasses.replace(full, frames=limit), text), set(range(0, limit, chunk)))
    t0 = time.perf_counter()
    timed, reached = lockstep(schedule, a.frames, chunk, a.seconds, short_end, runtimes)
    t_timed = time.perf_counter() - t0
    early, late = frame_windows(reached)
    dense_ms = timed[DENSE]["frame_ms"]
    ref_sec = timed[RUNTIME_DENSE]["components"]
    rows = []
    for name, r in timed.items():
        ms = r["frame_ms"]
        e, la = window_ms(ms, *early), window_ms(ms, *late)
        de, dl = window_ms(dense_ms, *early), window_ms(dense_ms, *late)
        ce, cl = last_value(r["cache_mib"], early[1]), last_value(r["cache_mib"], late[1]) if la else None
        row = {"mode": name, "context": "capped" if name == CAPPED else "full",
               "frames_run": int(np.isfinite(ms).sum()), "ms_early": e, "ms_late": la,
               "fps_early": 1000 / e if e else None, "fps_late": 1000 / la if la else None,
               "fps_late_over_early": e / la if e and la else None,
               "speedup_early": de / e if de and e else None, "speedup_late": dl / la if dl and la else None,
               "speedup_late_vs_capped": (window_ms(timed[CAPPED]["frame_ms"], *late) / la) if la else None,
               "cache_mib_early": ce, "cache_mib_late": cl,
               "cache_late_over_early": cl / ce if cl and ce else None}
        if name in diag:
            row.update(diag[name])
        if name in fas:
            row["tau"] = fas[name].threshold
            sec = r["components"]
            row.update({f"{k}_speedup": (ref_sec[k] / sec[k] if sec[k] > 0 else None)
                        for k in ("self_attention", "cross_attention", "ffn")})
        row["targets"] = check_targets(row)
        rows.append(row)
    rss = timed[CAPPED]["rss_mib"]
    title = (f"trained pixel DiT ({cfg.layers} blocks, hidden {cfg.hidden}, {cfg.tokens_per_frame} tokens/frame), "
             f"timed prompt {a.prompt}, CFG {a.cfg:g}; quality over {len(paths)} held-out paths (every camera label, "
             f"seeds 1-{len(paths)}); full context = every frame cached, capped = the model's "
             f"{cfg.sink_frames} sink + {cfg.window_frames}-frame window; TempCache budget {a.tempcache_budget} "
             f"frames of slots; quality run {a.diag_frames or 'skipped'} frames; timed run to frame {reached}: "
             f"early = frames {early[0]}-{early[1]}, late = {late[0]}-{late[1]}; full-context dense for real to "
             f"frame {dense_real}" + (f", late at chunks {sampled} over the archived cache" if sampled else "") +
             f"; process RSS {last_value(rss, early[1]):.0f} MiB early, {last_value(rss, late[1]):.0f} MiB late")
    doc = {"title": title, "threads": a.threads, "args": {k: _shown(v) for k, v in vars(a).items()},
           "paths": [{"prompt": pr, "seed": sd} for pr, sd in paths],
           "frames": {"diagnostics": a.diag_frames, "timed_reached": reached, "early": list(early),
                      "late": list(late), "dense_real": dense_real, "dense_sampled": sampled},
           "seconds": {"diagnostics": t_diag, "timed": t_timed},
           "rss_mib": {"early": last_value(rss, early[1]), "late": last_value(rss, late[1])},
           "targets": TARGETS, "rows": rows,
           "frame_ms": {k: [None if not np.isfinite(x) else float(x) for x in v["frame_ms"][:reached]]
                        for k, v in timed.items()}}
    print_table(doc)
    if a.json:
        write_text(a.json, json.dumps(doc, indent=1) + "\n")
    if a.png:
        plot(doc, a.png)


def held_out_paths(n: int) -> list[tuple[str, int]]:
    """n (prompt, noise seed) paths of the quality run: the camera labels in turn (the other labels the demo's
    defaults), seeds 1, 2, ... (seed 0 and the timed prompt calibrate FastCar's tau)."""
    from fastcar_compile.demo.scenes import LABELS

    cams = LABELS["camera"]
    return [(f"camera={cams[k % len(cams)]}", k + 1) for k in range(n)]


def mean_with_interval(rows: list[dict]) -> dict:
    """Every number of the per-path dicts as its mean over the paths, `<key>_ci` the half width of its 95%
    interval (Student t; None below 2 paths or where a path lacks it), `paths` the count and `per_path` the rows."""
    from fastcar_compile.runtime.calib_stats import ci95

    out: dict = {"paths": len(rows), "per_path": rows}
    for key in rows[0]:
        values = [r[key] for r in rows]
        if all(isinstance(v, int | float) and v is not None and np.isfinite(v) for v in values):
            out[key] = float(np.mean(values))
            out[f"{key}_ci"] = ci95(np.asarray(values, float)) if len(values) > 1 else None
        else:
            out[key] = None
    return out


def check_targets(row: dict) -> dict:
    """Each of the paper's points that applies to this mode: met (True) or missed (False); the late ones only
    where the mode ran to the late window."""
    t, out = TARGETS, {}
    m = row["mode"]
    if m.startswith("TempCache") and row.get("self_density") is not None:
        out["density<=16% at recall>=90%"] = bool(row["self_density"] <= t["tempcache_density"]
                                                  and (row.get("self_recall") or 0) >= t["tempcache_recall"])
    if m.startswith("AnnSA") and row.get("self_density") is not None:
        out["density<=28% at recall>=92%"] = bool(row["self_density"] <= t["annsa_density"]
                                                  and (row.get("self_recall") or 0) >= t["annsa_recall"])
    if m != DENSE and row["speedup_late"] is not None:
        out[">=5x vs full-context dense, late"] = bool(row["speedup_late"] >= t["speedup"])
    if row["fps_late_over_early"] is not None:
        out["FPS flat (late >= 0.9x early)"] = bool(row["fps_late_over_early"] >= t["fps_flat"])
    if row["cache_late_over_early"] is not None:
        out["memory flat (cache late <= 1.1x early)"] = bool(row["cache_late_over_early"] <= t["memory_flat"])
    if row.get("psnr_vs_dense") is not None:
        out["PSNR vs dense >= 24 dB"] = bool(row["psnr_vs_dense"] >= t["psnr"])
    return out


def print_table(doc: dict) -> None:
    def f(v, p=2):
        return "" if v is None else f"{v:.{p}f}"

    fr = doc["frames"]
    hdr = ("mode", "PSNR", "SSIM", "self dens", "self recall", "cross dens", "cross recall", "replay", "KV dens",
           "SA x", "CA x", "FFN x", f"ms/frame {fr['early'][0]}-{fr['early'][1]}",
           f"ms/frame {fr['late'][0]}-{fr['late'][1]}", "x dense late", "x capped late", "FPS late/early",
           "cache MiB early", "cache MiB late")
    print("| " + " | ".join(hdr) + " |\n|" + "---|" * len(hdr))
    for r in doc["rows"]:
        print("| " + " | ".join([r["mode"], f(r.get("psnr_vs_dense"), 1), f(r.get("ssim_vs_dense"), 3),
                                 *(f(r.get(k)) for k in ("self_density", "self_recall", "cross_density",
                                                         "cross_recall", "replay_ratio", "kv_density",
                                                         "self_attention_speedup", "cross_attention_speedup",
                                                         "ffn_speedup")),
                                 f(r["ms_early"], 0), f(r["ms_late"], 0), f(r["speedup_late"]),
                                 f(r["speedup_late_vs_capped"]), f(r["fps_late_over_early"]),
                                 f(r["cache_mib_early"]), f(r["cache_mib_late"])]) + " |")
    print(f"{doc['title']}; RSS MiB {doc['rss_mib']}")


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(13, 4.5))
    for name, ms in doc["frame_ms"].items():
        y = np.array([np.nan if v is None else v for v in ms], dtype=float)  # gaps (not run) break the line
        style = dict(marker="o", ms=3) if name == DENSE else {}
        ax[0].plot(np.arange(y.size), y, label=name, lw=1, **style)
    ax[0].set_yscale("log")
    ax[0].set_xlabel("frame")
    ax[0].set_ylabel("ms per frame (log)")
    ax[0].legend(fontsize=6)
    rows = [r for r in doc["rows"] if r.get("self_density") is not None]
    x = np.arange(len(rows))
    for i, key in enumerate(("self_density", "self_recall", "cross_density", "cross_recall", "replay_ratio")):
        ax[1].bar(x + (i - 2) * 0.16, [np.nan if r.get(key) is None else r[key] for r in rows], 0.16, label=key)
    ax[1].set_xticks(x, [r["mode"].split(" (")[0] for r in rows], rotation=30, ha="right", fontsize=7)
    ax[1].legend(fontsize=7)
    fig.suptitle(doc["title"], fontsize=7, wrap=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    from fastcar_compile.core.errors import FastCarError

    try:
        main()
    except FastCarError as exc:  # e.g. the trained weights are missing: one line, no traceback
        raise SystemExit(f"error: {exc}") from None
