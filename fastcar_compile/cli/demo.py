"""`fastcar-compile demo`: compile a demo video model, generate held-out clips dense and with FastCar.

Prints a table (replay ratio, ms per token, speedup, PSNR/SSIM vs dense and vs ground truth, copy rates,
frozen clips, the pan check, each quality target met or missed) and writes into --out: demo.gif (ground
truth | dense | FastCar | replay map), strip.png, replay_heatmap.png, quality.png, results.json and the
compiled fast.onnx. Decoding is sampled (the model's recommended settings; `--greedy` for argmax), with
the same seed per clip for dense and FastCar.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from fastcar_compile.core import fileio, options
from fastcar_compile.core.errors import FastCarError
from fastcar_compile.core.options import ascii_int


def build_parser() -> argparse.ArgumentParser:
    from fastcar_compile.demo.bundled import DEMO_MODELS
    from fastcar_compile.demo.decoding import add_decoding_args

    ap = argparse.ArgumentParser(prog="fastcar-compile demo", description=__doc__.splitlines()[0])
    ap.add_argument("--demo-model", choices=DEMO_MODELS, default="video",
                    help="video: the conditioned 6-layer model of the repository's training/video_model/ (default; "
                         "4 clips x 16 frames); small: the package's bundled 1-layer model (16 x 8)")
    ap.add_argument("--dit", action="store_true",
                    help="stream long videos from the causal video DiT trained in training/dit_model/ instead (its "
                         "own options: demo --dit --help)")
    ap.add_argument("--long", action="store_true",
                    help="64-frame videos, per-layer replay and per-frame quality plots (video: 2 clips; small: the "
                         "bundled 4-layer long-video model, 4 clips; out fastcar-out/demo-long)")
    ap.add_argument("--out", type=Path, default=None, help="output folder (default fastcar-out/demo)")
    ap.add_argument("--clips", type=ascii_int, default=None, help="held-out clips to generate (default: the model's)")
    ap.add_argument("--frames", type=ascii_int, default=None,
                    help="frames per clip incl. the given frame 0 (default: the model's)")
    options.add_arguments(ap, [dataclasses.replace(options.ONE_THRESHOLD, help="tau: replay when TAS > tau "
                                                   "(default: the model's, ~80%% replay; inf never replays)"),
                               options.BY_NAME["tas_query"], options.BY_NAME["max_replay"]])
    ap.add_argument("--threads", type=ascii_int, default=1, help="ORT intra-op threads for both models (default 1)")
    ap.add_argument("--seed", type=ascii_int, default=0, help="clip selection seed (default 0)")
    add_decoding_args(ap)
    return ap


def table(rows: list[tuple[str, str]]) -> str:
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{w}}  {v}" for k, v in rows)


def _defaults(a: argparse.Namespace, spec) -> None:
    """Fill the options left unset with the model's (and --long's) defaults."""
    a.out = a.out or Path("fastcar-out/demo-long" if a.long else "fastcar-out/demo")
    a.clips = a.clips if a.clips is not None else spec.default_clips
    a.frames = a.frames if a.frames is not None else spec.default_frames
    a.threshold = a.threshold if a.threshold is not None else spec.default_tau


def main(argv: list[str]) -> int:
    from fastcar_compile.demo.bundled import spec as demo_spec
    from fastcar_compile.demo.decoding import decoding_from_args

    if "--dit" in argv:  # the DiT demo has its own options
        from fastcar_compile.cli import demo_dit

        return demo_dit.main(argv)
    a = build_parser().parse_args(argv)
    spec = demo_spec(a.demo_model, a.long)
    _defaults(a, spec)
    decoding = decoding_from_args(a, spec.decoding)
    if a.clips < 1:
        raise FastCarError(f"--clips must be >= 1, got {a.clips}")
    if a.frames < 2:
        raise FastCarError(f"--frames must be >= 2 (frame 0 is given, the rest generated), got {a.frames}")
    if a.threads < 1:
        raise FastCarError(f"--threads must be >= 1, got {a.threads}")
    a.threshold = options.ONE_THRESHOLD.check(a.threshold)
    options.BY_NAME["max_replay"].check(a.max_replay)
    fileio.check_output_dir(a.out, "--out")
    fileio.check_outputs({a.out / name: f"--out's {name}" for name in OUTPUTS})
    t0 = time.time()
    with fileio.staged_dir(a.out) as staged:  # every file appears at the end, or none (no empty folder)
        files, fast, s = _run(a, spec, decoding, staged, t0)
    out: Path = a.out
    print(f"\nwrote {len(files)} files in {out} ({time.time() - t0:.0f} s):")
    for f in files:
        print(f"  {out / f.name}" + (" (compiled model)" if f == fast else ""))
    return 0


# what a run may write into --out (the compiled model's data file only when the weights are large)
OUTPUTS = ("demo.gif", "strip.png", "replay_heatmap.png", "quality.png", "replay_layers.png", "psnr_frames.png",
           "results.json", "fast.onnx", "fast.onnx.data")


def _run(a: argparse.Namespace, spec, decoding, out: Path, t0: float):
    """Compile, generate, measure and write everything into `out` (a staged folder)."""
    from fastcar_compile.demo import quality as q
    from fastcar_compile.demo.evaluate import compile_bundled, run_clips, summarize
    from fastcar_compile.demo.visuals import write_gif, write_heatmap, write_strip

    clips = spec.clips(a.clips, a.frames, a.seed)  # first: bad sizes fail before the export and compile
    tok = spec.tokenizer()
    model = spec.onnx()
    print(f"compiling the {spec.name} model (L={tok.tokens_per_frame}, tau={a.threshold:g}, "
          f"tas_query={a.tas_query}, max_replay={a.max_replay}) ...", flush=True)
    fast = compile_bundled(out / "fast.onnx", a.threshold, a.tas_query, a.max_replay, model=model,
                           frame_tokens=tok.tokens_per_frame)
    # --long: 2 x 4031 steps per clip already; the bare-ORT re-timing would double the run (5-minute budget)
    results = run_clips(spec, model, fast, clips, tok, a.threshold, threads=a.threads,
                        rounds=0 if a.long else spec.timing_rounds,
                        decoding=decoding, seed=a.sample_seed)
    s = summarize(results, tok, a.threshold, a.tas_query, a.max_replay)
    per_clip = [q.clip_quality(r.gt, tok.encode(r.gt), r.dense.tokens, r.fast.tokens, tok.decode, r.clip)
                for r in results]
    qs = q.summarize_quality(per_clip, s.replay_ratio)
    every = max(1, a.frames // 16)  # at most ~16 frames per strip row
    files = [write_gif(results, tok, out / "demo.gif", fps=8.0 if a.long else 4.0),
             write_strip(results, tok, out / "strip.png", every=every),
             write_heatmap(results, tok, out / "replay_heatmap.png",
                           f"replay per token, tau={a.threshold:g} ({100 * s.replay_ratio:.0f}% overall)", every=every),
             q.write_quality_plot(per_clip, qs, out / "quality.png",
                                  f"{spec.name} model, {s.clips} held-out clips x {s.frames} frames, "
                                  f"{decoding.describe()}, tau={a.threshold:g} ({100 * s.replay_ratio:.0f}% replay)")]
    extra: dict = {}
    if a.long:
        from fastcar_compile.demo import longvideo as lv

        curves = lv.psnr_per_frame(results, tok)
        per_layer = lv.layer_replay(results, tok.tokens_per_frame)[:, 1:].mean(axis=(1, 2))
        files += [lv.write_layer_plots(results, tok, out / "replay_layers.png",
                                       f"FastCar replay per layer, tau={a.threshold:g}, {s.clips} clips x {s.frames} frames"),
                  lv.write_psnr_plot(curves, out / "psnr_frames.png", f"PSNR vs truth per frame, {s.clips} held-out clips")]
        extra = {"replay_per_layer": per_layer.tolist(), "psnr_per_frame": {k: v.tolist() for k, v in curves.items()}}
    res = out / "results.json"
    from fastcar_compile.core.atomic import write_bytes

    write_bytes(res, json.dumps({"model": spec.name, "decoding": decoding.to_dict(), "sample_seed": a.sample_seed,
                                 "summary": s.to_dict(), "quality": qs, **extra, "clips": [
        {"motion": r.motion, "source": r.source, "replay_ratio": r.fast.replay_ratio, **c}
        for r, c in zip(results, per_clip, strict=True)]}, indent=1).encode())
    files += [res, fast] + [p for p in (out / "fast.onnx.data",) if p.exists()]  # large weights: external data
    print(f"\n{s.clips} held-out clips x {s.frames} frames ({s.frames - 1} generated, {decoding.describe()}), "
          f"{a.threads} ORT thread(s)")
    print(table([
        ("replay ratio", f"{100 * s.replay_ratio:.1f}% of decode-step MLPs (ceiling {100 * s.replay_ceiling:.0f}%)"),
        ("ms/token, ORT run", f"dense {s.dense_ort_ms:.3f}  compiled at tau=+inf {s.inf_ort_ms:.3f}  FastCar "
                              f"{s.fast_ort_ms:.3f}" if not a.long else "not timed with --long (runtime step below)"),
        ("speed-up, ORT run", f"graph {s.speedup_graph_ort:.2f}x (compiled at tau=+inf vs dense: the gate alone, "
                              f"the export's ops are kept) x replay {s.speedup_replay_ort:.2f}x (FastCar vs tau=+inf) "
                              f"= {s.speedup_ort:.2f}x" if not a.long else "not timed with --long"),
        ("ms/token, runtime", f"dense {s.dense_ms:.3f}  FastCar {s.fast_ms:.3f}  -> {s.speedup:.2f}x "
                              "(FastCarSession.step incl. Python; same graph but the gate)"),
        ("token agreement", f"{100 * s.token_agreement:.1f}% of generated tokens equal dense"),
        *q.quality_lines(qs),
    ] + ([("replay per layer", "  ".join(f"L{i} {100 * r:.0f}%" for i, r in enumerate(extra["replay_per_layer"])))]
         if extra else [])))
    return files, fast, s
