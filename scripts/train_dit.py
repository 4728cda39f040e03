"""Train the small pixel-space causal video DiT on the scene clips (CPU, seeded, resumable).

    nice -n 19 python scripts/train_dit.py                 # resumes from --ckpt when present
    python scripts/train_dit.py --until 100                # stop at step 100 (resume later)
    python scripts/train_dit.py --minutes 60               # stop after an hour of wall time (resume later)
    python scripts/train_dit.py plot                       # training/dit_model/loss.png from the log
    nice -n 19 python scripts/train_dit.py --init training/dit_model --selfforcing 0.6 --own-steps --lr 1e-4 \
        --steps 500 --ckpt ~/.cache/fastcar-compile/dit-selfforcing --out OUT   # continue with own rollouts

Writes a JSON line per step and per evaluation to training/dit_model/train_log.jsonl, checkpoints model +
optimizer + step to --ckpt every ~5 minutes (atomically) and the fp16 weights (model.safetensors +
config.json, what `fastcar-compile demo --dit` reads) to training/dit_model/ each time. The model, data and
objective: fastcar_compile/demo/dit_train.py.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace
from pathlib import Path

# One BLAS thread: the machine is shared.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

from fastcar_compile.demo.dit_train import DiTTrainSettings, train_dit  # noqa: E402

TRAINING = Path(__file__).resolve().parents[1] / "training" / "dit_model"
CKPT = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fastcar-compile" / "dit-model"


def plot(log: Path, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fastcar_compile.core.atomic import save_figure

    recs = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    held = [(r["step"], r["eval_loss"]) for r in recs if "eval_loss" in r]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    # self-forced steps score fewer chunks over another context: their losses get a curve of their own
    kinds = (("train", lambda r: True, "C0"),) if not any(r.get("context") for r in recs) else (
        ("teacher-forced", lambda r: not r.get("context"), "C0"), ("self-forced", lambda r: r.get("context"), "C2"))
    for name, keep, colour in kinds:
        train = [(r["step"], r["loss"]) for r in recs if "loss" in r and keep(r)]
        if not train:
            continue
        steps, loss = zip(*train, strict=True)
        k = 20
        smooth = [sum(loss[max(0, i - k + 1):i + 1]) / len(loss[max(0, i - k + 1):i + 1]) for i in range(len(loss))]
        ax.plot(steps, loss, color=colour, alpha=0.25, lw=0.6)
        ax.plot(steps, smooth, color=colour, label=f"{name} ({k}-step mean; light: per step)")
    if held:
        ax.plot(*zip(*held, strict=True), "o-", color="C3", ms=3, label="held-out clips")
    ax.set_xlabel("step (4 clips of 16 frames)")
    ax.set_ylabel("flow-velocity MSE")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    save_figure(fig, png, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", nargs="?", choices=("train", "plot"), default="train")
    p.add_argument("--steps", type=int, default=DiTTrainSettings.steps, help="length of the lr schedule")
    p.add_argument("--until", type=int, default=None, help="stop at this step")
    p.add_argument("--minutes", type=float, default=None, help="stop after this much wall time")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=DiTTrainSettings.lr, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=DiTTrainSettings.warmup, help="warm-up steps")
    p.add_argument("--selfforcing", type=float, default=0.0, metavar="P",
                   help="share of batches whose context is the model's own rollout (0: teacher forcing only)")
    p.add_argument("--own-steps", action="store_true",
                   help="self-forced batches: denoise the first scored chunk from the sampler's own x_t")
    p.add_argument("--init", type=Path, default=None,
                   help="start from this weights folder (config.json + model.safetensors) when no checkpoint")
    p.add_argument("--ckpt", type=Path, default=CKPT, help=f"checkpoint folder (default {CKPT})")
    p.add_argument("--out", type=Path, default=TRAINING, help="fp16 weights + log folder")
    a = p.parse_args()
    log = a.out / "train_log.jsonl"
    if a.what == "plot":
        plot(log, a.out / "loss.png")
        return
    if not 0 <= a.selfforcing <= 1:
        p.error(f"--selfforcing is a probability in [0, 1], got {a.selfforcing}")
    init = None
    if a.init is not None:
        from fastcar_compile.core.errors import FastCarError
        from fastcar_compile.dit.checkpoints import load_config

        try:
            cfg, init = load_config(str(a.init))
        except FastCarError as exc:
            p.error(str(exc))
        if cfg != DiTTrainSettings().config or init is None:
            p.error(f"--init {a.init}: not weights of the pixel DiT's config; give a folder train_dit.py wrote")
    s = replace(DiTTrainSettings(), steps=a.steps, seed=a.seed, lr=a.lr, warmup=a.warmup,
                selfforcing_prob=a.selfforcing, sf_own_steps=a.own_steps)
    step = train_dit(s, a.ckpt / "checkpoint.pt", log, until=a.until, export=a.out, minutes=a.minutes,
                     init=init)
    print(f"step {step}: weights in {a.out}")


if __name__ == "__main__":
    main()
