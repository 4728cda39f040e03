"""`fastcar-compile generate MODEL --prompts P.npy --frames N -o OUT [--ray [ADDRESS]]`: one video per prompt
row, in this process or on a Ray cluster (fastcar_compile/many_videos.py, docs/scale.md)."""

from __future__ import annotations

import argparse

from fastcar_compile.core.errors import FastCarError
from fastcar_compile.core.limits import MAX_THREADS, check_finite, check_int
from fastcar_compile.core.options import ascii_float, ascii_int

MAX_FRAMES = 100_000
MAX_ACTORS = 4096


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="fastcar-compile generate", description="Render one video per prompt row with a compiled decoder "
        "(FastCarSession) or a DiT step graph (its stream runtime): OUT/videos/NNNNN.npz (tokens or latents + "
        "trace), OUT/generate.json. A resumed run skips the videos already written.")
    ap.add_argument("model", help="a decoder .onnx (compiled fast.onnx or dense) or a DiT step graph (export --dit)")
    ap.add_argument("--prompts", required=True, help=".npy: a decoder's int token ids [videos, prompt_len], a DiT's "
                    "prompt embeddings [videos, tokens, text_dim]")
    ap.add_argument("--frames", type=ascii_int, required=True, help="frames per video (a DiT's latent frames)")
    ap.add_argument("-o", "--output", required=True, help="output folder")
    ap.add_argument("--ray", nargs="?", const=True, metavar="ADDRESS", help="render on Ray Data actors: a local "
                    "cluster started here, or the cluster at ADDRESS ('auto', host:6379, ray://host:10001)")
    ap.add_argument("--actors", type=ascii_int, default=1, help="Ray actors, each holding the model once (default 1)")
    ap.add_argument("--threads", type=ascii_int, default=1, help="ONNX Runtime threads per actor (and the CPUs Ray "
                    "reserves for it; default 1)")
    ap.add_argument("--seed", type=ascii_int, default=0, help="video i uses seed + i (default 0)")
    ap.add_argument("--cfg", type=ascii_float, default=3.0, help="a DiT's classifier-free guidance (1: none)")
    ap.add_argument("--frame-tokens", type=ascii_int, help="a dense decoder's tokens per frame")
    ap.add_argument("--threshold", type=ascii_float, help="a FastCar decoder's tau for this run (default: compiled)")
    return ap


def main(argv: list[str]) -> int:
    a = build_parser().parse_args(argv)
    check_int("--frames", a.frames, 1, MAX_FRAMES, "frames per video")
    check_int("--actors", a.actors, 1, MAX_ACTORS)
    check_int("--threads", a.threads, 1, MAX_THREADS)
    check_int("--seed", a.seed, 0, 2**32 - 1)
    check_finite("--cfg", a.cfg)
    if a.cfg <= 0:
        raise FastCarError(f"--cfg must be > 0 (1 = no guidance), got {a.cfg}")
    if a.ray is None and a.actors != 1:
        raise FastCarError("--actors needs --ray (without it the videos render in turn in this process)")
    from fastcar_compile.core.fileio import check_input_file, check_output_dir
    from fastcar_compile.many_videos import generate_many, is_dit, ray_module, read_prompts

    model = check_input_file(a.model, "the model")
    out = check_output_dir(a.output, "-o")
    if a.ray is not None:
        ray_module()  # missing Ray: said before any work
    dit = is_dit(model)
    text_dim = None
    if dit:
        if a.frame_tokens is not None or a.threshold is not None:
            raise FastCarError("--frame-tokens / --threshold are a decoder's; a DiT step graph has its own")
        from fastcar_compile.dit.stream import OrtDiT

        text_dim = OrtDiT(model).cfg.text_dim
    prompts = read_prompts(a.prompts, dit, text_dim)
    s = generate_many(model, prompts, a.frames, out, ray=a.ray, actors=a.actors, threads=a.threads, seed=a.seed,
                      cfg_scale=a.cfg, frame_tokens=a.frame_tokens, threshold=a.threshold)
    rate = f", {s['videos_per_min']:.1f} videos/min" if s["videos_per_min"] else ""
    print(f"wrote {s['rendered']} video(s) to {out}/videos ({s['skipped']} already there, {s['where']}{rate}); "
          f"{out}/generate.json")
    return 0
