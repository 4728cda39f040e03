"""Compare pixel-DiT weights on held-out clips with the same seeds and noise for every model.

    python scripts/eval_dit.py BEFORE_DIR AFTER_DIR --names before after --out training/dit_model

- continuation: each held-out clip's first chunk is written to the cache, the model generates the other 14
  frames (CFG 2, the clip's labels, `dit_train.self_rollout`); PSNR / SSIM vs the real frames, and those of
  "repeat the last real frame" for scale;
- drift: 208-frame rollouts from noise (`stream.rollout`, the demo's prompts and CFG, two seeds): mean colour,
  sharpness (mean |pixel difference| to the right / below neighbour) and contrast (pixel std) over frames
  8-23 vs 192-207, next to the held-out clips' own;
- steering: at the same seed, the RMS difference between the prompts' videos, over the RMS difference
  between the two seeds of one prompt (> 1: the prompt moves the video more than the noise does);
- held-out loss: the training's teacher-forced one (`heldout_batch`) and a self-forced one (the same clips,
  3 generated chunks as context).

Writes eval.json, continuation.png and rollouts.png into --out and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from fastcar_compile.cli.demo_dit import DEFAULT_PROMPTS, parse_prompt  # noqa: E402
from fastcar_compile.core.atomic import save_figure, write_text  # noqa: E402
from fastcar_compile.demo import scenes  # noqa: E402
from fastcar_compile.demo.dit_train import (  # noqa: E402
    Batch,
    DiTTrainSettings,
    heldout_batch,
    self_rollout,
    teacher_forced_loss,
    text_embeds,
    to_pixels,
    to_uint8,
)
from fastcar_compile.demo.metrics import psnr, ssim  # noqa: E402
from fastcar_compile.dit.stream import STEPS, StreamSettings, TorchDiT, rollout  # noqa: E402

CFG = 2.0  # the demo's guidance
CLIPS = 16
LONG = 208
EARLY, LATE = slice(8, 24), slice(LONG - 16, LONG)
SEEDS = (0, 1)


def sharpness(frames: np.ndarray) -> float:
    """Mean |difference| to the right and lower neighbour of uint8 frames [T, H, W, 3], in pixel levels."""
    x = frames.astype(np.float64)
    return float((np.abs(np.diff(x, axis=1)).mean() + np.abs(np.diff(x, axis=2)).mean()) / 2)


def stats(frames: np.ndarray) -> dict:
    return {"rgb": [round(float(v), 2) for v in frames.reshape(-1, 3).mean(0)], "sharpness": round(sharpness(frames), 3),
            "contrast": round(float(frames.astype(np.float64).std()), 3)}


def continuation_batch(clips, real: int, seed: int) -> Batch:
    cfg = DiTTrainSettings().config
    f = cfg.chunk_frames
    clean = np.stack([to_pixels(c.frames) for c in clips])
    rng = np.random.default_rng([seed, 21])
    context = clean.shape[2] // f - real
    noise = rng.standard_normal((context, len(STEPS), *clean.shape[:2], f, *clean.shape[3:])).astype(np.float32)
    t = np.full((len(clips), clean.shape[2] // f), STEPS[1], np.float32)
    text = np.stack([text_embeds(c.labels) for c in clips])
    return Batch(clean, np.random.default_rng([seed, 22]).standard_normal(clean.shape).astype(np.float32), t, text,
                 0, context=context, real=real, sample_noise=noise, cfg_scale=CFG)


def evaluate(weights: Path, clips) -> tuple[dict, dict]:
    import torch

    from fastcar_compile.cli.demo_dit import load_trained

    torch.set_num_threads(1)
    model = load_trained(weights)
    out: dict = {}
    f = model.cfg.chunk_frames
    b = continuation_batch(clips, 1, 0)
    made = self_rollout(model, b)[1]
    truth = np.stack([to_uint8(x[:, f:]) for x in b.clean])
    gen = np.stack([to_uint8(x) for x in made])
    repeat = np.repeat(np.stack([to_uint8(x[:, f - 1:f]) for x in b.clean]), truth.shape[1], 1)
    out["continuation"] = {
        "psnr": round(float(np.mean([psnr(g, t) for g, t in zip(gen, truth, strict=True)])), 2),
        "ssim": round(float(np.mean([ssim(g, t) for g, t in zip(gen, truth, strict=True)])), 3),
        "psnr_repeat_last": round(float(np.mean([psnr(r, t) for r, t in zip(repeat, truth, strict=True)])), 2),
        "ssim_repeat_last": round(float(np.mean([ssim(r, t) for r, t in zip(repeat, truth, strict=True)])), 3),
        "psnr_first_chunk": round(float(np.mean([psnr(g[:f], t[:f]) for g, t in zip(gen, truth, strict=True)])), 2),
        "psnr_last_chunk": round(float(np.mean([psnr(g[-f:], t[-f:]) for g, t in zip(gen, truth, strict=True)])), 2),
        "sharpness": round(sharpness(gen), 3), "sharpness_truth": round(sharpness(truth), 3)}
    videos = {}
    for p in DEFAULT_PROMPTS:
        for seed in SEEDS:
            s = StreamSettings(frames=LONG, seed=seed, cfg_scale=CFG)
            frames = np.concatenate([r.frames for r in rollout(TorchDiT(model), s, text_embeds(parse_prompt(p)))], 1)
            videos[p, seed] = to_uint8(frames)
    early = [stats(v[EARLY]) for v in videos.values()]
    late = [stats(v[LATE]) for v in videos.values()]
    shift = [float(np.linalg.norm(np.subtract(a["rgb"], e["rgb"]))) for a, e in zip(late, early, strict=True)]
    out["drift"] = {
        "sharpness_early": round(float(np.mean([e["sharpness"] for e in early])), 3),
        "sharpness_late": round(float(np.mean([e["sharpness"] for e in late])), 3),
        "contrast_early": round(float(np.mean([e["contrast"] for e in early])), 2),
        "contrast_late": round(float(np.mean([e["contrast"] for e in late])), 2),
        "colour_shift": round(float(np.mean(shift)), 2),
        "per_video": {f"{p} seed {s}": {"early": e, "late": a} for (p, s), e, a in zip(videos, early, late,
                                                                                        strict=True)}}

    def rms(a, b, sl=slice(None)):
        return float(np.sqrt(np.mean((a[sl].astype(np.float64) - b[sl].astype(np.float64)) ** 2)))

    steer = {}
    for name, sl in (("frames_0_15", slice(0, 16)), ("all_frames", slice(None))):
        between = [rms(videos[p, s], videos[q, s], sl) for s in SEEDS for i, p in enumerate(DEFAULT_PROMPTS)
                   for q in DEFAULT_PROMPTS[i + 1:]]
        within = [rms(videos[p, SEEDS[0]], videos[p, SEEDS[1]], sl) for p in DEFAULT_PROMPTS]
        steer[name] = {"rms_between_prompts": round(float(np.mean(between)), 2),
                       "rms_between_seeds": round(float(np.mean(within)), 2),
                       "ratio": round(float(np.mean(between) / np.mean(within)), 3)}
    out["steering"] = steer
    s = DiTTrainSettings()
    held = heldout_batch(s)
    with torch.no_grad():
        out["heldout_loss_teacher_forced"] = round(teacher_forced_loss(model, held).item(), 4)
        hb = replace(held, real=1, context=3, cfg_scale=CFG)
        hb.sample_noise = continuation_batch(clips[:s.eval_clips], 1, 3).sample_noise[:3]
        out["heldout_loss_self_forced"] = round(teacher_forced_loss(model, hb).item(), 4)
    return out, {"continuation": gen, "truth": truth, "videos": videos}


def figures(names, pics, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    clips = (0, 1, 2)
    fig, axes = plt.subplots(len(clips) * (1 + len(names)), 1, figsize=(11, 1.0 * len(clips) * (1 + len(names))))
    k = 0
    for i in clips:
        for label, frames in [("truth", pics[names[0]]["truth"][i])] + [(n, pics[n]["continuation"][i]) for n in names]:
            axes[k].imshow(np.concatenate(list(frames), 1), interpolation="nearest")
            axes[k].set_yticks([])
            axes[k].set_xticks([])
            axes[k].set_ylabel(f"clip {i}\n{label}", rotation=0, ha="right", va="center", fontsize=8)
            k += 1
    fig.suptitle("held-out clips, frames 2-15 given frames 0-1 (CFG 2, same noise)", fontsize=9)
    fig.tight_layout()
    save_figure(fig, out / "continuation.png", dpi=90)

    at = (0, 16, 50, 100, 150, 200, LONG - 1)
    fig, axes = plt.subplots(len(DEFAULT_PROMPTS) * len(names), 1, figsize=(7, 1.2 * len(DEFAULT_PROMPTS) * len(names)))
    k = 0
    for p in DEFAULT_PROMPTS:
        for n in names:
            v = pics[n]["videos"][p, SEEDS[0]]
            axes[k].imshow(np.concatenate([v[j] for j in at], 1), interpolation="nearest")
            axes[k].set_yticks([])
            axes[k].set_xticks([16 + 32 * j for j in range(len(at))], [str(j) for j in at], fontsize=7)
            axes[k].set_ylabel(f"{p}\n{n}", rotation=0, ha="right", va="center", fontsize=7)
            k += 1
    fig.suptitle(f"rollouts from noise, seed {SEEDS[0]}, CFG 2: frame numbers below", fontsize=9)
    fig.tight_layout()
    save_figure(fig, out / "rollouts.png", dpi=90)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("weights", type=Path, nargs="+", help="folders with config.json + model.safetensors")
    ap.add_argument("--names", nargs="+", help="a name per folder (default: the folder names)")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    names = a.names or [w.name for w in a.weights]
    if len(names) != len(a.weights):
        ap.error(f"--names: {len(names)} names for {len(a.weights)} folders")
    s = DiTTrainSettings()
    clips = scenes.make_scene_clips("eval", CLIPS, s.frames, s.seed)
    real = np.stack([to_uint8(to_pixels(c.frames)) for c in clips])
    results, pics = {"clips": stats(real)}, {}
    for n, w in zip(names, a.weights, strict=True):
        results[n], pics[n] = evaluate(w, clips)
        print(n, json.dumps({k: v for k, v in results[n].items() if k != "drift"}),
              json.dumps({k: v for k, v in results[n]["drift"].items() if k != "per_video"}), flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    write_text(a.out / "eval.json", json.dumps(results, indent=1))
    figures(names, pics, a.out)


if __name__ == "__main__":
    main()
