"""Training the pixel-space causal DiT (fastcar_compile/demo/dit_train.py): resumption, the objective, the prompt."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from fastcar_compile.core.errors import FastCarError  # noqa: E402
from fastcar_compile.demo import scenes  # noqa: E402
from fastcar_compile.demo.dit_train import (  # noqa: E402
    DIT_PIXEL_CONFIG,
    DiTTrainSettings,
    batch_for_step,
    save_weights,
    self_rollout,
    teacher_forced_loss,
    text_embeds,
    train_dit,
)
from fastcar_compile.dit.cache import FrameCache  # noqa: E402
from fastcar_compile.dit.checkpoints import load_config  # noqa: E402
from fastcar_compile.dit.model import build  # noqa: E402
from fastcar_compile.dit.stream import STEPS, StreamSettings, TorchDiT, rollout  # noqa: E402

# One layer, 16 tokens per frame (patch 8 on the 32x32 clips), 2 chunks of 2 frames: a step in well under a second.
SMALL = dataclasses.replace(DIT_PIXEL_CONFIG, layers=1, hidden=24, heads=2, ffn=32, patch=(1, 8, 8), freq_dim=16)
SETTINGS = DiTTrainSettings(steps=4, batch=1, frames=4, warmup=1, eval_every=2, eval_clips=1, config=SMALL,
                            gap_prob=1.0, checkpoint_seconds=1e9)


def test_resumed_training_gives_identical_weights(tmp_path):
    """2 steps at once == 1 step, stop, resume from the checkpoint, 1 more step: the same weights bit for bit."""
    a = tmp_path / "a"
    assert train_dit(SETTINGS, a / "ckpt.pt", a / "log.jsonl", until=2, export=a / "w") == 2
    b = tmp_path / "b"
    assert train_dit(SETTINGS, b / "ckpt.pt", b / "log.jsonl", until=1) == 1
    assert train_dit(SETTINGS, b / "ckpt.pt", b / "log.jsonl", until=2, export=b / "w") == 2
    sa, sb = (torch.load(p / "ckpt.pt", weights_only=False) for p in (a, b))
    assert sa["step"] == sb["step"] == 2
    for k, v in sa["model"].items():
        assert torch.equal(v, sb["model"][k]), k
    assert not torch.equal(sa["model"]["head.weight"], build(SMALL, seed=0).state_dict()["head.weight"])
    # the exported folder is what load_config / build read (fp16 weights)
    cfg, weights = load_config(str(a / "w"))
    assert cfg == SMALL and weights is not None
    m = build(cfg, weights)
    assert torch.allclose(m.state_dict()["head.weight"], sa["model"]["head.weight"].half().float())
    steps = [r for r in (a / "log.jsonl").read_text().splitlines() if '"loss"' in r]
    assert len(steps) == 2


def test_resume_refuses_other_settings(tmp_path):
    train_dit(SETTINGS, tmp_path / "ckpt.pt", tmp_path / "log.jsonl", until=1)
    with pytest.raises(FastCarError, match="was trained with batch=1, not 2"):
        train_dit(dataclasses.replace(SETTINGS, batch=2), tmp_path / "ckpt.pt", tmp_path / "log.jsonl", until=2)


def test_teacher_forced_loss_is_the_stream_computation():
    """The loss of chunk c equals an independent re-computation: the model's step on the noisy chunk over the
    K/V that the clean chunks before it wrote at t = 0 (chunk by chunk, as the rollout writes its cache)."""
    torch.manual_seed(0)
    model = build(SMALL, seed=1)
    s = dataclasses.replace(SETTINGS, frames=6, batch=2)
    b = batch_for_step(s, 3)
    got = teacher_forced_loss(model, b, reduce=False).detach().numpy()
    n = SMALL.layers
    cross = model.text_kv(torch.from_numpy(b.text))
    f = SMALL.chunk_frames
    with torch.no_grad():
        for c in range(3):
            past = []
            for j in range(c):  # the cache: each earlier clean chunk over the chunks before it
                pk = [torch.cat([p[i] for p in past], 2) if past else torch.zeros(2, SMALL.heads, 0, SMALL.head_dim)
                      for i in range(2 * n)]
                x0 = torch.from_numpy(b.clean[:, :, j * f:(j + 1) * f])
                start = j * f + (b.gap if j else 0)
                past.append(model(x0, torch.zeros(2, f), torch.tensor([start]), *pk, *cross)[1:])
            pk = [torch.cat([p[i] for p in past], 2) if past else torch.zeros(2, SMALL.heads, 0, SMALL.head_dim)
                  for i in range(2 * n)]
            sigma = b.t[:, c] / 1000.0
            x0 = b.clean[:, :, c * f:(c + 1) * f]
            eps = b.noise[:, :, c * f:(c + 1) * f]
            xt = (1 - sigma[:, None, None, None, None]) * x0 + sigma[:, None, None, None, None] * eps
            t = torch.from_numpy(np.repeat(b.t[:, c:c + 1], f, 1))
            v = model(torch.from_numpy(xt.astype(np.float32)), t, torch.tensor([c * f + (b.gap if c else 0)]), *pk,
                      *cross)[0].numpy()
            want = np.mean((v - (eps - x0)) ** 2)
            np.testing.assert_allclose(got[c], want, rtol=1e-4)


def test_prompt_rows_are_one_hot_labels():
    clip = scenes.make_scene_clip("train", 0, 4)
    e = text_embeds(clip.labels)
    assert e.shape == (len(scenes.LABELS), sum(len(v) for v in scenes.LABELS.values()))
    for i, (field, values) in enumerate(scenes.LABELS.items()):
        offset = sum(len(v) for v in list(scenes.LABELS.values())[:i])
        assert e[i].sum() == 1 and e[i, offset + values.index(clip.labels[field])] == 1
    assert not text_embeds(None).any()
    with pytest.raises(FastCarError, match="unknown label camera"):
        text_embeds({**clip.labels, "camera": "sideways"})


class _ForcedStart(TorchDiT):
    """The stream's eager backend with the first `real` chunks' cache writes (the t = 0 pass) fed the real clip's
    frames, the chunks after the first moved by a RoPE gap, the cache kept for inspection and the denoising
    inputs of every step recorded."""

    def __init__(self, model, clean, real, gap):
        super().__init__(model)
        self.clean, self.real, self.gap, self.inputs = clean, real, gap, []

    def new_cache(self, *args):
        self.cache = FrameCache(*args)
        return self.cache

    def step(self, latent, timestep, frame_start, past, cross):
        f = self.cfg.chunk_frames
        if frame_start < self.real * f and not timestep.any():
            latent = np.repeat(self.clean[:, :, frame_start:frame_start + f], latent.shape[0], 0)
        if timestep.any():
            self.inputs.append((frame_start, latent[:1].copy()))
        return super().step(latent, timestep, frame_start + (self.gap if frame_start else 0), past, cross)


@pytest.mark.parametrize("real,cfg_scale,gap,own", [(0, 2.0, 0, False), (1, 2.0, 7, False), (1, 1.0, 0, False),
                                                     (1, 2.0, 5, True)])
def test_self_forced_context_is_the_streams_own_rollout(real, cfg_scale, gap, own):
    """The K/V the self-forced loss sees are the cache `stream.rollout` (the generation loop) writes with the same
    noise, its first `real` chunks written from the real clip, and the loss of the chunk after them is the
    model's step on that cache (from noisy real frames, or with sf_own_steps from the stream's own input at the
    row's step, the target the velocity that lands on the real chunk); the generated frames are the stream's."""
    model = build(SMALL, seed=2)
    s = dataclasses.replace(SETTINGS, frames=8, batch=1, selfforcing_prob=1.0, sf_real_chunks=real,
                            sf_cfg=cfg_scale, sf_own_steps=own)
    b = next(b for b in (batch_for_step(s, i) for i in range(50)) if b.context >= 2)
    assert len(b.sample_noise) == b.context + own
    b.gap, f = gap, SMALL.chunk_frames
    chunks = b.real + b.context
    # the stream's noise: per chunk one draw to start and one per later step, from default_rng(seed)
    rng = np.random.default_rng(5)
    shape = (1, 3, f, SMALL.latent_h, SMALL.latent_w)
    draws = [[rng.standard_normal(shape) for _ in STEPS] for _ in range(chunks + own)]
    b.sample_noise = np.asarray(draws[b.real:], np.float32)
    past, made, states = self_rollout(model, b)

    backend = _ForcedStart(model, b.clean, b.real, gap)
    frames = [r.frames for r in rollout(backend, StreamSettings(frames=(chunks + own) * f, seed=5,
                                                                cfg_scale=cfg_scale, window_frames=0),
                                        text=b.text[0])]
    tokens = chunks * f * SMALL.tokens_per_frame
    want = [a[:, :, :tokens] for a in backend.cache.past(2 if cfg_scale != 1.0 else 1, SMALL.heads, SMALL.head_dim)]
    assert len(past) == len(want) == 2 * SMALL.layers
    for got, ref in zip(past, want, strict=True):
        assert got.shape == (1, *ref.shape[1:])
        np.testing.assert_allclose(got.numpy(), ref[:1], atol=2e-5)
    np.testing.assert_allclose(made[0], np.concatenate(frames[b.real:chunks], 1), atol=2e-5)

    c = chunks  # the first scored chunk over that cache
    loss = teacher_forced_loss(model, b, reduce=False).detach().numpy()
    assert loss.shape == (8 // f - chunks,)
    sigma = b.t[0, c] / 1000.0
    x0, eps = b.clean[:, :, c * f:(c + 1) * f], b.noise[:, :, c * f:(c + 1) * f]
    xt = ((1 - sigma) * x0 + sigma * eps).astype(np.float32)
    target = eps - x0
    if own:
        assert states is not None and len(states) == len(STEPS)
        stream_inputs = [x for start, x in backend.inputs if start == c * f]
        for got, ref in zip(states, stream_inputs, strict=True):
            np.testing.assert_allclose(got.numpy(), ref, atol=2e-5)
        xt = stream_inputs[STEPS.index(float(b.t[0, c]))]
        target = (xt - x0) / sigma
    else:
        assert states is None
    cross = [a[:1] for a in TorchDiT(model).text_kv(b.text)]
    v = TorchDiT(model).step(xt, np.full((1, f), b.t[0, c], np.float32), c * f + gap, [a[:1] for a in want],
                             cross)[0]
    np.testing.assert_allclose(loss[0], np.mean((v - target) ** 2), rtol=1e-4)


def test_selfforcing_batches_mix_and_leave_teacher_forced_ones_unchanged():
    s = dataclasses.replace(SETTINGS, frames=8, selfforcing_prob=0.5)
    contexts = [batch_for_step(s, i).context for i in range(40)]
    assert 8 < sum(c > 0 for c in contexts) < 32 and set(contexts) <= {0, 1, 2}
    tf, plain = batch_for_step(s, 3), batch_for_step(dataclasses.replace(s, selfforcing_prob=0.0), 3)
    assert np.array_equal(tf.noise, plain.noise) and np.array_equal(tf.t, plain.t) and tf.gap == plain.gap


def test_selfforced_training_resumes_bit_for_bit_from_init(tmp_path):
    """Continuing from a weights folder with self-forced batches: 2 steps at once == 1 + resume + 1."""
    start = build(SMALL, seed=3)
    save_weights(start, tmp_path / "init")
    s = dataclasses.replace(SETTINGS, frames=6, selfforcing_prob=1.0)
    init = tmp_path / "init" / "model.safetensors"
    a, b = tmp_path / "a", tmp_path / "b"
    assert train_dit(s, a / "ckpt.pt", a / "log.jsonl", until=2, init=init) == 2
    train_dit(s, b / "ckpt.pt", b / "log.jsonl", until=1, init=init)
    train_dit(s, b / "ckpt.pt", b / "log.jsonl", until=2, init=init)
    sa, sb = (torch.load(p / "ckpt.pt", weights_only=False)["model"] for p in (a, b))
    for k, v in sa.items():
        assert torch.equal(v, sb[k]), k
    # the first step started from the init weights (fp16-rounded), not from a fresh seeded model
    one = tmp_path / "one"
    train_dit(dataclasses.replace(s, lr=0.0), one / "ckpt.pt", one / "log.jsonl", until=1, init=init)
    got = torch.load(one / "ckpt.pt", weights_only=False)["model"]["head.weight"]
    assert torch.equal(got, start.state_dict()["head.weight"].half().float())
    assert '"context": ' in (a / "log.jsonl").read_text()
    with pytest.raises(FastCarError, match="selfforcing_prob=1.0, not 0.0"):
        train_dit(dataclasses.replace(s, selfforcing_prob=0.0), a / "ckpt.pt", a / "log.jsonl", until=3)
