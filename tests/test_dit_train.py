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
    teacher_forced_loss,
    text_embeds,
    train_dit,
)
from fastcar_compile.dit.config import load_config  # noqa: E402
from fastcar_compile.dit.model import build  # noqa: E402

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
