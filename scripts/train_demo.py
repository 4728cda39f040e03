"""Train a bundled demo video model (CPU, seeded) and write it into fastcar_compile/demo/assets/.

    python scripts/train_demo.py                 # the 1-layer model (8-18 min on 2 shared cores, 1 thread)
    python scripts/train_demo.py --long          # the 4-layer long-video model (16-frame clips, ~45 min)
    python scripts/train_demo.py --steps 20 --clips 100 --out /tmp/demo-smoke   # a smoke run

Writes the fp16 safetensors, config JSON and train log into --out (the 1-layer model also its tokenizer;
the long model reuses the shipped one), the loss curve PNG (--png), and prints tokenizer PSNR and dense
greedy PSNR on held-out clips. Run scripts/export_demo.py afterwards to refresh the 1-layer decoder.onnx.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

# One BLAS thread: on a busy 2-core machine a spinning multi-threaded BLAS made tokenizing 6x slower.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from fastcar_compile.demo import data  # noqa: E402
from fastcar_compile.demo.export import ASSETS, LONG_CONFIG, LONG_LOG, LONG_WEIGHTS, TOKENIZER, save_weights  # noqa: E402
from fastcar_compile.demo.metrics import psnr  # noqa: E402
from fastcar_compile.demo.model import LONG_CONFIG as LONG_MODEL  # noqa: E402
from fastcar_compile.demo.train import TrainSettings, train  # noqa: E402

DOCS = Path(__file__).resolve().parents[1] / "docs"
# The long model's recipe: 16-frame clips (1027 tokens), gaps up to 64 frames' worth of positions.
LONG_SETTINGS = dict(frames=16, clips=4000, steps=500, batch=8, lr=3e-3, warmup=40, position_gap=3072,
                     sdpa=True)


def report(model_w: Path, model_c: Path, tok_path: Path, frames: int, eval_clips: int, seed: int) -> dict:
    """Tokenizer and dense greedy PSNR on held-out clips, teacher-forced accuracy vs copying one frame back."""
    import torch

    from fastcar_compile.demo.export import load_model
    from fastcar_compile.demo.generate import torch_generate
    from fastcar_compile.demo.model import VIDEO_START
    from fastcar_compile.demo.tokenizer import PatchTokenizer
    from fastcar_compile.demo.train import tokenize_clips

    model = load_model(model_w, model_c)
    tok = PatchTokenizer.load(tok_path)
    clips = data.make_clips("eval", eval_clips, frames, seed)
    rec, gen_p, copy_p = [], [], []
    for c in clips:
        toks = tok.encode(c.frames)
        rec.append(psnr(c.frames, tok.decode(toks)))
        out = torch_generate(model, c.motion, toks[0], frames - 1)
        gen_p.append(psnr(c.frames[1:], tok.decode(out)[1:]))
        copy_p.append(psnr(c.frames[1:], np.repeat(tok.decode(toks[:1]), frames - 1, axis=0)))
    seqs = torch.from_numpy(tokenize_clips(tok, clips))
    L = tok.tokens_per_frame
    with torch.no_grad():
        pred = model(input_ids=seqs[:, :-1]).logits[:, VIDEO_START + L - 1:, :512].argmax(-1)
    tf_acc = float((pred == seqs[:, VIDEO_START + L:]).float().mean())
    copy_acc = float((seqs[:, VIDEO_START:-L] == seqs[:, VIDEO_START + L:]).float().mean())
    return {"tokenizer_psnr_eval": float(np.mean(rec)), "teacher_forced_acc": tf_acc,
            "copy_aligned_acc": copy_acc, "dense_greedy_psnr_vs_gt": float(np.mean(gen_p)),
            "copy_frame0_psnr_vs_gt": float(np.mean(copy_p)), "eval_clips": eval_clips, "frames": frames}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    d = TrainSettings()
    ap.add_argument("--long", action="store_true", help="train the 4-layer long-video model (LONG_SETTINGS)")
    ap.add_argument("--out", type=Path, default=ASSETS)
    ap.add_argument("--png", type=Path, default=None, help="loss curve (default docs/demo-loss.png or "
                                                          "docs/demo-long-loss.png)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--clips", type=int, default=None)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--threads", type=int, default=d.threads)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--eval-clips", type=int, default=16)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--init", type=Path, default=None, help="continue from these weights (same config)")
    ap.add_argument("--data-seed", type=int, default=None, help="use clip block N (fresh clips when continuing)")
    a = ap.parse_args()
    kw = dict(LONG_SETTINGS) if a.long else {}
    if a.init:
        kw.update(init=str(a.init), warmup=10)
    for k in ("steps", "clips", "batch", "lr", "data_seed"):
        if getattr(a, k) is not None:
            kw[k] = getattr(a, k)
    if a.long:
        kw.update(config=LONG_MODEL, tokenizer=str(TOKENIZER))
    s = TrainSettings(threads=a.threads, seed=a.seed, **kw)
    weights, config, log_json = ((a.out / LONG_WEIGHTS.name, a.out / LONG_CONFIG.name, a.out / LONG_LOG.name)
                                 if a.long else (a.out / "model.safetensors", a.out / "config.json",
                                                 a.out / "train_log.json"))
    png = a.png or DOCS / ("demo-long-loss.png" if a.long else "demo-loss.png")
    a.out.mkdir(parents=True, exist_ok=True)
    png.parent.mkdir(parents=True, exist_ok=True)
    model, tok, log = train(s, log_json=log_json, log_png=png)
    save_weights(model, s.config, weights, config)
    if not a.long:
        tok.save(a.out / "tokenizer.npz")
    tok_path = TOKENIZER if a.long else a.out / "tokenizer.npz"
    summary = report(weights, config, tok_path, s.frames, a.eval_clips, s.seed)
    summary["train_seconds"] = log["train_seconds"]
    log["summary"] = summary
    from fastcar_compile.core.atomic import write_text

    write_text(log_json, json.dumps(log, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
