"""Train the bundled demo video model (CPU, seeded) and write it into fastcar_compile/demo/assets/.

    python scripts/train_demo.py                 # the shipped run (8-18 min on 2 shared cores, 1 thread)
    python scripts/train_demo.py --steps 20 --clips 100 --out /tmp/demo-smoke   # a smoke run

Writes model.safetensors (fp16), config.json, tokenizer.npz and train_log.json into --out, the loss
curve PNG next to the log (and --png), and prints tokenizer PSNR and dense greedy PSNR on held-out clips.
Run scripts/export_demo.py afterwards to refresh decoder.onnx from the saved weights.
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

from fastcar_compile.demo import data
from fastcar_compile.demo.export import ASSETS, save_weights
from fastcar_compile.demo.metrics import psnr
from fastcar_compile.demo.train import TrainSettings, train


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    d = TrainSettings()
    ap.add_argument("--out", type=Path, default=ASSETS)
    ap.add_argument("--png", type=Path, default=Path(__file__).resolve().parents[1] / "docs" / "demo-loss.png")
    ap.add_argument("--steps", type=int, default=d.steps)
    ap.add_argument("--clips", type=int, default=d.clips)
    ap.add_argument("--batch", type=int, default=d.batch)
    ap.add_argument("--threads", type=int, default=d.threads)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--eval-clips", type=int, default=16)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    a.png.parent.mkdir(parents=True, exist_ok=True)
    s = TrainSettings(steps=a.steps, clips=a.clips, batch=a.batch, threads=a.threads, seed=a.seed)
    model, tok, log = train(s, log_json=a.out / "train_log.json", log_png=a.png)
    save_weights(model, s.config, a.out / "model.safetensors", a.out / "config.json")
    tok.save(a.out / "tokenizer.npz")

    # Report: tokenizer reconstruction and dense greedy generation on held-out clips (fp16-rounded weights).
    from fastcar_compile.demo.export import load_model
    from fastcar_compile.demo.generate import torch_generate

    model = load_model(a.out / "model.safetensors", a.out / "config.json")
    clips = data.make_clips("eval", a.eval_clips, s.frames, s.seed)
    rec, gen_p, copy_p = [], [], []
    for c in clips:
        toks = tok.encode(c.frames)
        rec.append(psnr(c.frames, tok.decode(toks)))
        out = torch_generate(model, c.motion, toks[0], s.frames - 1)
        frames = tok.decode(out)
        gen_p.append(psnr(c.frames[1:], frames[1:]))
        copy_p.append(psnr(c.frames[1:], np.repeat(tok.decode(toks[:1]), s.frames - 1, axis=0)))
    # teacher-forced next-token accuracy on frames 1.. vs the "same token as one frame back" baseline
    import torch

    from fastcar_compile.demo.model import VIDEO_START
    from fastcar_compile.demo.train import tokenize_clips

    seqs = torch.from_numpy(tokenize_clips(tok, clips))
    L = tok.tokens_per_frame
    with torch.no_grad():
        pred = model(input_ids=seqs[:, :-1]).logits[:, VIDEO_START + L - 1:, :512].argmax(-1)
    tf_acc = float((pred == seqs[:, VIDEO_START + L:]).float().mean())
    copy_acc = float((seqs[:, VIDEO_START:-L] == seqs[:, VIDEO_START + L:]).float().mean())
    summary = {"tokenizer_psnr_eval": float(np.mean(rec)), "teacher_forced_acc": tf_acc,
               "copy_aligned_acc": copy_acc, "dense_greedy_psnr_vs_gt": float(np.mean(gen_p)),
               "copy_frame0_psnr_vs_gt": float(np.mean(copy_p)), "eval_clips": a.eval_clips,
               "train_seconds": log["train_seconds"]}
    log["summary"] = summary
    (a.out / "train_log.json").write_text(json.dumps(log, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
