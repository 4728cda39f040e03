"""The Table 1 suite's density and recall (benchmarks/bench_dit_table1.structure) against a NumPy brute force:
every query's dense softmax over the uncompressed cache and its chunk, the selection AnnSA / AnnCA make by the
rules (sinks, local frames, the chunk itself, a shared bucket in any table; a prompt token kept for a frame
when any of its queries shares a bucket), summed the obvious way."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_dit_table1 as bench  # noqa: E402

from fastcar_compile.dit import modes  # noqa: E402
from fastcar_compile.dit.cache import FrameCache  # noqa: E402
from fastcar_compile.dit.config import PRESETS  # noqa: E402
from fastcar_compile.dit.fastar import FastARDiT  # noqa: E402
from fastcar_compile.dit.model import build  # noqa: E402
from fastcar_compile.dit.stream import StreamSettings, rollout  # noqa: E402
from fastcar_compile.fastar.lsh import SignLSH  # noqa: E402

CFG = dataclasses.replace(PRESETS["tiny"], window_frames=3)  # 1 sink + 3 frames: eviction within 8 frames


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_density_and_recall_equal_a_numpy_brute_force(monkeypatch):
    model = build(CFG, seed=2)
    fa = modes.settings(annsa="lsh", annca=True, lsh_bits=2, ann_tables=2, annsa_local=1, ann_always=True)
    calls = {"self": [], "cross": []}
    orig_sa, orig_ca = FastARDiT.self_attention, FastARDiT.cross_attention

    def spy_sa(self, i, q, k, v, state, frame_start):
        frames = state.shadow.resident
        B, H, _, d = q.shape
        past = state.shadow.past(B, H, d)[2 * i] if frames else np.zeros((B, H, 0, d), np.float32)
        calls["self"].append((q.numpy().copy(), k.numpy().copy(), past.copy(), list(frames), frame_start))
        return orig_sa(self, i, q, k, v, state, frame_start)

    def spy_ca(self, i, cq, ck, cv, frames, state):
        calls["cross"].append((cq.numpy().copy(), ck.numpy().copy(), frames))
        return orig_ca(self, i, cq, ck, cv, frames, state)

    monkeypatch.setattr(FastARDiT, "self_attention", spy_sa)
    monkeypatch.setattr(FastARDiT, "cross_attention", spy_ca)
    text = np.random.default_rng(0).standard_normal((CFG.text_len, CFG.text_dim)).astype(np.float32)
    got = bench.structure(model, fa, StreamSettings(frames=8, seed=1, cfg_scale=2.0), text)

    lsh = SignLSH(CFG.head_dim, 2, 2, 0)
    T, d = CFG.tokens_per_frame, CFG.head_dim
    executed = dense = 0
    recall = 0.0
    queries = 0
    for q, k, past, frames, start in calls["self"]:
        keys = np.concatenate([past, k], 2)  # [B, H, P + Q, d]
        frame_of = np.concatenate([np.repeat(frames, T), np.full(k.shape[2], -1)]).astype(int)
        always = (frame_of == -1) | ((frame_of >= 0) & (frame_of < CFG.sink_frames)) | (frame_of >= start - 1)
        p = _softmax(np.einsum("bhqd,bhkd->bhqk", q, keys) / np.sqrt(d))
        share = (lsh.codes(q)[:, :, :, None, :] == lsh.codes(keys)[:, :, None, :, :]).any(-1)  # [B, H, Q, K]
        sel = always[None, None, None, :] | share
        executed += int(sel.sum())
        dense += sel.size
        recall += float((p * sel).sum())
        queries += q.shape[0] * q.shape[1] * q.shape[2]
    assert got["self_density"] == pytest.approx(executed / dense, abs=1e-12)
    assert 0 < got["self_density"] < 1
    assert got["self_recall"] == pytest.approx(recall / queries, rel=1e-6)

    executed = dense = 0
    recall = 0.0
    queries = 0
    for cq, ck, frames in calls["cross"]:
        B, H, Q, _ = cq.shape
        per = Q // frames
        qc, kc = lsh.codes(cq), lsh.codes(ck)  # [B, H, Q, tables], [B, H, L, tables]
        hit = (qc[:, :, :, None, :] == kc[:, :, None, :, :]).any(-1)  # [B, H, Q, L]
        kept = hit.reshape(B, H, frames, per, -1).any(3)  # [B, H, frames, L]
        sel = np.repeat(kept, per, axis=2)  # each query sees its frame's kept tokens
        p = _softmax(np.einsum("bhqd,bhld->bhql", cq, ck) / np.sqrt(d))
        executed += int(sel.sum())
        dense += sel.size
        recall += float((p * sel).sum())
        queries += B * H * Q
    assert got["cross_density"] == pytest.approx(executed / dense, abs=1e-12)
    assert got["cross_recall"] == pytest.approx(recall / queries, rel=1e-6)


STEPS = (1000.0, 750.0, 500.0, 250.0)


def _eager_full_context(model, frames, seed, scale, text):
    """The full-context rollout written out with the eager model alone: every chunk attends to the clean K/V
    of every earlier chunk (torch.cat, nothing evicted); CFG on two rows (prompt, zeros); DMD re-noising.
    Returns (clean chunks [C, F, H, W], per layer K/V of every frame)."""
    cfg = model.cfg
    f = cfg.chunk_frames
    shape = (1, cfg.in_channels, f, cfg.latent_h, cfg.latent_w)
    rows = torch.from_numpy(np.stack([text, np.zeros_like(text)]).astype(np.float32))
    rng = np.random.default_rng(seed)
    kv = [torch.zeros(2, cfg.heads, 0, cfg.head_dim) for _ in range(2 * cfg.layers)]
    chunks = []
    with torch.no_grad():
        cross = model.text_kv(rows)
        for start in range(0, frames, f):
            fs = torch.tensor([start])
            x = rng.standard_normal(shape).astype(np.float32)
            for i, t in enumerate(STEPS):
                v = model(torch.from_numpy(np.repeat(x, 2, 0)), torch.full((2, f), t), fs, *kv, *cross)[0].numpy()
                v = v[:1] + scale * (v[:1] - v[1:])
                x0 = x - t / 1000 * v
                if i + 1 < len(STEPS):
                    nxt = STEPS[i + 1] / 1000
                    x = ((1 - nxt) * x0 + nxt * rng.standard_normal(shape)).astype(np.float32)
            x0 = x0.astype(np.float32)
            out = model(torch.from_numpy(np.repeat(x0, 2, 0)), torch.zeros(2, f), fs, *kv, *cross)
            kv = [torch.cat([p, n], 2) for p, n in zip(kv, out[1:], strict=True)]
            chunks.append(x0[0])
    return chunks, [a.numpy() for a in kv]


def test_full_context_dense_rollout_equals_the_eager_model():
    """The table's baseline: real chunks to frame 8 (its own cache, nothing evicted), then a chunk at frame 8 over
    a cache built from an archive of every earlier frame's K/V (here the reference's own), both equal the eager
    model's full-context rollout within 1e-4; the archiving capped rollout keeps its window and archives all."""
    model = build(CFG, seed=3)
    text = np.random.default_rng(5).standard_normal((CFG.text_len, CFG.text_dim)).astype(np.float32)
    frames = 10  # past 1 sink + 3 frames: a capped cache would have evicted
    want, kv = _eager_full_context(model, frames, 1, 2.0, text)
    settings = StreamSettings(frames=frames, seed=1, cfg_scale=2.0, window_frames=0)
    archive = FrameCache(CFG.layers, CFG.tokens_per_frame, CFG.sink_frames, 0)
    archive.write(0, kv)
    got = list(bench.dense_full_context(model, settings, text, 8, [8], archive))
    assert [c.first_frame for c in got] == [0, 2, 4, 6, 8]
    for c, w in zip(got, want, strict=False):
        np.testing.assert_allclose(c.frames, w, atol=1e-4)
    assert got[-1].resident == list(range(10))
    # the capped rollout that feeds the archive: its own cache windowed, the archive every frame it wrote
    archive = FrameCache(CFG.layers, CFG.tokens_per_frame, CFG.sink_frames, 0)
    chunks = list(rollout(bench.ArchivedDiT(model, archive), dataclasses.replace(settings, window_frames=None), text))
    assert chunks[-1].resident == [0, 7, 8, 9] and archive.resident == list(range(frames))


def test_frame_windows_and_late_chunks():
    assert bench.frame_windows(1000) == ((50, 150), (900, 1000))  # the paper's frames
    assert bench.frame_windows(250) == ((50, 150), (150, 250))
    assert bench.frame_windows(12) == ((2, 4), (10, 12))  # a short run: its second and last fifths
    for reached in range(5, 400):
        (e0, e1), (l0, l1) = bench.frame_windows(reached)
        assert 0 < e0 < e1 <= l0 < l1 == reached
    starts = bench.late_starts((900, 1000), 2, 3)
    assert starts[0] == 900 and starts[-1] == 998 and len(starts) == 3
    assert all(s % 2 == 0 and 900 <= s and s + 2 <= 1000 for s in starts)
    assert bench.late_starts((10, 12), 2, 3) == [10]
