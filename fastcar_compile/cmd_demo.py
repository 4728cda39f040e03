"""`fastcar-compile demo`: compile the bundled video model, generate held-out clips dense and with FastCar.

Prints a table (replay ratio, ms per token, speedup, PSNR/SSIM vs dense and vs ground truth) and writes
into --out: demo.gif (ground truth | dense | FastCar | replay map), strip.png, replay_heatmap.png,
results.json and the compiled fast.onnx.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from fastcar_compile.core import contract, fileio, limits
from fastcar_compile.core.errors import FastCarError
from fastcar_compile.core.options import ascii_float, ascii_int

DEFAULT_TAU = 33.0  # post-RoPE TAS giving ~80% replay on the bundled model (docs/demo.md, eval sweep)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="fastcar-compile demo", description=__doc__.splitlines()[0])
    ap.add_argument("--long", action="store_true",
                    help="the 4-layer long-video model: 64-frame videos, per-layer replay and per-frame quality plots "
                         "(defaults: 4 clips, 64 frames, its own tau; out fastcar-out/demo-long)")
    ap.add_argument("--out", type=Path, default=None, help="output folder (default fastcar-out/demo)")
    ap.add_argument("--clips", type=ascii_int, default=None, help="held-out clips to generate (default 16; --long 4)")
    ap.add_argument("--frames", type=ascii_int, default=None,
                    help="frames per clip incl. the given frame 0 (default 8; --long 64)")
    ap.add_argument("--tau", type=ascii_float, default=None, help=f"TAS threshold (default {DEFAULT_TAU}; --long its own)")
    ap.add_argument("--tas-query", choices=contract.TAS_QUERIES, default=contract.TAS_ROPE)
    ap.add_argument("--max-replay", type=ascii_int, default=0, help="drift guard: max consecutive replays (0 = off)")
    ap.add_argument("--threads", type=ascii_int, default=1, help="ORT intra-op threads for both models (default 1)")
    ap.add_argument("--seed", type=ascii_int, default=0, help="clip selection seed (default 0)")
    return ap


def table(rows: list[tuple[str, str]]) -> str:
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{w}}  {v}" for k, v in rows)


def _defaults(a: argparse.Namespace) -> None:
    """Fill the options left unset with the short or the --long demo's defaults."""
    from fastcar_compile.demo.longvideo import DEFAULT_LONG_TAU, LONG_CLIPS, LONG_FRAMES

    long_ = bool(a.long)
    a.out = a.out or Path("fastcar-out/demo-long" if long_ else "fastcar-out/demo")
    a.clips = a.clips if a.clips is not None else (LONG_CLIPS if long_ else 16)
    a.frames = a.frames if a.frames is not None else (LONG_FRAMES if long_ else 8)
    a.tau = a.tau if a.tau is not None else (DEFAULT_LONG_TAU if long_ else DEFAULT_TAU)


def main(argv: list[str]) -> int:
    a = build_parser().parse_args(argv)
    _defaults(a)
    if a.clips < 1:
        raise FastCarError(f"--clips must be >= 1, got {a.clips}")
    if a.frames < 2:
        raise FastCarError(f"--frames must be >= 2 (frame 0 is given, the rest generated), got {a.frames}")
    if a.threads < 1:
        raise FastCarError(f"--threads must be >= 1, got {a.threads}")
    if math.isnan(a.tau) or (math.isfinite(a.tau) and abs(a.tau) > limits.FLOAT32_MAX):
        raise FastCarError(f"--tau {a.tau:g}: give a number within float32 (TAS > tau replays; inf never replays)")
    if a.max_replay < 0 or a.max_replay > limits.MAX_REPLAY:
        raise FastCarError(f"--max-replay must be in 0..{limits.MAX_REPLAY} (0 = off), got {a.max_replay}")
    fileio.check_output_dir(a.out, "--out")
    fileio.check_outputs({a.out / name: f"--out's {name}" for name in OUTPUTS})
    t0 = time.time()
    with fileio.staged_dir(a.out) as staged:  # every file appears at the end, or none (no empty folder)
        files, fast, s = _run(a, staged, t0)
    out: Path = a.out
    print(f"\nwrote {len(files)} files in {out} ({time.time() - t0:.0f} s):")
    for f in files:
        print(f"  {out / f.name}" + (" (compiled model)" if f == fast else ""))
    return 0


# what a run may write into --out (the compiled model's data file only when the weights are large)
OUTPUTS = ("demo.gif", "strip.png", "replay_heatmap.png", "replay_layers.png", "psnr_frames.png", "results.json",
           "fast.onnx", "fast.onnx.data")


def _run(a: argparse.Namespace, out: Path, t0: float):
    """Compile, generate, measure and write everything into `out` (a staged folder)."""
    from fastcar_compile.demo import data
    from fastcar_compile.demo.evaluate import compile_bundled, load_tokenizer, run_clips, summarize
    from fastcar_compile.demo.export import ONNX
    from fastcar_compile.demo.visuals import write_gif, write_heatmap, write_strip

    tok = load_tokenizer()
    model = ONNX
    if a.long:
        from fastcar_compile.demo.longvideo import long_onnx

        model = long_onnx()
    print(f"compiling {'the long-video model' if a.long else ONNX.name} (L={tok.tokens_per_frame}, tau={a.tau:g}, "
          f"tas_query={a.tas_query}, max_replay={a.max_replay}) ...", flush=True)
    fast = compile_bundled(out / "fast.onnx", a.tau, a.tas_query, a.max_replay, model=model,
                           frame_tokens=tok.tokens_per_frame)
    clips = data.make_clips("eval", a.clips, a.frames, seed=a.seed)
    # --long: 2 x 4031 steps per clip already; the bare-ORT re-timing would double the run (5-minute budget)
    results = run_clips(model, fast, clips, tok, a.tau, threads=a.threads, rounds=0 if a.long else 2)
    s = summarize(results, tok, a.tau, a.tas_query, a.max_replay)
    every = max(1, a.frames // 16)  # at most ~16 frames per strip row
    files = [write_gif(results, tok, out / "demo.gif", fps=8.0 if a.long else 4.0),
             write_strip(results, tok, out / "strip.png", every=every),
             write_heatmap(results, tok, out / "replay_heatmap.png",
                           f"replay per token, tau={a.tau:g} ({100 * s.replay_ratio:.0f}% overall)", every=every)]
    extra: dict = {}
    if a.long:
        from fastcar_compile.demo import longvideo as lv

        curves = lv.psnr_per_frame(results, tok)
        per_layer = lv.layer_replay(results, tok.tokens_per_frame)[:, 1:].mean(axis=(1, 2))
        files += [lv.write_layer_plots(results, tok, out / "replay_layers.png",
                                       f"FastCar replay per layer, tau={a.tau:g}, {s.clips} clips x {s.frames} frames"),
                  lv.write_psnr_plot(curves, out / "psnr_frames.png", f"PSNR vs truth per frame, {s.clips} held-out clips")]
        extra = {"replay_per_layer": per_layer.tolist(), "psnr_per_frame": {k: v.tolist() for k, v in curves.items()}}
    res = out / "results.json"
    from fastcar_compile.core.atomic import write_bytes

    write_bytes(res, json.dumps({"summary": s.to_dict(), **extra, "clips": [
        {"motion": r.motion, "source": r.source, "replay_ratio": r.fast.replay_ratio} for r in results]},
        indent=1).encode())
    files += [res, fast]
    print(f"\n{s.clips} held-out clips x {s.frames} frames ({s.frames - 1} generated, greedy), "
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
        ("FastCar vs dense", f"PSNR {s.psnr_fast_vs_dense:.2f} dB  SSIM {s.ssim_fast_vs_dense:.3f}"),
        ("FastCar vs truth", f"PSNR {s.psnr_fast_vs_gt:.2f} dB  SSIM {s.ssim_fast_vs_gt:.3f}"),
        ("dense vs truth", f"PSNR {s.psnr_dense_vs_gt:.2f} dB  SSIM {s.ssim_dense_vs_gt:.3f}"),
        ("hold frame 0", f"PSNR {s.psnr_hold_vs_gt:.2f} dB (baseline: repeat the given frame)"),
        ("tokenizer ceiling", f"PSNR {s.psnr_tokenizer:.2f} dB (encode/decode of the truth)"),
    ] + ([("replay per layer", "  ".join(f"L{i} {100 * r:.0f}%" for i, r in enumerate(extra["replay_per_layer"])))]
         if extra else [])))
    return files, fast, s
