"""The conditioned video model (training/video_model/) measured as a user decodes it: sampled with CFG, dense
against FastCar and FAST-AR, against the truth and against repeating the last given frame.

    python benchmarks/video_model.py --out DIR              # 16 held-out clips x 16 frames (~30 min on 2 cores)
    python benchmarks/video_model.py --quick --out DIR      # 1 clip x 6 frames, fewer configurations

What it measures, on the same held-out clips and sampler seeds (held-out clip k: `clip_seed(0, k)` for every model,
k its index in the held-out split, whichever clips a run picks), each quality figure as the mean over the clips
with its 95% interval (Student t; differences between two videos of the same clip: the interval of the paired
per-clip differences):
- **tau / quality / speed**: taus calibrated on training-split clips (TAS quantiles of their sampled dense
  videos, `--calib-clips`) for `--targets` replay ratios, one tau for all layers (the paper's) and one per layer
  (each layer's own quantile); per configuration the replay per layer, PSNR / copy rate vs the truth, the bare
  ORT time per token against dense (each model run on its own, order rotating: `video.ort_alone_ms`);
- **FAST-AR** density and recall per layer and mode, measured by the compiled `ai.fastcar` op itself
  (`--kv-diagnostics`: dense attention on the side) inside the same sampled generation (TempCache, AnnSA by sign
  LSH, prompt pruning = AnnCA's decoder-only counterpart), and each mode's video quality;
- **FPGA simulation** of this model (fpga_backend, U280) fed with the replay decisions recorded while it decoded
  (`VideoRun.replay_rows`, both CFG rows), against the dense program over the same steps;
- the pictures: GIF and strip (truth | dense | FastCar | FAST-AR | replay map), the replay heatmap, replay per
  layer, the tau curve and density / recall against the paper's points.

Writes OUT/video_model.json and the pictures (`python -m benchmarks video-model` copies them to results/).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fastar_recall import PAPER, plot_paper_points  # noqa: E402

SEED = 0


def fastar_modes(L: int, tokens: int) -> dict[str, dict]:
    """FAST-AR modes as compiler options (every layer; budget above the context = no eviction). Every window
    covers a frame: the FastCar gate reads the key one frame back from the cache."""
    big = tokens + 8
    return {
        "TempCache 0.9": {"kv_budget": big, "kv_window": L, "tempcache": 0.9},
        "AnnSA lsh 8x4 S4+W64": {"kv_budget": big, "kv_sinks": 4, "kv_window": L, "sparse_attention": "lsh:8x4"},
        "AnnCA (prune-prompt 0.01)": {"kv_budget": big, "kv_window": L, "prune_prompt": 0.01},
        "TempCache 0.9 + AnnSA 8x4": {"kv_budget": big, "kv_sinks": 4, "kv_window": L, "tempcache": 0.9,
                                      "sparse_attention": "lsh:8x4"},
    }


def quantile_taus(tas: np.ndarray, target: float) -> tuple[float, list[float]]:
    """(one tau for all layers, one per layer) at which `target` of the TAS values [steps, layers] exceed tau
    (replay is TAS > tau)."""
    q = 1.0 - target
    return float(np.quantile(tas, q)), [float(np.quantile(tas[:, i], q)) for i in range(tas.shape[1])]


def configs(tas: np.ndarray, targets: list[float]) -> dict[str, list[float]]:
    """FastCar configurations: name -> per-layer taus."""
    n = tas.shape[1]
    out = {"tau=+inf (0%)": [np.inf] * n}
    for t in targets:
        g, per = quantile_taus(tas, t)
        out[f"one tau, {t:.0%}"] = [g] * n
        out[f"per-layer tau, {t:.0%}"] = per
    if 0.8 in targets:  # one tau, layer 0 kept dense: does layer 0's replay alone change the videos?
        g, _ = quantile_taus(tas, 0.8)
        out["one tau 80%, layer 0 off"] = [np.inf] + [g] * (n - 1)
    out["tau=-inf (100%)"] = [-np.inf] * n
    return out


def fpga(fast_onnx: Path, runs: list, video_start: int, stride: int) -> list[dict]:
    """Simulated U280 cycles of this model's FastCar program fed with the recorded replay of each configuration
    (every `stride`-th decode step), against the dense program over the same steps."""
    from fastcar_compile.fpga_backend import build_program, load_board
    from fastcar_compile.fpga_backend.simulate import Simulator

    board = load_board("u280")
    rows = []
    first = runs[0][1][0]
    batch = first.replay_rows.shape[2]
    ctx_max = int(max(r.positions.max() for _, rs in runs for r in rs)) + 1
    fast = Simulator(build_program(fast_onnx, board, batch=batch, context=ctx_max, video_start=video_start))
    dense = Simulator(build_program(fast_onnx, board, batch=batch, context=ctx_max, video_start=video_start,
                                    dense=True))
    for name, rs in runs:
        rep = np.concatenate([r.replay_rows[::stride] for r in rs])
        ctx = np.concatenate([r.positions[::stride] + 1 for r in rs])
        full = np.zeros((len(ctx), fast.num_layers, batch), bool)
        full[:, : rep.shape[1]] = rep
        d = dense.run(np.zeros_like(full), ctx, policy="static")
        f = fast.run(full, ctx, policy="drs")
        rows.append({"config": name, "replay": f.replay_ratio, "steps": len(ctx), "us_per_step": 1e6 * f.seconds / len(ctx),
                     "dense_us_per_step": 1e6 * d.seconds / len(ctx), "x_dense": d.cycles / f.cycles, "bound": f.bound})
    return rows


def parse_clips(text: str) -> list[int]:
    """Held-out clip indices from '0-15' (a range, both ends included), '0,3' or a mix ('0-3,8')."""
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi) + 1)) if hi else [int(lo)]
    if not out or min(out) < 0 or len(set(out)) != len(out):
        raise SystemExit(f"--clips {text!r}: distinct non-negative clip indices, e.g. 0-15 or 0,3")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clips", default="0-15", help="held-out clip indices, e.g. 0-15 or 0,3 (default 0-15: every "
                    "4th a clean pan, whose camera shift the pan check recovers)")
    ap.add_argument("--frames", type=int, default=16, help="frames per clip incl. the given frame 0 (default 16)")
    ap.add_argument("--calib-clips", type=int, default=1, help="training-split clips the taus are calibrated on")
    ap.add_argument("--targets", default="0.5,0.8", help="replay ratios to calibrate taus for")
    ap.add_argument("--timed-clips", type=int, default=1, help="clips whose decode steps are re-timed in bare ORT")
    ap.add_argument("--fastar-clips", type=int, default=16, help="of those clips, how many each FAST-AR mode generates")
    ap.add_argument("--gif-clips", type=int, default=2, help="of those clips, how many the GIF and strip show")
    ap.add_argument("--fpga-stride", type=int, default=8, help="simulate every N-th decode step")
    ap.add_argument("--quick", action="store_true", help="1 clip x 6 frames, targets 0.5,0.8, two FAST-AR modes")
    ap.add_argument("--out", type=Path, required=True, help="output folder")
    a = ap.parse_args(argv)
    if a.quick:
        a.clips, a.frames, a.calib_clips, a.targets, a.fpga_stride, a.fastar_clips = "0", 6, 1, "0.5,0.8", 16, 1
        a.gif_clips = 1
    targets = [float(t) for t in a.targets.split(",")]
    a.out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    raw = measure(a, targets)
    raw["seconds"] = time.perf_counter() - t_start
    from fastcar_compile.core.atomic import write_text

    write_text(a.out / "video_model.json", json.dumps(raw, indent=1, default=float) + "\n")
    print(f"wrote {a.out}/video_model.json and pictures ({raw['seconds']:.0f} s)", file=sys.stderr)
    return 0


def measure(a, targets: list[float]) -> dict:
    import fastcar_compile
    from fastcar_compile.demo import quality as q
    from fastcar_compile.demo import scenes
    from fastcar_compile.demo.bundled import spec as demo_spec
    from fastcar_compile.demo.decoding import clip_seed
    from fastcar_compile.demo.evaluate import ClipResult, mixture_ms
    from fastcar_compile.demo.video import generate_video, open_session, ort_alone_ms

    spec = demo_spec("video")
    tok = spec.tokenizer()
    L = tok.tokens_per_frame
    onnx = spec.onnx()
    dec = spec.decoding
    ids = parse_clips(a.clips)
    every = spec.clips(max(ids) + 1, a.frames, SEED)
    clips = [every[i] for i in ids]
    a.fastar_clips = min(a.fastar_clips, len(clips))
    calib = [scenes.make_scene_clip("train", i, a.frames, SEED) for i in range(a.calib_clips)]
    a.timed_clips = min(a.timed_clips, len(clips))
    work = a.out / "models"
    work.mkdir(exist_ok=True)

    def gen(sess, c, k, thr=None):  # k: the clip's identity (its index in its split), never its place in `clips`
        return generate_video(sess, spec.prompt(c), tok.encode(c.frames)[0], len(c.frames) - 1, threshold=thr,
                              decoding=dec, seed=clip_seed(SEED, k), uncond_ids=spec.uncond, codes=spec.codes)

    # 1. calibration: TAS along sampled dense videos of training-split clips (tau=+inf never replays). The
    # FastCar model carries the TAS outputs (emit_diagnostics: one [batch, 1] output per layer, no other change),
    # so every run below records the TAS its decisions came from.
    fast_path = work / "fast.onnx"
    fastcar_compile.compile(str(onnx), output=str(fast_path), frame_tokens=L, threshold=0.0, per_layer_threshold=True,
                            emit_diagnostics=True, fused_attention=None, fusions=False)
    dense_s, fast_s = open_session(onnx), open_session(fast_path)
    tas = np.concatenate([gen(fast_s, c, 1000 + i, np.inf).tas for i, c in enumerate(calib)])
    cfgs = configs(tas, targets)
    tas_stats = {"median_per_layer": np.median(tas, axis=0).tolist(),
                 "q10_per_layer": np.quantile(tas, 0.1, axis=0).tolist(),
                 "q90_per_layer": np.quantile(tas, 0.9, axis=0).tolist()}

    # 2. dense and every FastCar configuration on the held-out clips; bare-ORT timing rotating the order
    names = list(cfgs)
    dense_runs, fast_runs = [], {n: [] for n in names}
    ort: dict[str, list] = {n: [] for n in ["dense", *names]}
    for i, c in enumerate(clips):
        d = gen(dense_s, c, ids[i])
        dense_runs.append(d)
        pre = spec.prompt(c)
        runs = {n: gen(fast_s, c, ids[i], cfgs[n]) for n in names}
        for n in names:
            fast_runs[n].append(runs[n])
        timed = [("dense", dense_s, d, None)] + [(n, fast_s, runs[n], cfgs[n]) for n in names]
        for k in range(len(timed) if i < a.timed_clips else 0):
            n, sess, run, thr = timed[(i + k) % len(timed)]
            seq = np.stack([np.concatenate([p, run.tokens.reshape(-1)]) for p in (pre, spec.uncond)])
            ort[n].append(ort_alone_ms(sess, seq, len(pre) + L, thr, spec.video_start))
    del dense_s
    dense_ms = mixture_ms(ort["dense"], [np.zeros((len(t), 0)) for t in ort["dense"]])
    timed_runs = {n: fast_runs[n][: a.timed_clips] for n in names}
    inf_ms = mixture_ms(ort[names[0]], [r.replay for r in timed_runs[names[0]]])
    curve = []
    per_clip_q = {}
    for n in names:
        pcs = [q.clip_quality(c.frames, tok.encode(c.frames), d.tokens, f.tokens, tok.decode, c)
               for c, d, f in zip(clips, dense_runs, fast_runs[n], strict=True)]
        replay = float(np.mean([r.replay_ratio for r in fast_runs[n]]))
        s = q.summarize_quality(pcs, replay)
        per_clip_q[n] = pcs
        ms = mixture_ms(ort[n], [r.replay for r in timed_runs[n]])
        per_layer = np.mean([r.replay.mean(axis=0) for r in fast_runs[n]], axis=0)
        curve.append({"config": n, "taus": [float(t) for t in cfgs[n]], "replay": replay,
                      "tas_median_per_layer": np.median(np.concatenate([r.tas for r in fast_runs[n]]), axis=0).tolist(),
                      "replay_per_layer": per_layer.tolist(), "ms": ms, "x_dense": dense_ms / ms,
                      "x_graph": dense_ms / inf_ms, "x_replay": inf_ms / ms, "token_agreement": float(np.mean(
                          [(d.tokens[1:] == f.tokens[1:]).mean() for d, f in zip(dense_runs, fast_runs[n], strict=True)])),
                      **{k: s[k] for k in ("psnr_fast_vs_truth", "psnr_dense_vs_truth", "psnr_repeat_last_vs_truth",
                                           "psnr_fast_vs_dense", "copy_rate_fast", "copy_rate_dense",
                                           "copy_rate_truth", "token_acc_fast", "token_acc_dense",
                                           "frozen_fraction_fast", "frozen_fraction_dense", "pan_match_dense",
                                           "pan_match_fast", "pan_match_truth", "psnr_tokenizer", "fast_minus_dense_db",
                                           "fast_minus_dense_db_clips_above", "ci95", "clips")}})
        print(f"  {n}: replay {replay:.1%} per layer {np.round(per_layer, 2).tolist()} x{dense_ms / ms:.2f} "
              f"PSNR {curve[-1]['psnr_fast_vs_truth']:.2f} copy {curve[-1]['copy_rate_fast']:.3f}", file=sys.stderr)
    dense_q = q.summarize_quality(per_clip_q[names[0]])

    # 3. FAST-AR modes through the op, same clips and seeds, density / recall per layer by the op itself
    total = len(spec.prompt(clips[0])) + a.frames * L
    modes = fastar_modes(L, total)
    if a.quick:
        modes = {k: modes[k] for k in ("TempCache 0.9", "AnnSA lsh 8x4 S4+W64")}
    fastar_rows, fastar_runs = [], {}
    for name, opts in modes.items():
        path = work / "kv.onnx"
        fastcar_compile.compile(str(onnx), output=str(path), frame_tokens=L, threshold=float("inf"),
                                kv_diagnostics=total + 8, **opts)
        sess = open_session(path)
        rs = [gen(sess, c, ids[i], np.inf) for i, c in enumerate(clips[: a.fastar_clips])]
        del sess
        fastar_runs[name] = rs
        layers = sorted(rs[0].kv, key=int)
        per_layer = [{"layer": int(k), "density": float(np.mean([r.kv[k]["density"] for r in rs])),
                      "recall": float(np.mean([r.kv[k]["recall"] for r in rs]))} for k in layers]
        pcs = [q.clip_quality(c.frames, tok.encode(c.frames), d.tokens, r.tokens, tok.decode, c)
               for c, d, r in zip(clips, dense_runs, rs, strict=False)]
        s = q.summarize_quality(pcs)
        fastar_rows.append({"mode": name, "options": opts, "per_layer": per_layer,
                            "density": float(np.mean([p["density"] for p in per_layer])),
                            "recall": float(np.mean([p["recall"] for p in per_layer])),
                            "psnr_vs_truth": s["psnr_fast_vs_truth"], "psnr_vs_dense": s["psnr_fast_vs_dense"],
                            "psnr_dense_vs_truth": s["psnr_dense_vs_truth"], "copy_rate": s["copy_rate_fast"],
                            "psnr_vs_dense_truth_diff": s["fast_minus_dense_db"], "ci95": s["ci95"],
                            "clips": len(rs)})
        print(f"  {name}: density {fastar_rows[-1]['density']:.1%} recall {fastar_rows[-1]['recall']:.1%}",
              file=sys.stderr)

    # 4. FPGA simulation from the recorded replay decisions
    sim = fpga(fast_path, [(n, fast_runs[n]) for n in names], spec.video_start, a.fpga_stride)

    # 5. pictures
    show = next(n for n in names if n.startswith("one tau, 80")) if 0.8 in targets else names[-2]
    fa_show = next((m for m in modes if m.startswith("TempCache 0.9 +")), next(iter(modes)))
    results = []
    for i, c in enumerate(clips):
        extra = {"FAST-AR": fastar_runs[fa_show][i]} if i < len(fastar_runs[fa_show]) else {}
        results.append(ClipResult(spec.motion(c), c.source, c.frames, dense_runs[i], fast_runs[show][i], clip=c,
                                  extra=extra))
    pictures(a.out, results[: a.gif_clips], results, tok, show, curve)
    fastar_plot(a.out / "fastar.png", fastar_rows)

    return {"model": model_facts(), "clips": ids, "frames": a.frames, "calib_clips": a.calib_clips,
            "fastar_clips": a.fastar_clips, "decoding": dec.to_dict(), "frame_tokens": L, "tas": tas_stats,
            "dense": {k: dense_q[k] for k in ("psnr_dense_vs_truth", "psnr_repeat_last_vs_truth", "copy_rate_dense",
                                              "copy_rate_truth", "token_acc_dense", "token_acc_repeat_last",
                                              "frozen_fraction_dense", "pan_match_dense", "pan_match_truth",
                                              "psnr_tokenizer", "ssim_dense_vs_truth", "dense_minus_repeat_db",
                                              "dense_minus_repeat_db_clips_above", "ci95", "clips")},
            "per_clip_dense_minus_repeat_db": [c["psnr_dense_vs_truth"] - c["psnr_repeat_last_vs_truth"]
                                               for c in per_clip_q[names[0]]],
            "dense_ms": dense_ms, "curve": curve, "fastar": fastar_rows, "fpga": sim, "gif_config": show,
            "gif_fastar": fa_show, "paper": PAPER}


def model_facts() -> dict:
    """Size and training cost of the shipped weights, from its config and training log."""
    from fastcar_compile.demo.bundled import video_files

    weights, config, _ = video_files()
    cfg = json.loads(config.read_text())
    log = weights.parent / "train_log.jsonl"
    steps, params, last_eval = {}, None, None
    for line in log.read_text().splitlines():
        d = json.loads(line)
        params = d.get("params", params)
        if "loss" in d and "step" in d:
            steps[d["step"]] = d  # a restarted run logs some steps twice: the later line counts
        if "eval_loss" in d:
            last_eval = d
    # cpu_s is the process's CPU time: it restarts with a resumed run, so per-step costs are differences
    # between consecutive steps of one process (the median, as `train_video_model.py status` reports it)
    seq = [steps[k] for k in sorted(steps)]
    diffs = [b["cpu_s"] - a["cpu_s"] for a, b in zip(seq[:-1], seq[1:], strict=True) if b["cpu_s"] > a["cpu_s"]]
    cpu_step = float(np.median(diffs)) if diffs else float("nan")
    facts = {"config": cfg, "params": params, "weights_mb": weights.stat().st_size / 1e6, "steps": len(steps),
             "cpu_s_per_step": cpu_step, "cpu_hours": cpu_step * len(steps) / 3600,
             "wall_hours": sum(float(d["seconds"]) for d in seq) / 3600, "eval": last_eval}
    gpu = weights.parent / "train_log_gpu.jsonl"  # the shipped weights continue the CPU run on an accelerator
    if gpu.is_file():
        recs = [json.loads(x) for x in gpu.read_text().splitlines() if x.strip()]
        start = next(r for r in recs if r.get("event") == "start")
        gsteps = {r["step"]: r for r in recs if "loss" in r}
        facts["gpu"] = {"steps": len(gsteps), "batch": start["settings"]["batch"],
                        "device": start.get("device_name", start["settings"]["device"]),
                        "step_minutes": sum(float(r["seconds"]) for r in gsteps.values()) / 60}
        facts["eval"] = [r for r in recs if "eval_loss" in r][-1]
    return facts


def pictures(out: Path, gif_results: list, results: list, tok, show: str, curve: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fastcar_compile.core.atomic import save_figure
    from fastcar_compile.demo import longvideo as lv
    from fastcar_compile.demo.visuals import write_gif, write_heatmap, write_strip

    write_gif(gif_results, tok, out / "video-demo.gif", fps=4.0)
    write_strip(gif_results, tok, out / "strip.png", every=max(1, len(results[0].gt) // 8))
    write_heatmap(results, tok, out / "replay_heatmap.png", f"FastCar replay per token ({show})",
                  every=max(1, len(results[0].gt) // 8))
    lv.write_layer_plots(results, tok, out / "replay_layers.png", f"FastCar replay per layer ({show})")
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.3))
    groups = {"one tau": [r for r in curve if r["config"].startswith(("one tau,", "tau="))],
              "per-layer tau": [r for r in curve if r["config"].startswith("per-layer")],
              "one tau, layer 0 off": [r for r in curve if "layer 0 off" in r["config"]]}
    keys = (("psnr_fast_vs_truth", "PSNR vs truth (dB)"), ("copy_rate_fast", "copy rate (tokens equal one frame back)"),
            ("x_dense", "x dense (bare ORT per token)"))
    for (key, label), ax in zip(keys, axes, strict=True):
        for (name, rows), style in zip(groups.items(), ("o-", "s--", "D"), strict=True):
            rows = sorted(rows, key=lambda r: r["replay"])
            err = [r["ci95"].get(key, 0.0) for r in rows] if key == "psnr_fast_vs_truth" else None
            ax.errorbar([r["replay"] for r in rows], [r[key] for r in rows], yerr=err, fmt=style, capsize=3,
                        label=name)
        ax.set_xlabel("replay ratio")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].axhline(curve[0]["psnr_dense_vs_truth"], color="k", lw=0.8, label="dense")
    axes[0].axhline(curve[0]["psnr_repeat_last_vs_truth"], color="tab:red", lw=0.8, ls=":", label="repeat last frame")
    axes[0].set_title(f"mean over {curve[0]['clips']} held-out clips, bars: 95% interval", fontsize=9)
    axes[1].axhline(curve[0]["copy_rate_dense"], color="k", lw=0.8, label="dense")
    axes[1].axhline(curve[0]["copy_rate_truth"], color="tab:green", lw=0.8, ls=":", label="truth")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.suptitle(f"tau / quality / speed on the conditioned video model (sampled, CFG; GIF and maps: {show})",
                 fontsize=10)
    fig.tight_layout()
    save_figure(fig, out / "plot.png", dpi=110)


def fastar_plot(path: Path, fastar: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fastcar_compile.core.atomic import save_figure

    fig, ax = plt.subplots(figsize=(7, 5))
    for r in fastar:
        d = [p["density"] for p in r["per_layer"]]
        rc = [p["recall"] for p in r["per_layer"]]
        ax.plot(d, rc, ".", alpha=0.5)
        ax.scatter(r["density"], r["recall"], s=40)
        ax.annotate(r["mode"], (r["density"], r["recall"]), fontsize=7, xytext=(3, 2), textcoords="offset points")
    plot_paper_points(ax)
    ax.set_ylabel("recall (dense softmax mass kept)")
    ax.set_title("FAST-AR modes inside sampled generation (dots: layers, circles: mean)", fontsize=9)
    save_figure(fig, path, dpi=110)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
