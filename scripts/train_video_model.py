"""Train the conditioned video model on the CPU, in two stages (seeded; the model stage resumes by itself).

    python scripts/train_video_model.py tokenizer        # k-means vs VQ-VAE on held-out clips; keeps the better
    nice -n 19 python scripts/train_video_model.py model  # the 6-layer LM; resumes from --ckpt when present
    python scripts/train_video_model.py model --until 300 # stop at step 300 (resume later with a larger one)
    python scripts/train_video_model.py model --schedule-start 800 --steps 1400 --lr 6e-4  # warm restart
    python scripts/train_video_model.py throughput       # tokens/s of frames of 8x8 vs 16x16 tokens
    python scripts/train_video_model.py status --log LOG # step, losses, speed and time left of a run
    python scripts/train_video_model.py model --device cuda --batch 64 --steps 5000 --pool-workers 15 \
        --wall-minutes 7.5 --init training/video_model/video.safetensors   # on an accelerator (clip pool)
    python scripts/train_video_model.py heldout --weights A.safetensors B.safetensors --eval-clips 256

The tokenizer stage writes training/video_model/video_tokenizer.npz and training/video_model/
tokenizer_report.json (PSNR and token copy rate of both tokenizers on held-out clips). The model stage appends
a JSON line per step (loss, tokens/s, threads) and per evaluation (held-out loss and accuracy vs copying) to
training/video_model/train_log.jsonl, checkpoints model + optimizer + step + RNG to --ckpt every ~10 minutes,
and writes the fp16 weights (video.safetensors + video.json) next to the checkpoint each time.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import fields
from pathlib import Path

# One BLAS thread: the machine is shared; a spinning multi-threaded BLAS slows everyone (see train_demo.py).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from fastcar_compile.core.atomic import write_text  # noqa: E402
from fastcar_compile.demo import scenes  # noqa: E402
from fastcar_compile.demo.metrics import copy_rate, psnr  # noqa: E402
from fastcar_compile.demo.videomodel import VIDEO_SIZES, VideoTrainSettings, train_video_model  # noqa: E402

TRAINING = Path(__file__).resolve().parents[1] / "training" / "video_model"
# Next to the training log, not in the package's assets: the package ships it with the model (not yet trained).
VIDEO_TOKENIZER = TRAINING / "video_tokenizer.npz"
CKPT = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fastcar-compile" / "video-model"


def measure(tok, clips: list[scenes.SceneClip]) -> dict:
    frames = np.stack([c.frames for c in clips])
    codes = tok.encode(frames)
    return {"psnr_heldout": psnr(frames, tok.decode(codes)), "copy_rate_heldout": copy_rate(codes)}


def tokenizer_stage(a) -> None:
    import torch

    from fastcar_compile.demo.tokenizer import train_tokenizer
    from fastcar_compile.demo.vqvae import train_vqvae

    torch.set_num_threads(1)
    t0 = time.time()
    train = np.concatenate([c.frames for c in scenes.make_scene_clips("train", a.clips, 16, a.seed)])
    held = scenes.make_scene_clips("eval", a.eval_clips, 16, a.seed)
    rep: dict = {"train_frames": len(train), "eval_clips": a.eval_clips, "seed": a.seed, "torch_threads": 1,
                 "data_seconds": time.time() - t0}
    t = time.time()
    km = train_tokenizer(train, codes=512, seed=a.seed)
    rep["kmeans"] = {**measure(km, held), "seconds": time.time() - t, "codes": 512, "patch": 4}
    print("k-means", rep["kmeans"], flush=True)
    t, log = time.time(), []
    vq = train_vqvae(train, codes=512, steps=a.vq_steps, seed=a.seed, log=log)
    rep["vqvae"] = {**measure(vq, held), "seconds": time.time() - t, "codes": 512, "steps": a.vq_steps,
                    "params": sum(p.numel() for p in vq.net.parameters()), "log": log}
    print("VQ-VAE", {k: v for k, v in rep["vqvae"].items() if k != "log"}, flush=True)
    best = "vqvae" if rep["vqvae"]["psnr_heldout"] > rep["kmeans"]["psnr_heldout"] else "kmeans"
    rep["kept"] = best
    (vq if best == "vqvae" else km).save(a.tokenizer)
    a.report.parent.mkdir(parents=True, exist_ok=True)
    write_text(a.report, json.dumps(rep, indent=1))
    print(f"kept {best}: {a.tokenizer}")


def model_stage(a) -> None:
    import hashlib

    from fastcar_compile.demo.clippool import ClipPool, PoolSettings
    from fastcar_compile.demo.vqvae import load_frame_tokenizer

    kw = {f.name: getattr(a, f.name) for f in fields(VideoTrainSettings) if getattr(a, f.name, None) is not None}
    if a.init is not None:
        kw["init"] = str(a.init)
    tok = load_frame_tokenizer(a.tokenizer)
    s = VideoTrainSettings(**kw, config=VIDEO_SIZES[a.size], tokenizer_sha256=hashlib.sha256(a.tokenizer.read_bytes()).hexdigest())
    pool = None
    if a.pool_workers:  # clips made ahead by worker processes (an accelerator outruns per-step generation)
        pool = ClipPool(str(a.tokenizer), s.frames, s.batch, s.seed, s.uncond_prob, s.position_gap,
                        tok.tokens_per_frame, (a.until or s.steps) - s.schedule_start,
                        PoolSettings(first=a.pool_first, refresh=a.pool_refresh, window=a.pool_window,
                                     workers=a.pool_workers))
    try:
        step = train_video_model(s, tok, a.ckpt, a.log, until=a.until, export=a.ckpt,
                                 batches=None if pool is None else (lambda k: pool.batch(k - s.schedule_start)),
                                 wall_seconds=a.wall_minutes and a.wall_minutes * 60)
    finally:
        if pool is not None:
            print(f"clip pool: {pool.ready} clips made, training waited {pool.wait_s:.1f} s for them")
            pool.close()
    print(f"reached step {step}; checkpoint {a.ckpt / 'checkpoint.pt'}; weights {a.ckpt / 'video.safetensors'}")


def heldout_stage(a) -> None:
    """Held-out loss, teacher-forced accuracy and the copy baseline of fp16 weights files, on the same clips."""
    import torch

    from fastcar_compile.demo.export import load_model
    from fastcar_compile.demo.videomodel import evaluate, heldout_sequences
    from fastcar_compile.demo.vqvae import load_frame_tokenizer

    tok = load_frame_tokenizer(a.tokenizer)
    s = VideoTrainSettings(eval_clips=a.eval_clips or 32, seed=a.seed)
    held = torch.from_numpy(heldout_sequences(tok, s)).to(a.device)
    for w in a.weights:
        model = load_model(w, w.with_suffix(".json")).to(a.device)
        model.set_attn_implementation("sdpa")
        r = evaluate(model, held, tok.tokens_per_frame, bf16=True)
        print(f"{w}: {s.eval_clips} held-out clips: loss {r['eval_loss']:.4f}, accuracy {r['eval_acc']:.4f} "
              f"(copying one frame back: {r['copy_acc']:.4f})", flush=True)


def throughput_stage(a) -> None:
    """Training tokens/s of one 16-frame clip per step, frames of 8x8 vs 16x16 tokens (the frame-size choice)."""
    import torch

    from fastcar_compile.demo.model import DemoConfig, build_model

    torch.set_num_threads(1)
    for per_frame in (64, 256):
        for bf16 in (False, True):
            n = 16 * per_frame + 4
            cfg = DemoConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=4,
                             num_key_value_heads=4, max_position_embeddings=n + 8, copy_offsets=())
            model = build_model(cfg)
            model.set_attn_implementation("sdpa")
            opt = torch.optim.AdamW(model.parameters(), 1e-3)
            x = torch.randint(0, 512, (1, n))
            times = []
            for _ in range(3):
                t = time.time()
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    model(input_ids=x, labels=x).loss.backward()
                opt.step()
                opt.zero_grad()
                times.append(time.time() - t)
            print(f"{per_frame} tokens/frame, bf16={bf16}: {n / min(times):.0f} tokens/s "
                  f"({min(times):.2f} s per clip)", flush=True)


def status_stage(a) -> None:
    """Where a run stands, from its log: step, recent loss, held-out evaluations, speed and time left."""
    from fastcar_compile.core.errors import FastCarError

    if not a.log.is_file():
        raise FastCarError(f"training log {a.log} not found; give the run's --log")
    recs = [json.loads(x) for x in a.log.read_text().splitlines() if x.strip()]
    steps = {r["step"]: r for r in recs if "loss" in r}  # a restart repeats steps: the later line counts
    evals = {r["step"]: r for r in recs if "eval_loss" in r}
    start = [r for r in recs if r.get("event") == "start"][-1]
    total = a.steps or start["settings"]["steps"]
    if not steps:
        print(f"no step logged yet in {a.log}")
        return
    done = max(steps) + 1
    recent = [steps[k] for k in sorted(steps)[-20:]]
    wall = float(np.mean([r["seconds"] for r in recent]))
    # process CPU seconds restart from 0 in a resumed run: per-step differences within one process only
    diffs = [b["cpu_s"] - a["cpu_s"] for a, b in zip(recent[:-1], recent[1:], strict=True)
             if b["cpu_s"] > a["cpu_s"]]
    cpu = float(np.median(diffs)) if diffs else float("nan")
    tokens = recent[-1]["tokens_per_s"] * recent[-1]["seconds"]  # tokens per step
    print(f"step {done}/{total}; loss (last 20 steps) {np.mean([r['loss'] for r in recent]):.3f}; "
          f"{wall:.1f} s wall and {cpu:.1f} CPU s per step ({tokens / wall:.0f} tokens/s wall, "
          f"{tokens / cpu:.0f} per CPU s); {total - done} steps left: {(total - done) * wall / 3600:.1f} h at this "
          f"wall rate, {(total - done) * cpu / 3600:.1f} CPU h")
    for k in sorted(evals):
        e = evals[k]
        print(f"  step {k + 1}: held-out loss {e['eval_loss']:.3f}, accuracy {e['eval_acc']:.3f} "
              f"(copying one frame back: {e['copy_acc']:.3f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stage", choices=["tokenizer", "model", "throughput", "status", "heldout"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer", type=Path, default=VIDEO_TOKENIZER)
    ap.add_argument("--clips", type=int, default=400, help="tokenizer stage: training clips (16 frames)")
    ap.add_argument("--eval-clips", type=int, default=None)
    ap.add_argument("--vq-steps", type=int, default=600, help="tokenizer stage: VQ-VAE steps")
    ap.add_argument("--report", type=Path, default=TRAINING / "tokenizer_report.json")
    ap.add_argument("--ckpt", type=Path, default=CKPT, help="model stage: checkpoint folder (resumed from)")
    ap.add_argument("--log", type=Path, default=TRAINING / "train_log.jsonl")
    ap.add_argument("--until", type=int, default=None, help="model stage: stop at this step")
    ap.add_argument("--size", choices=sorted(VIDEO_SIZES), default="base", help="model stage: model size")
    for name in ("steps", "batch", "frames", "eval_every", "position_gap", "warmup", "schedule_start"):
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=None)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--device", default=None, help="model / heldout stage: torch device (cpu, cuda)")
    ap.add_argument("--init", type=Path, default=None, help="model stage: fp16 weights a fresh run starts from")
    ap.add_argument("--wall-minutes", type=float, default=None, help="model stage: end the run after this long")
    ap.add_argument("--pool-workers", type=int, default=0,
                    help="model stage: processes making clips ahead into a pool (0: per step, as on the CPU)")
    ap.add_argument("--pool-first", type=int, default=4096, help="clips made before the first step")
    ap.add_argument("--pool-refresh", type=float, default=16.0, help="new pool clips per step")
    ap.add_argument("--pool-window", type=int, default=40000, help="a step draws from the newest this many clips")
    ap.add_argument("--weights", type=Path, nargs="+", default=[], help="heldout stage: fp16 weights files")
    ap.add_argument("--checkpoint-seconds", type=float, default=None)
    a = ap.parse_args()
    if a.stage == "status":
        status_stage(a)
    elif a.stage == "throughput":
        throughput_stage(a)
    elif a.stage == "heldout":
        a.device = a.device or "cpu"
        heldout_stage(a)
    elif a.stage == "tokenizer":
        a.eval_clips = a.eval_clips or 48
        tokenizer_stage(a)
    else:
        model_stage(a)


if __name__ == "__main__":
    from fastcar_compile.core.errors import FastCarError

    try:
        main()
    except FastCarError as e:
        raise SystemExit(f"error: {e}") from None
