"""`fastcar-compile eval`: dense vs FastCar, on your own model (`--model fast.onnx --prompts p.npy`) or as a
tau sweep on the bundled video model.

Your model: runtime/evaluate.py (replay, speed vs the dense model in the same run, logit
divergence, runtime traces for `report`). Bundled model: for each TAS variant (post-RoPE `rope`, pre-RoPE
`raw`) and drift guard (max_replay 0 = off, K), the thresholds are the quantiles of the TAS values seen along
dense generations (so the sweep lands near the target replay ratios 20/50/80/90% whatever the TAS scale),
plus never/always replay; each configuration is timed against dense on the same clips (~8 min for the
default 8 clips x 8 frames on 2 cores). Writes eval.json, eval.md (table) and eval.png into --out.
`--kv-sweep`: FAST-AR KV modes on the long-video model (fastcar_compile/demo/kvsweep.py; reference path).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from fastcar_compile.core import contract, fileio
from fastcar_compile.core.atomic import save_figure
from fastcar_compile.core.errors import FastCarError
from fastcar_compile.core.options import ascii_float, ascii_int

TARGETS = (0.2, 0.5, 0.8, 0.9)


def build_parser() -> argparse.ArgumentParser:
    from fastcar_compile.demo.bundled import DEMO_MODELS
    from fastcar_compile.demo.decoding import add_decoding_args

    ap = argparse.ArgumentParser(prog="fastcar-compile eval", description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--out", type=Path, default=Path("fastcar-out/eval"), help="output folder")
    ap.add_argument("--frames", type=ascii_int, default=None, help="frames per video (default 4 for --model, 8 bundled)")
    ap.add_argument("--threads", type=ascii_int, default=None, help="ORT threads (default 2 for --model, 1 bundled)")
    own = ap.add_argument_group("your own model")
    own.add_argument("--model", type=Path, help="compiled fast.onnx to measure")
    own.add_argument("--prompts", type=Path, help=".npy int array [prompts, prompt_len] of token ids")
    own.add_argument("--dense", type=Path, help="the original export (dense baseline); default: --model at "
                                                "tau=+inf (same tokens, but carries the gate's overhead)")
    own.add_argument("--batch", type=ascii_int, default=1, help="prompts per generate call (default 1)")
    own.add_argument("--rounds", type=ascii_int, default=3, help="interleaved timing rounds over every prompt "
                     "(default 3): each speed-up factor is printed as its median and its range over the rounds")
    own.add_argument("--given-video-tokens", type=ascii_int, default=0,
                     help="the prompts end with this many video tokens (e.g. a given frame 0)")
    own.add_argument("--draft", metavar="KIND[:K]",
                     help="speculative decoding instead: plain vs draft greedy decoding of --model, a dense export "
                          "or a FastCar one (with --dense: the dense model plain and with the draft too) "
                          f"({', '.join(contract.DRAFT_KINDS)}; :K draft tokens per step, default adaptive; "
                          "--frame-shape gives the frame size of a dense model; docs/speculation.md)")
    own.add_argument("--frame-shape", metavar="HxW", help="frame as a token grid (16x16 for L=256): per-token "
                                                          "replay heatmap fast.tokens.png")
    bundled = ap.add_argument_group("bundled video model (no --model)")
    bundled.add_argument("--demo-model", choices=DEMO_MODELS, default="small",
                         help="small: the package's 1-layer model (default, ~8 min); video: the conditioned 6-layer "
                              "model of the repository's training/video_model/ (~10x the time per clip)")
    bundled.add_argument("--clips", type=ascii_int, default=None, help="held-out clips (default 8; --kv-sweep 2)")
    bundled.add_argument("--targets", type=str, default=",".join(map(str, TARGETS)),
                    help="replay ratios whose TAS quantiles become the swept thresholds")
    bundled.add_argument("--variants", type=str, default="rope,raw", help="TAS variants (rope, raw)")
    bundled.add_argument("--guard", type=ascii_int, default=2, help="drift guard K swept next to 0 = off (default 2)")
    add_decoding_args(ap)
    kv = ap.add_argument_group("FAST-AR KV modes on the long-video model (reference path)")
    kv.add_argument("--kv-sweep", action="store_true",
                    help="sweep KV modes (--kv-modes) on the long-video model: density, recall, KV bytes, PSNR/SSIM "
                         "vs dense and truth (NumPy reference attention inside generation; writes kv_sweep.*)")
    kv.add_argument("--kv-modes", default=None, help="';'-separated modes: dense, window:S+W, budget:S+W+C, "
                                                     "tempcache:SIM[@S+W+C], lsh:BITSxTABLES, int8:DIRSxTABLES, "
                                                     "prune:P (default: a sweep of all)")
    return ap


def _fmt_table(rows: list[dict]) -> str:
    head = ("| TAS | guard K | tau | replay | ORT ms/token dense | ORT ms/token tau=+inf | ORT ms/token FastCar | "
            "speedup ORT (graph x replay) | "
            "speedup runtime | token agree | PSNR vs dense | SSIM vs dense | PSNR vs GT | SSIM vs GT | "
            "dense PSNR vs GT |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(f"| {r['tas_query']} | {r['max_replay']} | {r['tau']:.3g} | {100 * r['replay_ratio']:.1f}% | "
                     f"{r['dense_ort_ms']:.3f} | {r['inf_ort_ms']:.3f} | {r['fast_ort_ms']:.3f} | "
                     f"{r['speedup_ort']:.2f}x ({r['speedup_graph_ort']:.2f} x {r['speedup_replay_ort']:.2f}) | "
                     f"{r['speedup']:.2f}x | "
                     f"{100 * r['token_agreement']:.1f}% | {r['psnr_fast_vs_dense']:.2f} | "
                     f"{r['ssim_fast_vs_dense']:.3f} | {r['psnr_fast_vs_gt']:.2f} | {r['ssim_fast_vs_gt']:.3f} | "
                     f"{r['psnr_dense_vs_gt']:.2f} |")
    return "\n".join(lines)


def _plot(rows: list[dict], path: Path) -> None:

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    keys = sorted({(r["tas_query"], r["max_replay"]) for r in rows})
    for q, k in keys:
        sel = sorted([r for r in rows if (r["tas_query"], r["max_replay"]) == (q, k)], key=lambda r: r["replay_ratio"])
        x = [100 * r["replay_ratio"] for r in sel]
        lab = f"{q}, K={k}" if k else f"{q}, no guard"
        axes[0].plot(x, [r["speedup_ort"] for r in sel], "o-", label=lab)
        axes[1].plot(x, [r["psnr_fast_vs_gt"] - r["psnr_dense_vs_gt"] for r in sel], "o-", label=lab)
        axes[2].plot(x, [r["psnr_fast_vs_dense"] for r in sel], "o-", label=lab)
    paper_r, paper_s = [0, 20, 50, 80], [1.0, 1.24, 1.45, 1.76]
    axes[0].plot(paper_r, paper_s, "k--", label="paper (FPGA, VILA-U 7B)")
    axes[0].set_ylabel("speedup per token (bare ORT run, CPU)")
    axes[1].axhline(-1, color="grey", ls=":", label="-1 dB target")
    axes[1].set_ylabel("PSNR vs truth: FastCar - dense (dB)")
    axes[2].set_ylabel("PSNR FastCar vs dense (dB, 100 = equal)")
    for ax in axes:
        ax.set_xlabel("replay ratio (%)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


def main(argv: list[str]) -> int:
    a = build_parser().parse_args(argv)
    if a.model is not None or a.prompts is not None:
        return _own(a)
    if a.kv_sweep or a.kv_modes:
        return _kv_sweep(a)
    a.frames = 8 if a.frames is None else a.frames
    a.threads = 1 if a.threads is None else a.threads
    a.clips = 8 if a.clips is None else a.clips
    try:
        targets = [ascii_float(x) for x in a.targets.split(",") if x.strip()]
    except ValueError:
        raise FastCarError(f"--targets must be comma-separated numbers in (0, 1), got {a.targets!r}") from None
    if not targets or any(not 0 < t < 1 for t in targets):
        raise FastCarError(f"--targets must be comma-separated numbers in (0, 1), got {a.targets!r}")
    variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    if not variants or any(v not in contract.TAS_QUERIES for v in variants):
        raise FastCarError(f"--variants takes rope and/or raw, got {a.variants!r}")
    if a.clips < 1 or a.frames < 2 or a.guard < 0:
        raise FastCarError("--clips >= 1, --frames >= 2 and --guard >= 0 are required")
    from fastcar_compile.core.atomic import write_bytes

    fileio.check_output_dir(a.out, "--out")
    fileio.check_outputs({a.out / name: f"--out's {name}" for name in ("eval.json", "eval.md", "eval.png")})
    t0 = time.time()
    with fileio.staged_dir(a.out) as staged:  # the three results appear together at the end, or none
        models = Path(tempfile.mkdtemp(prefix=".eval-models-", dir=staged))  # compiled per tau, removed below
        try:
            rows = _sweep(a, targets, variants, models)
        finally:
            shutil.rmtree(models, ignore_errors=True)
        write_bytes(staged / "eval.json", json.dumps({"rows": rows, "clips": a.clips, "frames": a.frames,
                                                      "threads": a.threads}, indent=1).encode())
        table = _fmt_table(rows)
        write_bytes(staged / "eval.md", (table + "\n").encode())
        _plot(rows, staged / "eval.png")
    out: Path = a.out
    print("\n" + table)
    print(f"\nwrote {out / 'eval.json'}, {out / 'eval.md'}, {out / 'eval.png'} ({time.time() - t0:.0f} s; the "
          "models compiled for the sweep were temporary and are deleted)")
    return 0


def _sweep(a, targets: list[float], variants: list[str], out: Path) -> list[dict]:
    """Every (TAS variant, guard, tau) configuration on the same clips, dense timed alongside each; decoding
    sampled by default (dense and FastCar share each clip's seed)."""
    from fastcar_compile.demo import quality as q
    from fastcar_compile.demo.bundled import spec as demo_spec
    from fastcar_compile.demo.decoding import decoding_from_args
    from fastcar_compile.demo.evaluate import compile_bundled, dense_tas, run_clips, summarize

    spec = demo_spec(a.demo_model)
    decoding = decoding_from_args(a, spec.decoding)
    tok = spec.tokenizer()
    dense = spec.onnx()
    clips = spec.clips(a.clips, a.frames, 0)
    rows: list[dict] = []
    guards = [0] + ([a.guard] if a.guard else [])
    for tq in variants:
        # TAS along the dense trajectories: a never-replaying model (tau = +inf) generates the dense video
        tas = dense_tas(spec, dense, clips, tok, decoding, out / f"diag-{tq}.onnx", tq, a.threads,
                        a.sample_seed).reshape(-1)
        taus = [float("inf")] + [float(np.quantile(tas, 1 - t)) for t in targets] + [float("-inf")]
        for k in guards:
            for tau in taus:
                if k and tau == float("inf"):
                    continue  # a guard changes nothing when nothing replays
                fast = compile_bundled(out / "fast.onnx", tau, tq, k, model=dense, frame_tokens=tok.tokens_per_frame)
                res = run_clips(spec, dense, fast, clips, tok, tau, a.threads, progress=False, decoding=decoding,
                                seed=a.sample_seed)
                s = summarize(res, tok, tau, tq, k).to_dict()
                per_clip = [q.clip_quality(r.gt, tok.encode(r.gt), r.dense.tokens, r.fast.tokens, tok.decode, r.clip)
                            for r in res]
                s["quality"] = q.summarize_quality(per_clip, s["replay_ratio"])
                s["model"], s["decoding"] = spec.name, decoding.to_dict()
                rows.append(s)
                print(f"{tq:4s} K={k} tau={tau:9.3g}: replay {100 * s['replay_ratio']:5.1f}%  "
                      f"speedup ORT {s['speedup_ort']:.2f}x (graph {s['speedup_graph_ort']:.2f}x x replay "
                      f"{s['speedup_replay_ort']:.2f}x) runtime {s['speedup']:.2f}x  PSNR vs GT {s['psnr_fast_vs_gt']:.2f} "
                      f"(dense {s['psnr_dense_vs_gt']:.2f})  vs dense {s['psnr_fast_vs_dense']:.2f}", flush=True)
    return rows


def _own(a) -> int:
    if a.model is None or a.prompts is None:
        raise FastCarError("eval on your model needs both --model fast.onnx and --prompts p.npy")
    from fastcar_compile.runtime.evaluate import check_files, evaluate, load_prompts

    frames = 4 if a.frames is None else a.frames
    threads = 2 if a.threads is None else a.threads
    if threads < 1:
        raise FastCarError(f"--threads must be >= 1, got {threads}")
    if a.draft is not None:
        from fastcar_compile.runtime.evaluate_draft import evaluate_draft, frame_tokens_of

        evaluate_draft(a.model, load_prompts(a.prompts), a.out, a.draft, frame_tokens=frame_tokens_of(a.frame_shape),
                       frames=frames, batch=a.batch, threads=threads, given_video_tokens=a.given_video_tokens,
                       dense_path=a.dense)
        return 0
    check_files(a.model, a.dense, a.out, a.prompts)
    prompts = load_prompts(a.prompts)
    evaluate(a.model, prompts, a.out, dense_path=a.dense, frames=frames, batch=a.batch, threads=threads,
             given_video_tokens=a.given_video_tokens, frame_shape=a.frame_shape, rounds=a.rounds)
    return 0


def _kv_sweep(a) -> int:
    """FAST-AR modes on the long-video model (reference path): kv_sweep.{json,md,png} in --out."""
    from fastcar_compile.core.atomic import write_bytes
    from fastcar_compile.demo import data, kvsweep
    from fastcar_compile.demo.evaluate import load_tokenizer
    from fastcar_compile.demo.export import LONG_CONFIG, LONG_WEIGHTS, load_model
    from fastcar_compile.demo.model import VIDEO_START

    frames = 16 if a.frames is None else a.frames
    clips_n = 2 if a.clips is None else a.clips
    if clips_n < 1 or frames < 2:
        raise FastCarError("--clips >= 1 and --frames >= 2 are required")
    tok = load_tokenizer()
    modes = kvsweep.parse_modes(a.kv_modes or kvsweep.DEFAULT_MODES, tok.tokens_per_frame, VIDEO_START)
    fileio.check_output_dir(a.out, "--out")
    fileio.check_outputs({a.out / f"kv_sweep.{ext}": f"--out's kv_sweep.{ext}" for ext in ("json", "md", "png")})
    import torch

    torch.set_num_threads(1 if a.threads is None else a.threads)
    model = load_model(LONG_WEIGHTS, LONG_CONFIG)
    clips = data.make_clips("eval", clips_n, frames)
    t0 = time.time()
    rows = kvsweep.sweep(model, tok, clips, modes)
    text = (f"Long-video model, {clips_n} held-out clips x {frames} frames (frame 0 given, greedy), reference path "
            f"(NumPy attention inside generation); metrics over frames 1..\n\n" + kvsweep.table(rows) + "\n")
    with fileio.staged_dir(a.out) as staged:
        write_bytes(staged / "kv_sweep.json", json.dumps({"rows": rows, "clips": clips_n, "frames": frames},
                                                         indent=1).encode())
        write_bytes(staged / "kv_sweep.md", text.encode())
        kvsweep.plot(rows, staged / "kv_sweep.png", f"FAST-AR modes, long-video model, {clips_n} clips x {frames} "
                                                     "frames (reference path)")
    print("\n" + text)
    print(f"wrote {a.out / 'kv_sweep.json'}, .md, .png ({time.time() - t0:.0f} s)")
    return 0
