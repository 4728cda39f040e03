"""The conditioned video model (6-layer LlamaForCausalLM over 8x8-token frames of the scene clips) and its
resumable CPU training loop.

Why its training differs from `train.train` (the small demo models): it runs for hours in the background on a
shared machine, so it must survive being stopped. Every batch is a pure function of (seed, step): clip
indices step * batch + i of `scenes.make_scene_clip` (never repeated), and the conditioning drop and position
gaps come from a generator seeded with (seed, step). A checkpoint therefore only needs the model, the
optimizer, the step and torch's RNG state to continue exactly where it stopped.

Why 8x8 tokens per frame and not 16x16: measured at 1 thread (6 layers, hidden 256, MLP 1024, one 16-frame clip
per step, fp32; `scripts/train_video_model.py throughput`), 8x8 frames (1028 tokens) trained at 347 tokens/s and 16x16 frames (4100 tokens) at 231: a 16x16
clip costs ~6x an 8x8 one, so the ~3 CPU hours would see ~6x fewer clips, and generating 64 frames would mean
16k positions per video, past the demo's 5-minute budget on 2 cores. bf16 autocast doubles the 8x8 rate.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from fastcar_compile.core.atomic import atomic_path
from fastcar_compile.core.errors import FastCarError
from fastcar_compile.demo import condition, scenes, training
from fastcar_compile.demo.model import DemoConfig, build_model

# 6 layers, hidden 256, MLP 8x wide (FastCar skips MLPs: their share of a decode step bounds its speed-up);
# copy-head init in layer 0 only (as the long demo model). 11.3 M parameters, 22.7 MB as fp16.
VIDEO_CONFIG = DemoConfig(hidden_size=256, intermediate_size=2048, num_hidden_layers=6, num_attention_heads=8,
                          num_key_value_heads=8, vocab_size=condition.VOCAB, max_position_embeddings=4160,
                          copy_offsets=(63, 62, 64, 55), copy_layers=(0,))
# Sizes for the scaling note (loss vs parameters vs CPU hours): same data, schedule and layout.
VIDEO_SIZES: dict[str, DemoConfig] = {
    "base": VIDEO_CONFIG,
    "small": replace(VIDEO_CONFIG, hidden_size=128, intermediate_size=1024, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=4),
}


@dataclass
class VideoTrainSettings:
    frames: int = 16
    batch: int = 8
    steps: int = 800  # the step the cosine schedule ends at
    lr: float = 1.5e-3
    warmup: int = 40
    # the step the warm-up + cosine starts at: a run continued past its schedule's end restarts the learning
    # rate from here (warm restart; the optimizer's moments are kept) instead of jumping mid-cosine
    schedule_start: int = 0
    weight_decay: float = 0.01
    seed: int = 0
    threads: int = 1
    uncond_prob: float = 0.1  # conditioning dropped to the unconditional prompt (CFG)
    # video positions start at VIDEO_START + g, g uniform in [0, position_gap] (0 = none): RoPE sees the
    # prompt-to-frame distances of 64-frame generation while training on 16-frame clips (see train.py)
    position_gap: int = 3072
    eval_every: int = 25
    eval_clips: int = 32
    checkpoint_seconds: float = 600.0
    bf16: bool = True
    device: str = "cpu"  # "cuda": an accelerator (batches then usually come from a `clippool.ClipPool`)
    # fp16 weights (safetensors) a fresh run starts from instead of the seeded init (ignored when resuming)
    init: str = ""
    tokenizer_sha256: str = ""  # the frame tokenizer's file hash: a resumed run must tokenize as it began
    config: DemoConfig = field(default_factory=lambda: VIDEO_CONFIG)


# Settings a resumed run must share with its checkpoint: they decide which clips and tokens a step sees and
# what the weights mean. (steps, lr, evaluation and checkpoint cadence may change between runs.)
_RESUME_FIXED = ("frames", "batch", "seed", "uncond_prob", "position_gap", "bf16", "tokenizer_sha256", "config")


def check_resumable(saved: dict, s: VideoTrainSettings, ckpt: Path) -> None:
    """One-line error when the checkpoint was trained with other data / model settings than `s`."""
    now = {**asdict(s), "config": s.config.to_dict()}
    for k in _RESUME_FIXED:
        old, new = saved.get(k), now[k]
        if old is not None and old != "" and old != new:
            raise FastCarError(f"checkpoint {ckpt} was trained with {k}={old!r}, not {new!r}; resume with the "
                               f"same settings or give another --ckpt folder")


def batch_for_step(tok, s: VideoTrainSettings, step: int) -> tuple[np.ndarray, np.ndarray]:
    """(sequences [batch, prompt + T*L] int64, position gaps [batch]) of training step `step`."""
    clips = [scenes.make_scene_clip("train", step * s.batch + i, s.frames, s.seed) for i in range(s.batch)]
    codes = tok.encode(np.stack([c.frames for c in clips]))
    rng = np.random.default_rng([s.seed, 7, step])
    drop = rng.random(s.batch) < s.uncond_prob
    seqs = np.stack([condition.sequence(None if d else c.labels, k) for c, k, d in zip(clips, codes, drop,
                                                                                         strict=True)])
    gaps = rng.integers(0, s.position_gap + 1, s.batch) if s.position_gap else np.zeros(s.batch, np.int64)
    return seqs, gaps


def heldout_sequences(tok, s: VideoTrainSettings) -> np.ndarray:
    clips = scenes.make_scene_clips("eval", s.eval_clips, s.frames, s.seed)
    codes = tok.encode(np.stack([c.frames for c in clips]))
    return np.stack([condition.sequence(c.labels, k) for c, k in zip(clips, codes, strict=True)])


def _loss(model, batch, gaps, L: int, bf16: bool, reduce: bool = True):
    """Cross-entropy of frames 1.. (frame 0 is always given at generation time)."""
    import torch

    pos = torch.arange(batch.shape[1] - 1, device=batch.device).expand(len(batch), -1).clone()
    pos[:, condition.VIDEO_START:] += gaps.to(batch.device)[:, None]
    with torch.autocast(batch.device.type, dtype=torch.bfloat16, enabled=bf16):
        logits = model(input_ids=batch[:, :-1], position_ids=pos).logits
    first = condition.VIDEO_START + L
    logits = logits[:, first - 1:].float()
    target = batch[:, first:]
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                           reduction="mean" if reduce else "none")
    return ce, logits.argmax(-1) == target


def evaluate(model, held, L: int, bf16: bool) -> dict:
    """Held-out loss, teacher-forced accuracy, and the accuracy of copying the token one frame back."""
    import torch

    model.eval()
    losses, hits = [], []
    with torch.no_grad():
        for i in range(0, len(held), 8):
            b = held[i:i + 8]
            ce, hit = _loss(model, b, torch.zeros(len(b), dtype=torch.long), L, bf16)
            losses.append(float(ce) * len(b))
            hits.append(hit.float().mean().item() * len(b))
    model.train()
    first = condition.VIDEO_START + L
    copy = float((held[:, first:] == held[:, first - L:-L]).float().mean())
    return {"eval_loss": sum(losses) / len(held), "eval_acc": sum(hits) / len(held), "copy_acc": copy}


def _lr(s: VideoTrainSettings, step: int) -> float:
    k, n = step - s.schedule_start, s.steps - s.schedule_start
    return s.lr * min(1.0, (k + 1) / s.warmup) * 0.5 * (1 + math.cos(math.pi * min(k, n) / n))


def save_checkpoint(path: Path, model, opt, step: int, s: VideoTrainSettings) -> None:
    """Model + optimizer + step + torch RNG, atomically (a stop mid-write leaves the previous one)."""
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    blob = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
            "torch_rng": torch.get_rng_state(), "settings": {**asdict(s), "config": s.config.to_dict()}}
    with atomic_path(path) as tmp:
        torch.save(blob, tmp)


def train_video_model(s: VideoTrainSettings, tok, ckpt_dir: Path, log_path: Path, until: int | None = None,
                      export: Path | None = None, batches=None, wall_seconds: float | None = None) -> int:
    """Train (resuming from ckpt_dir/checkpoint.pt when it exists) up to step `until` (default s.steps);
    append a JSON line per step and per evaluation to log_path; export fp16 weights at each checkpoint.
    `batches(step)` replaces `batch_for_step` (e.g. `ClipPool.batch`); `wall_seconds` ends the run (evaluated,
    checkpointed, exported) at the first step past that many seconds. Returns the step reached."""
    import torch

    from fastcar_compile.core.progress import bar as progress_bar
    from fastcar_compile.demo.export import save_weights

    if not 0 <= s.schedule_start < s.steps:
        raise FastCarError(f"schedule_start {s.schedule_start} must lie in [0, steps={s.steps}); give a larger --steps")
    if s.device.startswith("cuda") and not torch.cuda.is_available():
        raise FastCarError(f"device {s.device!r} asked for but torch sees no CUDA device; use --device cpu")
    started = time.time()
    torch.set_num_threads(s.threads)
    torch.manual_seed(s.seed)
    model = build_model(s.config, seed=s.seed)
    model.set_attn_implementation("sdpa")
    if s.init and not (ckpt_dir / "checkpoint.pt").exists():
        from safetensors.torch import load_file

        model.load_state_dict({k: v.float() for k, v in load_file(s.init).items()})
    model.to(s.device)
    opt = training.adamw(model, s.lr, s.weight_decay)
    ckpt = ckpt_dir / "checkpoint.pt"
    step = training.resume(ckpt, model, opt, lambda saved: check_resumable(saved, s, ckpt)) or 0
    until = s.steps if until is None else until
    L = tok.tokens_per_frame
    held = torch.from_numpy(heldout_sequences(tok, s)).to(s.device)
    batches = batches or (lambda k: batch_for_step(tok, s, k))
    params = sum(p.numel() for p in model.parameters())
    log = training.jsonl_log(log_path)

    log({"event": "start", "step": step, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
         "torch_threads": torch.get_num_threads(), "nice": os.nice(0), "params": params,
         "settings": {k: v for k, v in asdict(s).items() if k != "config"}, "config": s.config.to_dict(),
         **({"device_name": torch.cuda.get_device_name()} if s.device.startswith("cuda") else {})})
    model.train()
    last_ckpt = time.time()
    bar = progress_bar(range(step, until), initial=step, total=until, desc="train video model")
    for step in bar:
        t = time.time()
        seqs, gaps = batches(step)
        t_data = time.time() - t
        for g in opt.param_groups:
            g["lr"] = _lr(s, step)
        loss, _ = _loss(model, torch.from_numpy(seqs).to(s.device), torch.from_numpy(gaps), L, s.bf16)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        dt, loss = time.time() - t, loss.item()
        log({"step": step, "loss": loss, "lr": _lr(s, step), "seconds": dt, "data_seconds": t_data,
             "tokens_per_s": seqs.size / dt, "cpu_s": time.process_time()})
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{seqs.size / dt:.0f}")
        done = step + 1
        if wall_seconds is not None and time.time() - started >= wall_seconds:
            until = done  # out of time: finish as at the last step
        if done % s.eval_every == 0 or done == until:
            log({"step": step, **evaluate(model, held, L, s.bf16)})
        if time.time() - last_ckpt >= s.checkpoint_seconds or done == until:
            save_checkpoint(ckpt, model, opt, done, s)
            if export is not None:
                save_weights(model, s.config, export / "video.safetensors", export / "video.json")
            log({"event": "checkpoint", "step": done})
            last_ckpt = time.time()
        if done == until:
            break
    return until
