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
from fastcar_compile.dit.config import PRESETS  # noqa: E402
from fastcar_compile.dit.fastar import FastARDiT  # noqa: E402
from fastcar_compile.dit.model import build  # noqa: E402
from fastcar_compile.dit.stream import StreamSettings  # noqa: E402
from fastcar_compile.fastar.lsh import SignLSH  # noqa: E402

CFG = dataclasses.replace(PRESETS["tiny"], window_frames=3)  # 1 sink + 3 frames: eviction within 8 frames


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_density_and_recall_equal_a_numpy_brute_force(monkeypatch):
    model = build(CFG, seed=2)
    fa = modes.settings(annsa="lsh", annca=True, lsh_bits=2, ann_tables=2, annsa_local=1)
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
