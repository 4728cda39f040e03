"""Conditioned video model training: batches are a pure function of (seed, step), the conditioning is dropped to
the unconditional prompt at the set rate, and a run stopped and resumed from its checkpoint ends with exactly
the weights of an uninterrupted run (model + optimizer + step + RNG restored)."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("skimage")
pytest.importorskip("sklearn")

from fastcar_compile.demo import condition, scenes  # noqa: E402
from fastcar_compile.demo.model import BOS, CODES, DemoConfig  # noqa: E402
from fastcar_compile.demo.tokenizer import PATCH, PatchTokenizer  # noqa: E402
from fastcar_compile.demo.videomodel import (  # noqa: E402
    VIDEO_CONFIG,
    VIDEO_SIZES,
    VideoTrainSettings,
    batch_for_step,
    train_video_model,
)

TINY = DemoConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, vocab_size=condition.VOCAB, max_position_embeddings=512,
                  copy_offsets=(63, 62), copy_layers=(0,))


@pytest.fixture(scope="module")
def tok() -> PatchTokenizer:
    cb = np.random.default_rng(0).random((CODES, PATCH * PATCH * 3)).astype(np.float32)
    return PatchTokenizer(cb)


def test_layout_ids_are_distinct_and_inside_the_vocabulary() -> None:
    ids = [condition.label_token(f, v) for f, vs in scenes.LABELS.items() for v in vs]
    special = [BOS, condition.UNCOND, condition.VIDEO_START_TOKEN]
    assert len(set(ids + special)) == len(ids) + 3
    assert min(ids + special) >= CODES and max(ids + special) == condition.VOCAB - 1
    assert VIDEO_CONFIG.vocab_size == condition.VOCAB
    assert all(c.vocab_size == condition.VOCAB for c in VIDEO_SIZES.values())
    assert condition.prompt(None) == [BOS] + [condition.UNCOND] * len(scenes.LABELS) + [
        condition.VIDEO_START_TOKEN]


def test_batches_are_seeded_and_drop_conditioning(tok) -> None:
    s = VideoTrainSettings(frames=4, batch=4, uncond_prob=0.5, position_gap=100)
    a, ga = batch_for_step(tok, s, 3)
    b, gb = batch_for_step(tok, s, 3)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(ga, gb)
    assert not np.array_equal(a, batch_for_step(tok, s, 4)[0])
    L = tok.tokens_per_frame
    assert a.shape == (4, condition.VIDEO_START + 4 * L) and (0 <= ga).all() and (ga <= 100).all()
    for i in range(4):  # step 3's clips are clip indices 12..15; frames are their tokens; prompt is labels or none
        clip = scenes.make_scene_clip("train", 12 + i, 4, s.seed)
        np.testing.assert_array_equal(a[i, condition.VIDEO_START:], tok.encode(clip.frames).reshape(-1))
        assert list(a[i, :condition.VIDEO_START]) in (condition.prompt(clip.labels), condition.prompt(None))
    drops = [np.mean([list(r[:condition.VIDEO_START]) == condition.prompt(None)
                      for r in batch_for_step(tok, VideoTrainSettings(frames=4, batch=4, uncond_prob=p), st)[0]])
             for p in (0.0, 1.0) for st in range(2)]
    assert drops == [0.0, 0.0, 1.0, 1.0]


def _settings(**kw) -> VideoTrainSettings:
    base = dict(frames=4, batch=2, steps=4, warmup=2, eval_every=2, eval_clips=2, position_gap=8,
                checkpoint_seconds=0.0, config=TINY)
    return VideoTrainSettings(**{**base, **kw})


def test_resume_matches_an_uninterrupted_run(tok, tmp_path, capsys) -> None:
    s = _settings()
    train_video_model(s, tok, tmp_path / "a", tmp_path / "a.jsonl")
    train_video_model(s, tok, tmp_path / "b", tmp_path / "b.jsonl", until=2)
    ck = torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=False)
    assert ck["step"] == 2 and {"model", "optimizer", "torch_rng", "settings"} <= set(ck)
    train_video_model(s, tok, tmp_path / "b", tmp_path / "b.jsonl", export=tmp_path / "b")
    wa = torch.load(tmp_path / "a" / "checkpoint.pt", weights_only=False)["model"]
    wb = torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=False)["model"]
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=0)
    recs = [json.loads(x) for x in (tmp_path / "b.jsonl").read_text().splitlines()]
    starts = [r for r in recs if r.get("event") == "start"]
    assert [r["step"] for r in starts] == [0, 2] and all(r["torch_threads"] == 1 for r in starts)
    steps = [r for r in recs if "loss" in r]
    assert [r["step"] for r in steps] == [0, 1, 2, 3] and all(np.isfinite(r["loss"]) for r in steps)
    assert [r["step"] for r in recs if "eval_loss" in r] == [1, 3]
    from safetensors.torch import load_file

    fp16 = load_file(str(tmp_path / "b" / "video.safetensors"))
    assert all(v.dtype == torch.float16 for v in fp16.values())
    torch.testing.assert_close(fp16["lm_head.weight"].float(), wb["lm_head.weight"], rtol=1e-3, atol=1e-3)
    # the status report reads the same log: 4 of 4 steps, both evaluations, the last loss of each step
    import argparse
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "train_video_model", Path(__file__).parents[1] / "scripts" / "train_video_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    capsys.readouterr()
    mod.status_stage(argparse.Namespace(log=tmp_path / "b.jsonl", steps=None))
    out = capsys.readouterr().out
    assert out.startswith("step 4/4;") and f"loss (last 20 steps) {np.mean([r['loss'] for r in steps]):.3f}" in out
    assert "step 2: held-out loss" in out and "step 4: held-out loss" in out


def test_warm_restart_schedule() -> None:
    """A continued run's learning rate: warm-up and cosine over [schedule_start, steps], as a fresh run's."""
    from fastcar_compile.demo.videomodel import _lr

    fresh, cont = VideoTrainSettings(steps=100, warmup=10, lr=1.0), VideoTrainSettings(
        steps=900, warmup=10, lr=1.0, schedule_start=800)
    for k in (0, 5, 9, 10, 50, 99, 100, 120):
        want = min(1.0, (k + 1) / 10) * (1 + np.cos(np.pi * min(k, 100) / 100)) / 2
        assert _lr(fresh, k) == pytest.approx(want) and _lr(cont, 800 + k) == pytest.approx(want)


def test_resume_refuses_other_data_settings(tok, tmp_path) -> None:
    """A checkpoint continued with another batch size or tokenizer would silently see other clips / tokens."""
    from fastcar_compile.core.errors import FastCarError

    train_video_model(_settings(tokenizer_sha256="aa"), tok, tmp_path, tmp_path / "log.jsonl", until=1)
    with pytest.raises(FastCarError, match="batch=2, not 3"):
        train_video_model(_settings(tokenizer_sha256="aa", batch=3), tok, tmp_path, tmp_path / "l.jsonl")
    with pytest.raises(FastCarError, match="tokenizer_sha256"):
        train_video_model(_settings(tokenizer_sha256="bb"), tok, tmp_path, tmp_path / "l.jsonl")
    assert train_video_model(_settings(tokenizer_sha256="aa", lr=1e-3), tok, tmp_path, tmp_path / "l.jsonl",
                             until=2) == 2


@pytest.mark.slow  # spawns 3 worker processes that each import torch: ~20-50 s on 2 shared cores
def test_clip_pool_batches_are_the_generators_clips(tok, tmp_path) -> None:
    """The accelerator's batches: step k's clips come from the sliding window of clips made so far, each is
    exactly the generator's clip tokenized (made in another process), and the draws depend on (seed, step)
    only, not on how many workers made them."""
    from fastcar_compile.demo.clippool import ClipPool, PoolSettings

    path = tmp_path / "tok.npz"
    tok.save(path)
    ref_tok = PatchTokenizer.load(path)
    p = PoolSettings(first=6, refresh=2, window=5, workers=2, chunk=3, clip_start=10)
    pool = ClipPool(str(path), 4, 4, 0, 0.5, 16, ref_tok.tokens_per_frame, 3, p)
    try:
        batches = [pool.batch(k) for k in range(3)]
    finally:
        pool.close()
    assert pool.total == 6 + 2 * 3 + 1
    prompt_none = condition.prompt(None)
    ref = [scenes.make_scene_clip("train", 10 + i, 4, 0) for i in range(pool.total)]
    ref_codes = [ref_tok.encode(c.frames).reshape(-1) for c in ref]
    for k, (seqs, gaps) in enumerate(batches):
        hi = 6 + 2 * k
        assert seqs.shape == (4, condition.VIDEO_START + 4 * ref_tok.tokens_per_frame) and seqs.dtype == np.int64
        assert ((0 <= gaps) & (gaps <= 16)).all()
        for row in seqs:
            # find the clip this row is: one of the window's clips (indices clip_start + [hi - window, hi))
            matches = []
            for i in range(max(0, hi - 5), hi):
                if np.array_equal(row[condition.VIDEO_START:], ref_codes[i]):
                    matches.append(i)
                    assert list(row[:condition.VIDEO_START]) in (condition.prompt(ref[i].labels), prompt_none)
            assert matches, f"step {k}: a row is no clip of its window"
    one = ClipPool(str(path), 4, 4, 0, 0.5, 16, ref_tok.tokens_per_frame, 3, PoolSettings(
        first=6, refresh=2, window=5, workers=1, chunk=5, clip_start=10))
    try:
        for k in range(3):
            for a, b in zip(batches[k], one.batch(k), strict=True):
                np.testing.assert_array_equal(a, b)
    finally:
        one.close()


def test_external_batches_init_and_wall_clock_stop(tok, tmp_path) -> None:
    """`batches` replaces the per-step generator, `init` loads the given fp16 weights, and a run out of wall
    time ends at once as at its last step: evaluated, checkpointed and exported."""
    from safetensors.torch import load_file

    s = _settings()
    train_video_model(s, tok, tmp_path / "a", tmp_path / "a.jsonl", until=1, export=tmp_path / "a")
    init = tmp_path / "a" / "video.safetensors"
    seen = []

    def batches(k):
        seen.append(k)
        return batch_for_step(tok, s, k + 100)

    s2 = _settings(init=str(init), lr=0.0)  # lr 0: the weights stay the init's
    step = train_video_model(s2, tok, tmp_path / "b", tmp_path / "b.jsonl", export=tmp_path / "b",
                             batches=batches, wall_seconds=0.0)
    assert step == 1 and seen == [0]
    recs = [json.loads(x) for x in (tmp_path / "b.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if "eval_loss" in r] == [0] and {"event": "checkpoint", "step": 1} in recs
    want, got = load_file(str(init)), load_file(str(tmp_path / "b" / "video.safetensors"))
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)
