"""`fastcar-compile demo --world`: one held-out revisit path through the compiled token world model
(training/world_model/) with full context, the sink + window cache, all FAST-AR modes together and FastCar, against
"shift the last frame by the action".

Frame 0 is given; each later frame is generated greedily from the path's actions. Prints, per variant, the token
accuracy against the truth on revisited cells (seen before, not in the previous frame) and on new cells, frames
per second over the last 10% of the path and the cache's MiB; writes demo.gif (truth | full | window | FAST-AR,
time along the animation; the truth as its VQ tokens decode) into --out and, with --json FILE, the same figures as JSON.
"""

from __future__ import annotations

import argparse
import io
import json
import time
from pathlib import Path

import numpy as np

from fastcar_compile.core.errors import FastCarError
from fastcar_compile.core.options import ascii_int

GIF_COLUMNS = ("truth (VQ)", "full", "window", "fastar")  # the truth as its tokens decode: the best a token model can do
JSON_VARIANTS = ("full", "window", "fastar", "fastcar", "shift")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="fastcar-compile demo --world", description=__doc__.splitlines()[0])
    ap.add_argument("--world", action="store_true", help="this demo (the token world model)")
    ap.add_argument("--frames", type=ascii_int, default=64, help="frames of the path, frame 0 given (default 64)")
    ap.add_argument("--path", type=ascii_int, default=None,
                    help="held-out path index (default: the first that revisits a place beyond the window)")
    ap.add_argument("--window-frames", type=ascii_int, default=4, help="frames the window cache keeps (default 4)")
    ap.add_argument("--threads", type=ascii_int, default=1, help="ORT intra-op threads (default 1)")
    ap.add_argument("--out", type=Path, default=Path("fastcar-out/demo-world"), help="output folder")
    ap.add_argument("--json", type=Path, default=None, metavar="FILE", help="also write the figures to FILE")
    return ap


def pick_path(frames: int, window_frames: int, index: int | None):
    """The held-out path `index`, or the first whose cells come back after more than the window."""
    from fastcar_compile.demo import world

    if index is not None:
        return world.make_path("eval", index, frames)
    for i in range(64):
        p = world.make_path("eval", i, frames)
        if ((p.cell_labels == world.REVISIT) & (p.gap > window_frames)).any():
            return p
    raise FastCarError(f"no held-out path of {frames} frames revisits beyond {window_frames} frames; give more --frames")


def write_gif(videos: list[np.ndarray], path: Path, fps: float = 6.0) -> Path:
    """GIF of [T, 32, 32, 3] videos side by side under GIF_COLUMNS, the frame number on top."""
    from PIL import Image, ImageDraw

    from fastcar_compile.core.atomic import write_bytes
    from fastcar_compile.demo.visuals import SCALE, _upscale

    sep = np.full((videos[0].shape[1], 1, 3), 255, np.uint8)
    frames = []
    for t in range(len(videos[0])):
        body = _upscale(np.concatenate(sum(([v[t], sep] for v in videos), [])[:-1], axis=1))
        im = Image.new("RGB", (body.shape[1], body.shape[0] + 28), "white")
        im.paste(Image.fromarray(body), (0, 28))
        dr = ImageDraw.Draw(im)
        col = (videos[0].shape[2] + 1) * SCALE
        for i, name in enumerate(GIF_COLUMNS):
            dr.text((i * col + 4, 14), name, fill="black")
        dr.text((4, 1), f"frame {t}" + (" (given)" if t == 0 else ""), fill="black")
        frames.append(im)
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:], duration=int(1000 / fps), loop=0)
    return write_bytes(path, buf.getvalue())


def main(argv: list[str]) -> int:
    import tempfile

    from fastcar_compile.core import fileio
    from fastcar_compile.core.atomic import write_text
    from fastcar_compile.demo.export import TOKENIZER
    from fastcar_compile.demo.tokenizer import PatchTokenizer
    from fastcar_compile.demo.worldrun import world_onnx
    from fastcar_compile.demo.worldvariants import CacheSettings, calibrate_tau, run_variants, variants

    a = build_parser().parse_args(argv)
    if a.frames < 8 or a.window_frames < 1 or a.threads < 1:
        raise FastCarError("--frames must be >= 8, --window-frames and --threads >= 1")
    fileio.check_output_dir(a.out, "--out")
    fileio.check_outputs({a.out / "demo.gif": "--out's demo.gif"})
    t0 = time.time()
    onnx = world_onnx()
    tok = PatchTokenizer.load(TOKENIZER)
    p = pick_path(a.frames, a.window_frames, a.path)
    chosen = {k: v for k, v in variants(CacheSettings(window_frames=a.window_frames), every=False).items()
              if k in JSON_VARIANTS}
    with tempfile.TemporaryDirectory(prefix="world-demo-") as tmp:
        tau, _ = calibrate_tau(onnx, Path(tmp), tok, 0.5, 2, 8, threads=a.threads)
    print(f"held-out path over '{p.scene.source}', {a.frames} frames, window {a.window_frames} frames ...", flush=True)
    rows, tokens = run_variants(onnx, tok, [p], chosen, tau, a.window_frames, a.threads)
    figures = {r["variant"]: {"revisit": r["revisit"], "revisit_far": r["revisit_far"], "new": r["new"],
                              "fps": r.get("fps_late"), "cache_mib": r.get("cache_mib_late")} for r in rows}
    with fileio.staged_dir(a.out) as out:
        truth = tok.encode(p.frames[None])
        write_gif([tok.decode(truth[0]), *(tok.decode(tokens[k][0]) for k in GIF_COLUMNS[1:])], out / "demo.gif")
    if a.json is not None:
        write_text(a.json, json.dumps({"path": {"source": p.scene.source, "frames": a.frames},
                                       "window_frames": a.window_frames, "tau": tau, "variants": figures},
                                      indent=1) + "\n")
    fmt = lambda v, f: "-" if v is None or v != v else f.format(v)  # noqa: E731
    print(f"  {'variant':<8} {'revisited':>9} {'> window':>9} {'new':>6} {'frames/s':>9} {'cache MiB':>9}")
    for name, f in figures.items():
        print(f"  {name:<8} {fmt(f['revisit'], '{:.3f}'):>9} {fmt(f['revisit_far'], '{:.3f}'):>9} "
              f"{fmt(f['new'], '{:.3f}'):>6} {fmt(f['fps'], '{:.1f}'):>9} {fmt(f['cache_mib'], '{:.1f}'):>9}")
    print(f"wrote {a.out}/demo.gif" + (f" and {a.json}" if a.json else "") + f" ({time.time() - t0:.0f} s)")
    return 0
