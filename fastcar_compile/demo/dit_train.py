"""Training a small chunk-causal video DiT on the labelled scene clips, in pixel space, on the CPU.

Why pixels: the scene clips are 32x32 RGB, so a (1, 4, 4) patch gives 64 tokens per frame with no VAE to
train or ship, and every generated frame is a picture. The prompt is the clip's labels (`scenes.LABELS`), one
token per field, each a one-hot row over every label value: a frozen "text encoder" with nothing to learn;
the model's own text projection and cross-attention learn what the labels mean.

Why this objective (teacher-forced context, as CausVid's teacher forcing): the rollout (`stream.rollout`)
denoises a chunk in 4 flow-matching steps (t = 1000, 750, 500, 250) over a KV cache that the model itself
wrote from the clean chunks before it at t = 0. Training runs exactly that computation on real clips: chunk
by chunk, a noisy pass at one of the rollout's timesteps (the loss: flow velocity noise - x0) and a clean
pass at t = 0 whose K/V extend the cache of the next chunk; gradients flow through both. The first chunk is
the attention sink; with some probability the later chunks' RoPE positions jump by a random gap, so that the
distance from the sink frames to a frame hundreds of frames later is one the model has seen.

Why the self-forced batches (`selfforcing_prob`, Self-Forcing's exposure-bias fix without its DMD critic):
with teacher forcing the model only ever sees real frames as context, so at generation time its own blurry
frames take it out of distribution and the video drifts. A self-forced batch writes the first
`sf_real_chunks` real chunks to the cache, then lets the model generate the next k chunks itself, without
gradients, with the rollout's own sampler (4 steps, CFG, fresh noise per step, the t = 0 pass writing the
K/V); the loss is the teacher-forced one on the remaining chunks of the real clip over that self-generated
context. Self-Forcing has no ground truth for its continuation and needs a distribution-matching critic; here
the real sink chunk fixes the scene and the labels fix the camera, so the real clip's next chunks are the
continuation the generated ones should have led to: the regression teaches the model to pull a drifting
context back to the real clip (scheduled sampling over whole rollouts). The other batches stay teacher-forced
so that the model does not forget the clean-context case.

Why resumable this way: every batch (clip indices, noise, timesteps, prompt drop, gaps) is a pure function of
(seed, step), so a checkpoint holds the model, the optimizer and the step, and a resumed run reproduces the
weights of an uninterrupted one.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from fastcar_compile.core.atomic import atomic_path, write_text
from fastcar_compile.core.contract import DiTConfig
from fastcar_compile.core.errors import FastCarError
from fastcar_compile.demo import scenes, training
from fastcar_compile.dit.stream import STEPS

# One row per label value of every field, in LABELS order: the prompt's one-hot "embedding" width.
LABEL_VALUES: tuple[tuple[str, str], ...] = tuple((f, v) for f, vs in scenes.LABELS.items() for v in vs)
TEXT_DIM = len(LABEL_VALUES)

# The shipped model's shapes: 32x32 RGB pixels, patch 4 -> 8x8 = 64 tokens per frame; chunks of 2 frames, the
# first chunk kept as attention sinks, a 14-frame window.
DIT_PIXEL_CONFIG = DiTConfig(layers=4, hidden=128, heads=4, ffn=512, text_dim=TEXT_DIM, in_channels=3,
                             patch=(1, 4, 4), latent_h=scenes.FRAME, latent_w=scenes.FRAME, freq_dim=64, text_len=len(scenes.LABELS), chunk_frames=2,
                             sink_frames=2, window_frames=14)


def text_embeds(labels: dict[str, str] | None) -> np.ndarray:
    """[fields, TEXT_DIM] one-hot rows of the labels (None: the all-zero unconditional prompt of CFG)."""
    out = np.zeros((len(scenes.LABELS), TEXT_DIM), np.float32)
    if labels is None:
        return out
    for i, f in enumerate(scenes.LABELS):
        if (f, labels.get(f)) not in LABEL_VALUES:
            raise FastCarError(f"unknown label {f}={labels.get(f)!r}; fields and values: {scenes.LABELS}")
        out[i, LABEL_VALUES.index((f, labels[f]))] = 1.0
    return out


def to_pixels(frames: np.ndarray) -> np.ndarray:
    """uint8 frames [T, H, W, 3] -> the model's space [3, T, H, W] in [-1, 1]."""
    return (frames.astype(np.float32) / 127.5 - 1.0).transpose(3, 0, 1, 2)


def to_uint8(x: np.ndarray) -> np.ndarray:
    """The model's space [3, T, H, W] -> uint8 frames [T, H, W, 3]."""
    return (np.clip((x.transpose(1, 2, 3, 0) + 1.0) * 127.5, 0, 255) + 0.5).astype(np.uint8)


@dataclass(frozen=True)
class DiTTrainSettings:
    steps: int = 1000
    batch: int = 4
    frames: int = 16  # frames per training clip (8 chunks of 2: the sink chunk + 14 frames)
    lr: float = 4e-4
    warmup: int = 40
    weight_decay: float = 0.01
    uncond_prob: float = 0.1  # prompt dropped to all-zero rows: what makes CFG at generation time real
    gap_prob: float = 0.5  # chunks after the sink chunk moved by a random RoPE gap
    max_gap: int = 1000
    seed: int = 0
    threads: int = 1
    eval_every: int = 50
    eval_clips: int = 8
    checkpoint_seconds: float = 300.0
    selfforcing_prob: float = 0.0  # batches whose context after the real chunks is the model's own rollout
    sf_real_chunks: int = 1  # real chunks written to the cache before the self-generated ones (the sink)
    sf_cfg: float = 2.0  # guidance scale of the self-generated context (the demo's)
    sf_own_steps: bool = False  # the first scored chunk denoised from the sampler's own x_t, not noisy real frames
    config: DiTConfig = field(default_factory=lambda: DIT_PIXEL_CONFIG)


# Settings a resumed run must share with its checkpoint (the data and what the weights mean).
_RESUME_FIXED = ("batch", "frames", "uncond_prob", "gap_prob", "max_gap", "seed", "selfforcing_prob",
                 "sf_real_chunks", "sf_cfg", "sf_own_steps", "config")


def _settings_dict(s: DiTTrainSettings) -> dict:
    return {**asdict(s), "config": json.loads(s.config.to_json())}


def check_resumable(saved: dict, s: DiTTrainSettings, ckpt: Path) -> None:
    now = _settings_dict(s)
    default = _settings_dict(DiTTrainSettings())  # a setting added later: its default is what ran
    for k in _RESUME_FIXED:
        if saved.get(k, default[k]) != now[k]:
            raise FastCarError(f"checkpoint {ckpt} was trained with {k}={saved.get(k)!r}, not {now[k]!r}; resume "
                               "with the same settings or give another --ckpt folder")


@dataclass
class Batch:
    clean: np.ndarray  # [B, 3, T, H, W]
    noise: np.ndarray  # [B, 3, T, H, W]
    t: np.ndarray  # [B, chunks] timestep of each chunk's noisy pass
    text: np.ndarray  # [B, fields, TEXT_DIM]
    gap: int  # RoPE offset of the chunks after the first (one per batch: the rows share their positions)
    context: int = 0  # self-generated chunks after the real ones (0: teacher-forced)
    real: int = 0  # real chunks before the self-generated ones
    sample_noise: np.ndarray | None = None  # [context (+1), len(STEPS), B, 3, chunk, H, W]: the sampler's noise
    cfg_scale: float = 1.0  # guidance of the self-generated chunks


def make_batch(s: DiTTrainSettings, split: str, index0: int, count: int, rng: np.random.Generator) -> Batch:
    """`count` clips of `split` from clip index `index0`, with their noise, timesteps, prompts and gaps."""
    clips = [scenes.make_scene_clip(split, index0 + i, s.frames, s.seed) for i in range(count)]
    clean = np.stack([to_pixels(c.frames) for c in clips])
    chunks = s.frames // s.config.chunk_frames
    noise = rng.standard_normal(clean.shape).astype(np.float32)
    t = np.asarray(STEPS, np.float32)[rng.integers(0, len(STEPS), (count, chunks))]
    drop = rng.random(count) < s.uncond_prob
    text = np.stack([text_embeds(None if d else c.labels) for c, d in zip(clips, drop, strict=True)])
    gap = int(rng.integers(0, s.max_gap + 1)) if rng.random() < s.gap_prob else 0
    b = Batch(clean, noise, t, text, gap)
    # drawn only when self-forcing is on: a teacher-forced run's batches stay those of the settings without it
    if s.selfforcing_prob > 0 and rng.random() < s.selfforcing_prob and chunks > s.sf_real_chunks + 1:
        b.real, b.cfg_scale = s.sf_real_chunks, s.sf_cfg
        b.context = int(rng.integers(1, chunks - s.sf_real_chunks))  # at least one chunk left for the loss
        f = s.config.chunk_frames
        shape = (b.context + s.sf_own_steps, len(STEPS), count, clean.shape[1], f, *clean.shape[3:])
        b.sample_noise = rng.standard_normal(shape).astype(np.float32)
    return b


def batch_for_step(s: DiTTrainSettings, step: int) -> Batch:
    return make_batch(s, "train", step * s.batch, s.batch, np.random.default_rng([s.seed, 11, step]))


def heldout_batch(s: DiTTrainSettings) -> Batch:
    b = make_batch(s, "eval", 0, s.eval_clips, np.random.default_rng([s.seed, 12]))
    b.text = np.stack([text_embeds(c.labels) for c in scenes.make_scene_clips("eval", s.eval_clips, s.frames,
                                                                              s.seed)])
    b.gap = 0
    return b


def _start(b: Batch, c: int, f: int):
    """int64 [1]: the first RoPE frame of chunk c (the chunks after the sink chunk moved by the gap)."""
    import torch

    return torch.tensor([c * f + (b.gap if c else 0)], dtype=torch.int64)


def self_rollout(model, b: Batch) -> tuple[list, np.ndarray, list | None]:
    """The context of a self-forced batch, without gradients: the K/V cache (cond rows, 2*layers tensors
    [B, heads, (real + context) chunks * T, d]) after writing the b.real real chunks at t = 0 and then the
    b.context chunks the model generates itself over that cache, as `stream.rollout` generates them (per step
    x0 = x_t - sigma v, guided v = v_u + s (v_c - v_u), re-noised to the next sigma with the batch's noise; a
    t = 0 pass on the clean chunk writes its K/V); the generated frames [B, 3, context * chunk, H, W]; and
    when b.sample_noise has a chunk more than the context (`sf_own_steps`), the sampler's input x_t at each
    step of the next chunk over that cache [len(STEPS)] x [B, 3, chunk, H, W] (else None)."""
    import torch

    cfg = model.cfg
    f = cfg.chunk_frames
    guided = b.cfg_scale != 1.0
    text = torch.from_numpy(b.text)
    n = text.shape[0]
    with torch.no_grad():
        cross = model.text_kv(torch.cat([text, torch.zeros_like(text)]) if guided else text)
        rows = 2 * n if guided else n
        past = [text.new_zeros(rows, cfg.heads, 0, cfg.head_dim) for _ in range(2 * cfg.layers)]

        def write(x0, c):
            nonlocal past
            kv = model(x0.repeat(rows // n, 1, 1, 1, 1), torch.zeros(rows, f), _start(b, c, f), *past, *cross)[1:]
            past = [torch.cat([p, k], 2) for p, k in zip(past, kv, strict=True)]

        def sample(j, c):
            x = x0 = torch.from_numpy(b.sample_noise[j, 0])
            states = []
            for i, t in enumerate(STEPS):
                states.append(x)
                v = model(x.repeat(rows // n, 1, 1, 1, 1), torch.full((rows, f), t), _start(b, c, f), *past,
                          *cross)[0]
                v = v[:n] + b.cfg_scale * (v[:n] - v[n:]) if guided else v
                x0 = x - t / 1000.0 * v
                if i + 1 < len(STEPS):
                    nxt = STEPS[i + 1] / 1000.0
                    x = (1 - nxt) * x0 + nxt * torch.from_numpy(b.sample_noise[j, i + 1])
            return x0, states

        for c in range(b.real):
            write(torch.from_numpy(b.clean[:, :, c * f:(c + 1) * f]), c)
        made = []
        for j in range(b.context):
            x0 = sample(j, b.real + j)[0]
            write(x0, b.real + j)
            made.append(x0)
        own = sample(b.context, b.real + b.context)[1] if len(b.sample_noise) > b.context else None
    frames = torch.cat(made, 2).numpy() if made else b.clean[:, :, :0]
    return [p[:n] for p in past], frames, own


def teacher_forced_loss(model, b: Batch, reduce: bool = True):
    """Mean squared error of the flow velocity over every chunk, each denoised over the K/V of the clean chunks
    before it (written at t = 0, as the rollout writes them). A self-forced batch (b.context > 0): over the
    chunks after its self-generated context (`self_rollout`), the cache starting as that context's. Returns
    the mean, or per chunk [chunks scored]."""
    import torch

    cfg = model.cfg
    f = cfg.chunk_frames
    clean, noise = torch.from_numpy(b.clean), torch.from_numpy(b.noise)
    rows = clean.shape[0]
    first = b.real + b.context if b.context else 0
    past, own = ([clean.new_zeros(rows, cfg.heads, 0, cfg.head_dim) for _ in range(2 * cfg.layers)], None)
    if b.context:
        past, _, own = self_rollout(model, b)
    cross = model.text_kv(torch.from_numpy(b.text))
    losses = []
    for c in range(first, clean.shape[2] // f):
        sl = slice(c * f, (c + 1) * f)
        start = _start(b, c, f)
        t = torch.from_numpy(b.t[:, c])
        sigma = (t / 1000.0)[:, None, None, None, None]
        x0, eps = clean[:, :, sl], noise[:, :, sl]
        xt = (1 - sigma) * x0 + sigma * eps
        target = eps - x0
        if own is not None and c == first:  # the sampler's own x_t at each row's step; the velocity to x0
            xt = torch.stack([own[STEPS.index(float(ti))][r] for r, ti in enumerate(b.t[:, c])])
            target = (xt - x0) / sigma
        v = model(xt, t[:, None].expand(-1, f).contiguous(), start, *past, *cross)[0]
        losses.append(((v - target) ** 2).mean())
        if c + 1 < clean.shape[2] // f:
            kv = model(x0, torch.zeros(rows, f), start, *past, *cross)[1:]
            past = [torch.cat([p, k], 2) for p, k in zip(past, kv, strict=True)]
    stacked = torch.stack(losses)
    return stacked.mean() if reduce else stacked


def _lr(s: DiTTrainSettings, step: int) -> float:
    return s.lr * min(1.0, (step + 1) / s.warmup) * 0.5 * (1 + math.cos(math.pi * min(step, s.steps) / s.steps))


def save_checkpoint(path: Path, model, opt, step: int, s: DiTTrainSettings) -> None:
    """Model + optimizer + step, atomically (a stop mid-write leaves the previous checkpoint)."""
    import torch

    blob = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step, "settings": _settings_dict(s)}
    with atomic_path(path) as tmp:
        torch.save(blob, tmp)


def save_weights(model, folder: Path) -> None:
    """float16 model.safetensors + config.json: a folder `dit.checkpoints.load_config` reads."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().half().contiguous() for k, v in model.state_dict().items()}
    with atomic_path(folder / "model.safetensors") as tmp:
        save_file(sd, str(tmp))
    write_text(folder / "config.json", json.dumps(json.loads(model.cfg.to_json()), indent=1))


def new_model_and_optimizer(s: DiTTrainSettings):

    from fastcar_compile.dit.model import build

    model = build(s.config, seed=s.seed).train()
    return model, training.adamw(model, s.lr, s.weight_decay, betas=(0.9, 0.98))


def train_dit(s: DiTTrainSettings, ckpt: Path, log_path: Path, until: int | None = None,
              export: Path | None = None, minutes: float | None = None, init: Path | None = None) -> int:
    """Train from ckpt (when it exists; else from the weights file `init`, when given, with a fresh optimizer)
    up to step `until` (default s.steps) or for `minutes` of wall time;
    a JSON line per step and per evaluation to log_path; checkpoint (and fp16 export) every
    s.checkpoint_seconds and at the end. Returns the step reached."""
    import torch

    torch.set_num_threads(s.threads)
    model, opt = new_model_and_optimizer(s)
    resumed = training.resume(ckpt, model, opt, lambda saved: check_resumable(saved, s, ckpt))
    if resumed is None and init is not None:
        from fastcar_compile.dit.model import build

        model.load_state_dict(build(s.config, init).state_dict())
    step = resumed or 0
    until = s.steps if until is None else min(until, s.steps)
    held = heldout_batch(s)
    log = training.jsonl_log(log_path)

    log({"event": "start", "step": step, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
         "torch_threads": torch.get_num_threads(), "nice": os.nice(0),
         "params": sum(p.numel() for p in model.parameters()), "settings": _settings_dict(s),
         "init": None if init is None else str(init)})
    t_start = last_ckpt = time.time()
    done = step
    while done < until and (minutes is None or time.time() - t_start < 60 * minutes):
        t0 = time.time()
        b = batch_for_step(s, done)
        for g in opt.param_groups:
            g["lr"] = _lr(s, done)
        loss = teacher_forced_loss(model, b)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        log({"step": done, "loss": loss.item(), "context": b.context, "lr": _lr(s, done), "seconds": time.time() - t0,
             "cpu_s": time.process_time()})
        done += 1
        if done % s.eval_every == 0 or done == until:
            model.eval()
            with torch.no_grad():
                per_chunk = teacher_forced_loss(model, held, reduce=False)
            model.train()
            log({"step": done - 1, "eval_loss": per_chunk.mean().item(),
                 "eval_loss_per_chunk": [round(x, 5) for x in per_chunk.tolist()]})
        if time.time() - last_ckpt >= s.checkpoint_seconds:
            _checkpoint(ckpt, model, opt, done, s, export, log)
            last_ckpt = time.time()
    _checkpoint(ckpt, model, opt, done, s, export, log)
    return done


def _checkpoint(ckpt, model, opt, step, s, export, log) -> None:
    save_checkpoint(ckpt, model, opt, step, s)
    if export is not None:
        save_weights(model, export)
    log({"event": "checkpoint", "step": step, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
