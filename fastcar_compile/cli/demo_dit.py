"""`fastcar-compile demo --dit`: stream a long video from the causal video DiT trained in this repository.

The model (`training/dit_model/`: config.json + fp16 model.safetensors, trained by scripts/train_dit.py on the
scene clips in 32x32 pixels, prompts = the clips' labels) generates each prompt's video chunk by chunk over
its KV cache (attention sinks + a rolling window, so the cost per frame stays flat), 4 denoising steps per
chunk with classifier-free guidance. Writes into --out: demo.gif (one labelled panel per prompt, frame
number on top), strip.png (every k-th frame), results.json (per prompt: frames per second early and late,
RSS, motion per frame, the settings) and prints the numbers. Then each FAST-AR mode (`DEMO_MODES`, the eager
FAST-AR runtime of fastcar_compile/dit/fastar.py) streams the first prompt for --mode-frames frames on the model's
capped context: its self- and cross-attention density and recall (measured against a dense attention on the
side) and its frames per second (a second run without that side pass), printed and in results.json.
"""

from __future__ import annotations

import argparse
import io
import json
import time
from pathlib import Path

import numpy as np

from fastcar_compile.core.errors import FastCarError
from fastcar_compile.core.options import ascii_float, ascii_int

MODEL_DIR = Path(__file__).resolve().parents[2] / "training" / "dit_model"
# Fields a --prompt leaves out (one token per field; scenes.LABELS has the values).
BASE_LABELS = {"camera": "pan_right", "speed": "slow", "objects": "objects_1", "occluder": "no_occluder",
               "cut": "no_cut", "scene": "photo"}
DEFAULT_PROMPTS = ("camera=pan_right", "camera=zoom_in", "camera=static,objects=objects_2")
OUTPUTS = ("demo.gif", "strip.png", "results.json")
# The FAST-AR modes the demo measures (the stream runtime's settings, dit/modes.py): name -> settings. A mode alone
# runs whatever the cost model says (ann_always); 'all' runs AnnSA / AnnCA where it predicts they pay.
TEMPCACHE_LSH = {"tempcache": 0.9, "tempcache_match": "lsh"}  # SIM 0.9 (the paper's), the top-1 match by LSH
DEMO_MODES = {"dense (FAST-AR runtime)": {}, "TempCache-LSH": TEMPCACHE_LSH,
              "AnnSA-LSH": {"annsa": "lsh", "ann_always": True}, "AnnCA": {"annca": True, "ann_always": True},
              "all (TempCache-LSH + AnnSA-LSH + AnnCA where they pay)": {**TEMPCACHE_LSH, "annsa": "lsh", "annca": True}}
SCALE = 4  # GIF pixels per frame pixel


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="fastcar-compile demo --dit", description=__doc__.splitlines()[0])
    ap.add_argument("--dit", action="store_true", help="this demo (the trained causal video DiT)")
    ap.add_argument("--frames", type=ascii_int, default=240, help="frames per video (default 240)")
    ap.add_argument("--prompt", action="append", metavar="FIELD=VALUE,...",
                    help=f"labels of one video, e.g. camera=pan_left,objects=objects_2 (repeatable; fields left out: "
                         f"{','.join(f'{k}={v}' for k, v in BASE_LABELS.items())}; default: "
                         f"{' / '.join(DEFAULT_PROMPTS)})")
    ap.add_argument("--cfg", type=ascii_float, default=2.0, help="classifier-free guidance scale (1: none; default 2)")
    ap.add_argument("--seed", type=ascii_int, default=0, help="noise seed (default 0)")
    ap.add_argument("--weights", type=Path, default=MODEL_DIR,
                    help="folder with config.json + model.safetensors (default: the repository's training/dit_model)")
    ap.add_argument("--out", type=Path, default=Path("fastcar-out/demo-dit"), help="output folder")
    ap.add_argument("--threads", type=ascii_int, default=1, help="PyTorch threads (default 1)")
    ap.add_argument("--mode-frames", type=ascii_int, default=48, help="frames each FAST-AR mode streams on the first "
                    "prompt for its density, recall and frames per second (default 48; 0: skip the modes)")
    return ap


def parse_prompt(text: str) -> dict[str, str]:
    """'camera=pan_left,objects=objects_2' -> every field's label (BASE_LABELS for the others), checked."""
    from fastcar_compile.demo.scenes import LABELS

    labels = dict(BASE_LABELS)
    for item in filter(None, (s.strip() for s in text.split(","))):
        field, eq, value = item.partition("=")
        if not eq or field not in LABELS or value not in LABELS[field]:
            known = "; ".join(f"{k}: {'|'.join(v)}" for k, v in LABELS.items())
            raise FastCarError(f"--prompt {text!r}: {item!r} is not FIELD=VALUE of a known label ({known})")
        labels[field] = value
    if labels["camera"] == "static":
        labels["speed"] = "none"
    elif labels["speed"] == "none":
        labels["speed"] = "slow"
    return labels


def load_trained(folder: Path):
    """The trained DiT (eager, eval) from `folder`; a one-line error naming the fix when it is not there."""
    from fastcar_compile.demo.dit_train import TEXT_DIM
    from fastcar_compile.dit.checkpoints import load_config
    from fastcar_compile.dit.model import build

    missing = [n for n in ("config.json", "model.safetensors") if not (folder / n).is_file()]
    if missing:
        raise FastCarError(f"the trained DiT's {' and '.join(missing)} not found in {folder}: it ships with the "
                           "repository, not the package (run from a clone, or train it: python scripts/train_dit.py)")
    cfg, weights = load_config(str(folder))
    if cfg.text_dim != TEXT_DIM or cfg.in_channels != 3:
        raise FastCarError(f"{folder}: not a pixel-space DiT conditioned on the scene labels (text_dim "
                           f"{cfg.text_dim}, {cfg.in_channels} channels; need {TEXT_DIM} and 3)")
    return build(cfg, weights)


def stream_prompt(model, labels: dict[str, str], frames: int, cfg_scale: float, seed: int) -> dict:
    """One video: uint8 frames [T, H, W, 3], per-frame ms (a chunk's time shared by its frames), RSS."""
    from fastcar_compile.cli.stream import run_stream
    from fastcar_compile.demo.dit_train import text_embeds, to_uint8
    from fastcar_compile.dit.stream import StreamSettings, TorchDiT

    r = run_stream(TorchDiT(model), StreamSettings(frames=frames, seed=seed, cfg_scale=cfg_scale),
                   text_embeds(labels), progress=False)
    r["video"] = to_uint8(r.pop("latent"))
    return r


def _label_panel(frame: np.ndarray, lines: list[str]) -> np.ndarray:
    from PIL import Image, ImageDraw

    body = np.kron(frame, np.ones((SCALE, SCALE, 1), np.uint8))
    head = Image.new("RGB", (body.shape[1], 12 * len(lines) + 2), "white")
    dr = ImageDraw.Draw(head)
    for i, line in enumerate(lines):
        dr.text((2, 1 + 12 * i), line, fill="black")
    return np.concatenate([np.asarray(head), body])


def write_gif(videos: list[np.ndarray], prompts: list[dict[str, str]], path: Path, fps: float = 16.0) -> None:
    from PIL import Image

    from fastcar_compile.core.atomic import write_bytes

    pics = []
    for t in range(min(len(v) for v in videos)):
        panels = [_label_panel(v[t], [p["camera"], f"{p['objects']}, {p['scene']}", f"frame {t}"])
                  for v, p in zip(videos, prompts, strict=True)]
        sep = np.full((panels[0].shape[0], 4, 3), 255, np.uint8)
        row = [x for p in panels for x in (p, sep)][:-1]
        pics.append(Image.fromarray(np.concatenate(row, axis=1)))
    buf = io.BytesIO()
    pics[0].save(buf, format="GIF", save_all=True, append_images=pics[1:], duration=int(1000 / fps), loop=0)
    write_bytes(path, buf.getvalue())


def write_strip(videos: list[np.ndarray], prompts: list[dict[str, str]], path: Path, columns: int = 12) -> None:
    from PIL import Image

    from fastcar_compile.core.atomic import write_bytes

    n = min(len(v) for v in videos)
    picks = sorted({int(round(i * (n - 1) / max(columns - 1, 1))) for i in range(columns)})
    rows = []
    for v, p in zip(videos, prompts, strict=True):
        cells = [_label_panel(v[t], [p["camera"] if t == picks[0] else "", f"frame {t}"]) for t in picks]
        sep = np.full((cells[0].shape[0], 2, 3), 255, np.uint8)
        rows.append(np.concatenate([x for c in cells for x in (c, sep)][:-1], axis=1))
        rows.append(np.full((4, rows[-1].shape[1], 3), 255, np.uint8))
    buf = io.BytesIO()
    Image.fromarray(np.concatenate(rows[:-1])).save(buf, format="PNG")
    write_bytes(path, buf.getvalue())


def summarize(r: dict) -> dict:
    """Frames per second over frames 25-75 and the last 50, RSS there, and the motion per frame (mean absolute
    pixel change from the previous frame, 0-255: a video that freezes reads 0)."""
    ms = np.asarray(r["frame_ms"])
    n = len(ms)
    early, late = slice(min(25, n // 4), min(75, max(n // 2, 1))), slice(max(n - 50, n // 2), n)
    v = r["video"].astype(np.float32)
    motion = np.abs(np.diff(v, axis=0)).mean(axis=(1, 2, 3)) if len(v) > 1 else np.zeros(0)
    return {"frames": n, "fps_early": float(1000 / np.median(ms[early])), "fps_late": float(1000 / np.median(ms[late])),
            "early_frames": [early.start, early.stop], "late_frames": [late.start, late.stop],
            "rss_mib_early": float(np.median(np.asarray(r["rss_mib"])[early])), "rss_mib_late": float(r["rss_mib"][-1]),
            "motion_first_quarter": float(motion[:max(n // 4, 1)].mean()) if motion.size else 0.0,
            "motion_last_quarter": float(motion[-max(n // 4, 1):].mean()) if motion.size else 0.0,
            "seconds": float(ms.sum() / 1000)}


def mode_rows(model, labels: dict[str, str], frames: int, cfg_scale: float, seed: int) -> list[dict]:
    """Per FAST-AR mode of DEMO_MODES on one prompt: density and recall (self and cross attention, against a dense
    attention on the side) over `frames` frames, and frames per second over the second half of a run without
    that side pass (the first chunks warm up)."""
    import dataclasses

    from fastcar_compile.demo.dit_train import text_embeds
    from fastcar_compile.dit import modes
    from fastcar_compile.dit.fastar import FastARDiT, totals
    from fastcar_compile.dit.stream import StreamSettings, rollout

    text, settings = text_embeds(labels), StreamSettings(frames=frames, seed=seed, cfg_scale=cfg_scale)
    rows = []
    for name, kw in DEMO_MODES.items():
        fa = modes.settings(**kw)
        side = FastARDiT(model, dataclasses.replace(fa, diagnostics=True))
        for _ in rollout(side, settings, text):
            pass
        ms = [1000 * c.seconds / c.frames.shape[1] for c in rollout(FastARDiT(model, fa), settings, text)]
        rows.append({"mode": name, **totals(side.stats), "fps": float(1000 / np.median(ms[len(ms) // 2:]))})
    return rows


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def main(argv: list[str]) -> int:
    from fastcar_compile.cli.stream import check_rollout_args

    a = build_parser().parse_args(argv)
    check_rollout_args(a, "frames", min_threads=1)
    from fastcar_compile.cli.stream import MAX_FRAMES
    from fastcar_compile.core.limits import check_int

    check_int("--mode-frames", a.mode_frames, 0, MAX_FRAMES, "frames per FAST-AR mode; 0 skips them")
    prompts = [parse_prompt(p) for p in (a.prompt or DEFAULT_PROMPTS)]
    from fastcar_compile.core import fileio

    fileio.check_output_dir(a.out, "--out")
    fileio.check_outputs({a.out / n: f"--out's {n}" for n in OUTPUTS})
    model = load_trained(a.weights)
    import torch

    torch.set_num_threads(a.threads)
    cfg = model.cfg
    print(f"streaming {len(prompts)} x {a.frames} frames from the trained DiT ({cfg.layers} blocks, hidden "
          f"{cfg.hidden}, {cfg.tokens_per_frame} tokens/frame, chunks of {cfg.chunk_frames}, {cfg.sink_frames} sink + "
          f"{cfg.window_frames}-frame window, 4 steps, CFG {a.cfg:g}) ...", flush=True)
    t0 = time.time()
    runs = [stream_prompt(model, p, a.frames, a.cfg, a.seed) for p in prompts]
    rows = [{"prompt": p, **summarize(r)} for p, r in zip(prompts, runs, strict=True)]
    by_mode = mode_rows(model, prompts[0], a.mode_frames, a.cfg, a.seed) if a.mode_frames else []
    from fastcar_compile.core.atomic import write_text

    with fileio.staged_dir(a.out) as tmp:
        write_gif([r["video"] for r in runs], prompts, tmp / "demo.gif")
        write_strip([r["video"] for r in runs], prompts, tmp / "strip.png")
        write_text(tmp / "results.json", json.dumps({
            "model": str(a.weights), "config": json.loads(cfg.to_json()), "settings": runs[0]["settings"],
            "threads": a.threads, "videos": rows, "modes": by_mode, "mode_frames": a.mode_frames,
            "frame_ms": [r["frame_ms"] for r in runs], "rss_mib": [r["rss_mib"] for r in runs]}, indent=1) + "\n")
    for r in rows:
        p = r["prompt"]
        print(f"  {p['camera']:>10} {p['objects']}: {r['frames']} frames, {r['fps_early']:.1f} frames/s at frames "
              f"{r['early_frames'][0]}-{r['early_frames'][1]}, {r['fps_late']:.1f} at {r['late_frames'][0]}-"
              f"{r['late_frames'][1]}, RSS {r['rss_mib_early']:.0f} -> {r['rss_mib_late']:.0f} MiB, motion "
              f"{r['motion_first_quarter']:.1f} -> {r['motion_last_quarter']:.1f} per frame")
    if by_mode:
        print(f"FAST-AR modes on {prompts[0]['camera']}, {a.mode_frames} frames (capped context; density and recall "
              "against a dense attention on the side):")
        for r in by_mode:
            print(f"  {r['mode']:<42} self density {_pct(r['self_density']):>6} recall {_pct(r['self_recall']):>6}  "
                  f"cross density {_pct(r['cross_density']):>6} recall {_pct(r['cross_recall']):>6}  "
                  f"{r['fps']:.1f} frames/s")
    print(f"wrote {a.out}/demo.gif, strip.png, results.json ({time.time() - t0:.0f} s)")
    return 0
