"""The long-video demo model beyond its training length, and its FastCar threshold.

    python benchmarks/experiments/long_video.py --hold            # teacher-forced loss/accuracy per frame, 64-frame clips
    python benchmarks/experiments/long_video.py --calibrate       # tau for ~80% replay along dense generations

--hold: the model was trained on 16-frame clips (1027 positions) with random position gaps; here it reads
64-frame held-out clips (4099 positions) teacher-forced, and the next-token loss and accuracy per frame index
show whether it holds past frame 15 (next to "same token as one frame back", the copy baseline, which
does not depend on the model). Writes demo-long-hold.{json,png} into --out-dir.
--calibrate: TAS values (post-RoPE, every layer) along dense greedy generations of train-split clips by a
never-replaying compiled model with diagnostics outputs; the (1 - target) quantile is the tau whose replay
ratio is ~target on dense trajectories (FastCar's own trajectories replay a little differently: demo --long
reports the real ratio). Prints the value to put in fastcar_compile/demo/longvideo.py DEFAULT_LONG_TAU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

os.environ.setdefault("OMP_NUM_THREADS", "1")


def hold(clips: int, frames: int, out: Path) -> dict:
    import torch

    from fastcar_compile.core.atomic import save_figure, write_text
    from fastcar_compile.demo import data
    from fastcar_compile.demo.evaluate import load_tokenizer
    from fastcar_compile.demo.export import LONG_CONFIG, LONG_WEIGHTS, load_model
    from fastcar_compile.demo.model import CODES, VIDEO_START
    from fastcar_compile.demo.train import tokenize_clips

    torch.set_num_threads(1)
    tok = load_tokenizer()
    L = tok.tokens_per_frame
    model = load_model(LONG_WEIGHTS, LONG_CONFIG)
    seqs = torch.from_numpy(tokenize_clips(tok, data.make_clips("eval", clips, frames, seed=0)))
    losses, accs = [], []
    with torch.no_grad():
        for s in seqs:
            logits = model(input_ids=s[None, :-1]).logits[0, VIDEO_START + L - 1:, :CODES]
            tgt = s[VIDEO_START + L:]
            losses.append(torch.nn.functional.cross_entropy(logits, tgt, reduction="none").reshape(-1, L).mean(1))
            accs.append((logits.argmax(-1) == tgt).float().reshape(-1, L).mean(1))
    loss = torch.stack(losses).mean(0).numpy()
    acc = torch.stack(accs).mean(0).numpy()
    v = seqs[:, VIDEO_START:].reshape(len(seqs), frames, L)
    copy = (v[:, 1:] == v[:, :-1]).float().mean((0, 2)).numpy()
    res = {"frames": frames, "clips": clips, "loss_per_frame": loss.tolist(), "acc_per_frame": acc.tolist(),
           "copy_acc_per_frame": copy.tolist(),
           "loss_frames_1_15": float(loss[:15].mean()), "loss_frames_16_end": float(loss[15:].mean()),
           "acc_frames_1_15": float(acc[:15].mean()), "acc_frames_16_end": float(acc[15:].mean()),
           "copy_acc_frames_1_15": float(copy[:15].mean()), "copy_acc_frames_16_end": float(copy[15:].mean())}
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
    x = np.arange(1, frames)
    ax[0].plot(x, loss)
    ax[0].set_ylabel("next-token loss (nats), teacher-forced")
    ax[1].plot(x, acc, label="model")
    ax[1].plot(x, copy, "--", label="copy one frame back")
    ax[1].set_ylabel("next-token accuracy")
    ax[1].legend(fontsize=8)
    for a in ax:
        a.axvline(15.5, color="grey", ls=":")
        a.set_xlabel("frame (trained on frames 0-15: dotted line)")
        a.grid(alpha=0.3)
    fig.suptitle(f"long-video model on {clips} held-out {frames}-frame clips ({3 + frames * L} positions)", fontsize=9)
    fig.tight_layout()
    save_figure(fig, out / "demo-long-hold.png", dpi=110)
    write_text(out / "demo-long-hold.json", json.dumps(res, indent=1))
    return res


def calibrate(clips: int, frames: int, target: float) -> dict:
    from fastcar_compile.demo import data
    from fastcar_compile.demo.evaluate import compile_bundled, load_tokenizer
    from fastcar_compile.demo.longvideo import long_onnx
    from fastcar_compile.demo.model import prompt
    from fastcar_compile.demo.video import generate_video, open_session

    tok = load_tokenizer()
    with tempfile.TemporaryDirectory() as d:
        diag = compile_bundled(Path(d) / "diag.onnx", float("inf"), "rope", 0, model=long_onnx(), diagnostics=True,
                               frame_tokens=tok.tokens_per_frame)
        sess = open_session(diag, 1)
        tas = [generate_video(sess, prompt(c.motion), tok.encode(c.frames)[0], frames - 1, threshold=float("inf")).tas
               for c in data.make_clips("train", clips, frames, seed=1)]
    t = np.concatenate(tas)  # [steps, layers]
    tau = float(np.quantile(t.reshape(-1), 1 - target))
    return {"tau": tau, "target": target, "per_layer_replay_on_dense": (t > tau).mean(0).tolist(),
            "clips": clips, "frames": frames}


def long_genai_dir() -> Path:
    """The long model's onnxruntime-genai folder (the model builder's fp32 cpu graph of the shipped weights, with
    a one-word-per-id tokenizer), built once into the user cache."""
    import subprocess

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from fastcar_compile.demo.export import LONG_CONFIG, LONG_WEIGHTS, load_model
    from fastcar_compile.demo.longvideo import cache_dir, long_onnx

    genai_dir = cache_dir() / f"genai-{long_onnx(progress=False).stem}"
    if not (genai_dir / "genai_config.json").is_file():
        hf = genai_dir.with_name(genai_dir.name + "-hf")
        m = load_model(LONG_WEIGHTS, LONG_CONFIG)
        m.save_pretrained(hf)
        tk = Tokenizer(models.WordLevel({f"t{i}": i for i in range(m.config.vocab_size)}, unk_token="t0"))
        tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="t0", bos_token="t1", eos_token="t2",
                                pad_token="t0").save_pretrained(hf)
        subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o",
                        str(genai_dir), "-p", "fp32", "-e", "cpu", "-c", str(hf) + "-cache"], check=True,
                       stdout=subprocess.DEVNULL)
    return genai_dir



def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hold", action="store_true")
    ap.add_argument("--calibrate", action="store_true")
    ap.add_argument("--clips", type=int, default=8)
    ap.add_argument("--frames", type=int, default=64)
    ap.add_argument("--target", type=float, default=0.8)
    ap.add_argument("--out-dir", type=Path, default=Path("fastcar-out/bench"))
    a = ap.parse_args(argv)
    if not (a.hold or a.calibrate):
        ap.error("give --hold and/or --calibrate")
    if a.frames < 3:
        ap.error(f"--frames {a.frames}: give at least 3 (frame 0 is the prompt; the loss needs whole frames)")
    if a.hold:
        print(json.dumps({k: v for k, v in hold(a.clips, a.frames, a.out_dir).items() if "per_frame" not in k},
                         indent=1))
    if a.calibrate:
        print(json.dumps(calibrate(min(a.clips, 4), min(a.frames, 32), a.target), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
