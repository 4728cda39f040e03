"""Train the token world model on the CPU (seeded; resumes by itself from --ckpt).

    nice -n 5 python scripts/train_world_model.py model             # resumes from --ckpt when present
    python scripts/train_world_model.py model --until 100           # stop at step 100 (resume later)
    python scripts/train_world_model.py status                      # step, losses, accuracies, time left

The model stage appends a JSON line per step (loss, tokens/s) and per held-out evaluation (loss and
teacher-forced accuracy per cell label) to training/world_model/train_log.jsonl, checkpoints model + optimizer +
step + RNG to --ckpt every ~10 minutes and writes the fp16 weights (world.safetensors + world.json) next to it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from fastcar_compile.demo.worldmodel import WorldData, WorldTrainSettings  # noqa: E402

TRAINING = Path(__file__).resolve().parents[1] / "training" / "world_model"
CKPT = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fastcar-compile" / "world-model"


def model_stage(a) -> None:
    from fastcar_compile.demo.export import TOKENIZER
    from fastcar_compile.demo.tokenizer import PatchTokenizer
    from fastcar_compile.demo.worldtrain import train_world_model

    tok = PatchTokenizer.load(TOKENIZER)
    s = WorldTrainSettings(steps=a.steps, lr=a.lr, threads=a.threads, schedule_start=a.schedule_start, bf16=a.bf16,
                           tokenizer_sha256=hashlib.sha256(Path(TOKENIZER).read_bytes()).hexdigest(),
                           data=WorldData(frames=a.frames, batch=a.batch, seed=a.seed))
    step = train_world_model(s, tok, a.ckpt, a.log, until=a.until,
                             wall_seconds=a.wall_minutes and a.wall_minutes * 60)
    print(f"reached step {step}; checkpoint {a.ckpt / 'checkpoint.pt'}")


def status_stage(a) -> None:
    recs = [json.loads(x) for x in a.log.read_text().splitlines() if x.strip()]
    steps = {r["step"]: r for r in recs if "loss" in r}
    evals = [r for r in recs if "eval_loss" in r]
    start = [r for r in recs if r.get("event") == "start"]
    total = start[-1]["settings"]["steps"] if start else None
    last = sorted(steps)[-20:]
    sec = sorted(steps[k]["seconds"] for k in last)
    done = max(steps) + 1 if steps else 0
    print(f"step {done}/{total}; loss (last 20 steps) {sum(steps[k]['loss'] for k in last) / max(len(last), 1):.3f};"
          f" median {sec[len(sec) // 2] if sec else float('nan'):.1f} s/step"
          + (f"; ~{(total - done) * sec[len(sec) // 2] / 3600:.1f} h left" if sec and total else ""))
    for r in evals[-a.evals:]:
        acc = " ".join(f"{k[4:]} {v:.3f}" for k, v in r.items() if k.startswith("acc_"))
        print(f"step {r['step'] + 1}: held-out loss {r['eval_loss']:.3f}; accuracy {acc}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="stage", required=True)
    m = sub.add_parser("model")
    d = WorldTrainSettings()
    m.add_argument("--steps", type=int, default=d.steps)
    m.add_argument("--until", type=int)
    m.add_argument("--lr", type=float, default=d.lr)
    m.add_argument("--schedule-start", type=int, default=d.schedule_start)
    m.add_argument("--threads", type=int, default=d.threads)
    m.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=d.bf16,
                   help="bfloat16 autocast (default on; --no-bf16 where the CPU lacks bf16 matmuls: several x faster)")
    m.add_argument("--frames", type=int, default=d.data.frames)
    m.add_argument("--batch", type=int, default=d.data.batch)
    m.add_argument("--seed", type=int, default=d.data.seed)
    m.add_argument("--wall-minutes", type=float)
    m.add_argument("--ckpt", type=Path, default=CKPT)
    m.add_argument("--log", type=Path, default=TRAINING / "train_log.jsonl")
    st = sub.add_parser("status")
    st.add_argument("--log", type=Path, default=TRAINING / "train_log.jsonl")
    st.add_argument("--evals", type=int, default=5)
    a = p.parse_args()
    {"model": model_stage, "status": status_stage}[a.stage](a)


if __name__ == "__main__":
    main()
