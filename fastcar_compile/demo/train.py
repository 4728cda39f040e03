"""Train the demo: k-means tokenizer, then next-token training of the Llama decoder on tokenized clips (CPU).

Seeded end to end (data, init, batch order). The loss covers frames 1.. only: frame 0 is always given at
generation time, so spending capacity on unconditional image modelling would not help the demo.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fastcar_compile.core.atomic import save_figure, write_text
from fastcar_compile.core.progress import bar as progress_bar
from fastcar_compile.demo import data
from fastcar_compile.demo.model import VIDEO_START, DemoConfig, build_model, sequence
from fastcar_compile.demo.tokenizer import PatchTokenizer, train_tokenizer


@dataclass
class TrainSettings:
    clips: int = 6000
    frames: int = 8
    steps: int = 240
    batch: int = 16
    lr: float = 3e-3
    warmup: int = 30
    weight_decay: float = 0.01
    seed: int = 0
    threads: int = 1
    tokenizer_clips: int = 600
    codes: int = 512
    bf16: bool = True
    # Video positions start at VIDEO_START + g, g uniform in [0, position_gap] per sequence (0 = no gap).
    # Why: RoPE scores depend only on distances, and the one distance a 16-frame clip cannot show is the
    # prompt's (BOS/motion) from frames 16..63; the gap shows the model those distances during training.
    position_gap: int = 0
    tokenizer: str | None = None  # reuse this tokenizer (.npz) instead of training one
    sdpa: bool = False  # train with PyTorch's fused attention (same maths as eager; faster on long clips)
    init: str | None = None  # continue from these fp16 safetensors (same config) instead of a fresh init
    data_seed: int | None = None  # clip indices start at data_seed * clips (fresh clips when continuing)
    config: DemoConfig = field(default_factory=DemoConfig)


def tokenize_clips(tok: PatchTokenizer, clips: list[data.Clip]) -> np.ndarray:
    """[N, prompt + T*L] int64 sequences (one batched encode: per-clip calls are ~10x slower)."""
    codes = tok.encode(np.stack([c.frames for c in clips]))
    return np.stack([sequence(c.motion, k) for c, k in zip(clips, codes, strict=True)])


def _atomic_json(path: Path, obj) -> None:
    write_text(path, json.dumps(obj, indent=1))


def plot_loss(log: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(log["step"], log["loss"], lw=0.8, label="train (batch)")
    if log.get("eval_step"):
        ax.plot(log["eval_step"], log["eval_loss"], "o-", label="held-out clips")
    ax.set_xlabel("step")
    ax.set_ylabel("next-token cross-entropy (nats)")
    ax.set_title("demo decoder training")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, png, dpi=120)


def train(s: TrainSettings, log_json: Path | None = None, log_png: Path | None = None,
          eval_clips: int = 32):
    """Returns (model, tokenizer, log). Progress via tqdm."""
    import torch

    torch.set_num_threads(s.threads)
    torch.manual_seed(s.seed)
    t0 = time.time()
    if s.tokenizer:
        tok = PatchTokenizer.load(s.tokenizer)
    else:
        tok_frames = np.concatenate([c.frames for c in data.make_clips("train", s.tokenizer_clips, s.frames,
                                                                       s.seed)])
        tok = train_tokenizer(tok_frames, codes=s.codes, seed=s.seed)
    first = (s.data_seed or 0) * s.clips
    clips = [data.make_clip("train", first + i, s.frames, s.seed) for i in progress_bar(range(s.clips), desc="train clips")]
    seqs = torch.from_numpy(tokenize_clips(tok, clips))
    ev = torch.from_numpy(tokenize_clips(tok, data.make_clips("eval", eval_clips, s.frames, s.seed)))
    L = tok.tokens_per_frame
    first_loss_pos = VIDEO_START + L  # labels from frame 1 on
    model = build_model(s.config, seed=s.seed)
    if s.init:
        from safetensors.torch import load_file

        model.load_state_dict({k: v.float() for k, v in load_file(s.init).items()})
    if s.sdpa:
        model.set_attn_implementation("sdpa")
    model.train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": s.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=s.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(s.seed + 1)
    log: dict = {"step": [], "loss": [], "lr": [], "eval_step": [], "eval_loss": [],
                 "settings": {k: v for k, v in s.__dict__.items() if k != "config"}, "config": s.config.to_dict()}

    def loss_of(batch: torch.Tensor, gap: torch.Tensor | None = None) -> torch.Tensor:
        pos = None
        if gap is not None:
            pos = torch.arange(batch.shape[1] - 1).expand(len(batch), -1).clone()
            pos[:, VIDEO_START:] += gap[:, None]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=s.bf16):
            logits = model(input_ids=batch[:, :-1], position_ids=pos).logits
        logits = logits[:, first_loss_pos - 1:].float()
        target = batch[:, first_loss_pos:]
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))

    def eval_loss() -> float:
        model.eval()
        with torch.no_grad():
            v = float(np.mean([loss_of(ev[i:i + 8]).item() for i in range(0, len(ev), 8)]))
        model.train()
        return v

    order = torch.randperm(len(seqs), generator=gen)
    pos = 0
    bar = progress_bar(range(s.steps), desc="train")
    for step in bar:
        if pos + s.batch > len(order):
            order, pos = torch.randperm(len(seqs), generator=gen), 0
        batch = seqs[order[pos:pos + s.batch]]
        pos += s.batch
        lr = s.lr * min(1.0, (step + 1) / s.warmup) * 0.5 * (1 + math.cos(math.pi * step / s.steps))
        for g in opt.param_groups:
            g["lr"] = lr
        gap = torch.randint(0, s.position_gap + 1, (len(batch),), generator=gen) if s.position_gap else None
        loss = loss_of(batch, gap)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        log["step"].append(step)
        log["loss"].append(float(loss.item()))
        log["lr"].append(lr)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if (step + 1) % max(1, s.steps // 8) == 0 or step + 1 == s.steps:
            log["eval_step"].append(step)
            log["eval_loss"].append(eval_loss())
            if log_json:
                _atomic_json(log_json, log)
            if log_png:
                plot_loss(log, log_png)
    log["train_seconds"] = time.time() - t0
    model.eval()
    if log_json:
        _atomic_json(log_json, log)
    if log_png:
        plot_loss(log, log_png)
    return model, tok, log
