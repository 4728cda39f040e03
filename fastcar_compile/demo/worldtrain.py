"""The token world model's resumable CPU training loop.

Every batch is a pure function of (seed, step) (`worldmodel.batch_for_step`), so a checkpoint of the model, the
optimizer, the step and torch's RNG continues exactly where a stopped run was: the resumed run ends with the weights
of an uninterrupted one. A JSON line per step and per held-out evaluation (loss and teacher-forced accuracy per cell
label: content the previous frame showed, revisited content, revisits further back than the window, new content)
goes to the log; the fp16 weights are written next to each checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict
from pathlib import Path

from fastcar_compile.core.atomic import atomic_path
from fastcar_compile.core.errors import FastCarError
from fastcar_compile.demo import training
from fastcar_compile.demo.worldmodel import (
    WorldTrainSettings,
    accuracy_by_label,
    as_torch,
    batch_for_step,
    build_world_model,
    forward_loss,
    heldout_batch,
)

WEIGHTS_NAME, CONFIG_NAME = "world.safetensors", "world.json"
# what a resumed run must share with its checkpoint: which sequences a step sees and what the weights mean
_RESUME_FIXED = ("data", "circuit", "config", "bf16", "tokenizer_sha256")


def settings_dict(s: WorldTrainSettings) -> dict:
    return json.loads(json.dumps(asdict(s)))  # tuples as lists, as they come back from a checkpoint


def check_resumable(saved: dict, s: WorldTrainSettings, ckpt: Path) -> None:
    now = settings_dict(s)
    for k in _RESUME_FIXED:
        if saved.get(k) != now[k]:
            raise FastCarError(f"checkpoint {ckpt} was trained with {k}={saved.get(k)!r}, not {now[k]!r}; resume "
                               "with the same settings or give another --ckpt folder")


def lr_at(s: WorldTrainSettings, step: int) -> float:
    k, n = step - s.schedule_start, s.steps - s.schedule_start
    return s.lr * min(1.0, (k + 1) / s.warmup) * 0.5 * (1 + math.cos(math.pi * min(k, n) / n))


def evaluate(model, held, s: WorldTrainSettings) -> dict:
    import torch

    model.eval()
    with torch.no_grad():
        loss, pred = forward_loss(model, as_torch(held), s.bf16)
    model.train()
    return {"eval_loss": float(loss), **{f"acc_{k}": v for k, v in
                                         accuracy_by_label(pred.numpy(), held, s.window_frames).items()}}


def train_world_model(s: WorldTrainSettings, tok, ckpt_dir: Path, log_path: Path, until: int | None = None,
                      wall_seconds: float | None = None) -> int:
    """Train from ckpt_dir/checkpoint.pt when it exists (else the seeded init) up to step `until` (default
    s.steps) or for `wall_seconds`; checkpoint + fp16 weights every s.checkpoint_seconds and at the end."""
    import torch

    from fastcar_compile.demo.export import save_weights

    if not 0 <= s.schedule_start < s.steps:
        raise FastCarError(f"schedule_start {s.schedule_start} must lie in [0, steps={s.steps}); give a larger --steps")
    started = time.time()
    torch.set_num_threads(s.threads)
    torch.manual_seed(s.data.seed)
    model = build_world_model(s.config, s.circuit, seed=s.data.seed)
    model.set_attn_implementation("sdpa")
    opt = training.adamw(model, s.lr, s.weight_decay)
    ckpt = ckpt_dir / "checkpoint.pt"
    step = training.resume(ckpt, model, opt, lambda saved: check_resumable(saved, s, ckpt)) or 0
    until = s.steps if until is None else until
    held = heldout_batch(tok, s.data, s.eval_paths)
    log = training.jsonl_log(log_path)

    log({"event": "start", "step": step, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
         "torch_threads": torch.get_num_threads(), "nice": os.nice(0),
         "params": sum(p.numel() for p in model.parameters()), "settings": settings_dict(s)})
    if step == 0:
        log({"step": -1, **evaluate(model, held, s)})  # the init's figures
    model.train()
    last_ckpt = time.time()
    done = step
    while done < until:
        t = time.time()
        b = batch_for_step(tok, s.data, done)
        t_data = time.time() - t
        for g in opt.param_groups:
            g["lr"] = lr_at(s, done)
        loss, _ = forward_loss(model, as_torch(b), s.bf16)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        dt = time.time() - t
        log({"step": done, "loss": loss.item(), "lr": lr_at(s, done), "seconds": dt, "data_seconds": t_data,
             "tokens_per_s": b.seqs.size / dt, "cpu_s": time.process_time()})
        done += 1
        if wall_seconds is not None and time.time() - started >= wall_seconds:
            until = done
        if done % s.eval_every == 0 or done == until:
            log({"step": done - 1, **evaluate(model, held, s)})
        if time.time() - last_ckpt >= s.checkpoint_seconds or done == until:
            ckpt_dir.mkdir(parents=True, exist_ok=True)
            blob = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": done,
                    "torch_rng": torch.get_rng_state(), "settings": settings_dict(s)}
            with atomic_path(ckpt) as tmp:
                torch.save(blob, tmp)
            save_weights(model, s.config, ckpt_dir / WEIGHTS_NAME, ckpt_dir / CONFIG_NAME)
            log({"event": "checkpoint", "step": done})
            last_ckpt = time.time()
    return done
