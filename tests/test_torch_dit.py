"""TempCache and FastCar on the PyTorch DiT (`fastcar_compile.torch.apply_dit`): with nothing merged or
replayed it is the eager model's dense rollout; with merging and replay it is the eager stream runtime
(dit/fastar.FastARDiT, whose slot lists are checked against the NumPy reference in test_dit_fastar.py) chunk
by chunk and denoising step by step, with the same merge and replay counts."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from fastcar_compile.core.errors import FastCarError  # noqa: E402
from fastcar_compile.dit import modes  # noqa: E402
from fastcar_compile.dit.config import PRESETS  # noqa: E402
from fastcar_compile.dit.fastar import FastARDiT  # noqa: E402
from fastcar_compile.dit.stream import StreamSettings, TorchDiT, rollout  # noqa: E402
from fastcar_compile.torch import apply_dit  # noqa: E402
from fastcar_compile.torch import dit as torch_dit  # noqa: E402

CFG = PRESETS["tiny"]


class Recorder:
    """A stream backend that records every step's velocity (the comparison step by step)."""

    def __init__(self, backend):
        self.backend, self.velocities = backend, []
        self.cfg = backend.cfg

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def step(self, *args):
        out = self.backend.step(*args)
        self.velocities.append(np.array(out[0]))
        return out


@pytest.mark.parametrize("kw", [{}, {"tempcache": 1.0, "threshold": 1e30}])
def test_nothing_merged_or_replayed_is_the_dense_model(dit_tiny_eager, kw):
    """10 frames (5 chunks, the 4-frame window evicting): the module == the eager dense rollout within 1e-4."""
    settings = StreamSettings(frames=10, seed=5)
    want, got = Recorder(TorchDiT(dit_tiny_eager)), Recorder(apply_dit(dit_tiny_eager, **kw))
    for a, b in zip(rollout(got, settings), rollout(want, settings), strict=True):
        assert a.resident == b.resident
        np.testing.assert_allclose(a.frames, b.frames, atol=1e-4, rtol=0)
    assert len(got.velocities) == len(want.velocities)
    for a, b in zip(got.velocities, want.velocities, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)
    stats = got.backend.stats
    assert stats["merge_ratio"] in (None, 0.0) and stats["replay_ratio"] in (None, 0.0)


@pytest.mark.parametrize("kw", [
    {"tempcache": 0.3},
    {"threshold": 0.0},
    {"tempcache": 0.3, "tempcache_match": "aligned", "threshold": 0.0},
])
@pytest.mark.parametrize("window", [None, 0])
def test_modes_equal_the_eager_stream_runtime(dit_tiny_eager, kw, window):
    """Merging and replay on: every denoising step's velocity and every chunk equal FastARDiT's within 1e-4,
    with the same residency and the same merge / replay / self-attention pair counts per layer; and the modes act
    (vs dense)."""
    settings = StreamSettings(frames=10, seed=3, window_frames=window)
    ref = Recorder(FastARDiT(dit_tiny_eager, modes.settings(**kw)))
    mod = Recorder(apply_dit(dit_tiny_eager, **kw))
    dense = [c.frames for c in rollout(TorchDiT(dit_tiny_eager), settings)]
    chunks = list(zip(rollout(mod, settings), rollout(ref, settings), strict=True))
    for a, b in chunks:
        assert a.resident == b.resident
        np.testing.assert_allclose(a.frames, b.frames, atol=1e-4, rtol=0)
    for a, b in zip(mod.velocities, ref.velocities, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)
    assert max(np.abs(a.frames - d).max() for (a, _), d in zip(chunks, dense, strict=True)) > 1e-3
    for got, want in zip(mod.backend.cache.stats, ref.backend.stats, strict=True):
        if "tempcache" in kw:
            assert got.merges == want.merges > 0 and got.written == want.written
            assert got.resident_slots == want.resident_slots < got.dense_slots == want.dense_slots
        if "threshold" in kw:
            assert got.ffn_replayed == want.ffn_replayed > 0 and got.ffn_rows == want.ffn_rows
        assert got.sa_executed == want.sa_executed and got.sa_dense == want.sa_dense
        assert (got.sa_executed < got.sa_dense) == ("tempcache" in kw)


@pytest.mark.parametrize("compact", [True, False])
def test_merged_slot_holds_mean_value_newest_key_and_count(dit_tiny_eager, compact):
    """The cache after a write, against a NumPy recount: a token whose pre-RoPE key's cosine with the same
    (h, w) one frame back exceeds SIM sits in that slot (count + 1, the mean of its values, its own key); the
    slot it left is dead (count 0); sink frames never merge. Compacted, the older frames hold each (row, head)'s
    live slots in order, padded with dead ones to the fullest, and the last frame stays positional."""
    fast = apply_dit(dit_tiny_eager, tempcache=0.5, sinks=1, window=0)
    fast.compact_cache = compact
    fast.reset()
    rng = np.random.default_rng(0)
    B, H, T, d = 1, CFG.heads, CFG.tokens_per_frame, CFG.head_dim
    base = rng.standard_normal((B, H, T, d)).astype(np.float32)
    frames = []
    for f in range(4):  # keys drift slowly: most tokens merge from frame 2 on (frame 0 is the sink)
        k_pre = base + 0.3 * f * rng.standard_normal((B, H, T, d)).astype(np.float32)
        frames.append((k_pre + 1.0, k_pre, rng.standard_normal((B, H, T, d)).astype(np.float32)))
    for f in range(0, 4, 2):
        kv = [tuple(torch.from_numpy(np.concatenate([frames[f][n], frames[f + 1][n]], 2)) for n in range(3))
              ] * CFG.layers
        fast.write(f, kv)
    # NumPy: per (b, h, s), chains of merged tokens
    count = np.ones((4, B, H, T), np.int64)
    value = np.stack([fr[2] for fr in frames]).copy()
    for f in range(2, 4):  # frame 1's predecessor is the sink
        a, b = frames[f][1], frames[f - 1][1]
        cos = (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)
        m = cos > 0.5
        value[f] = np.where(m[..., None], (value[f - 1] * count[f - 1][..., None] + value[f]) /
                            (count[f - 1] + 1)[..., None], value[f])
        count[f] = np.where(m, count[f - 1] + 1, 1)
        count[f - 1] = np.where(m, 0, count[f - 1])
    assert 0 < (count == 0).sum() < count.size and (count[2] > 1).any()
    want = [np.concatenate(list(count), 2), np.concatenate(list(value), 2),
            np.concatenate([fr[0] for fr in frames], 2)]
    if compact:  # frames 0-2 compacted (frame 3 is the last, positional)
        live = want[0][:, :, :3 * T] > 0
        n = int(live.sum(-1).max())
        assert n < 3 * T
        older = [np.zeros((B, H, n, *a.shape[3:]), a.dtype) for a in want]
        for b in range(B):
            for h in range(H):
                idx = np.flatnonzero(live[b, h])
                for o, a in zip(older, want, strict=True):
                    o[b, h, :idx.size] = a[b, h, idx]
        want = [np.concatenate([o, a[:, :, 3 * T:]], 2) for o, a in zip(older, want, strict=True)]
    c = fast.cache
    np.testing.assert_array_equal(c.count[0].numpy(), want[0])
    held = want[0] > 0  # (padding: its key and value are never read)
    np.testing.assert_allclose(c.value[0].numpy()[held], want[1][held], atol=1e-6)
    np.testing.assert_array_equal(c.key[0].numpy()[held], want[2][held])


@pytest.mark.parametrize("window", [None, 0])
def test_compaction_gives_back_dead_slots(dit_tiny_eager, monkeypatch, window):
    """TempCache's dead slots cost neither bytes nor attended keys. Recounted from the eager runtime's slot lists
    after every chunk: per layer and (row, head) g, dead_g = the dense cache's slots - g's live slots. Each
    layer then holds dense - min_g dead_g slots per (row, head) (the other heads' surplus dead slots are the
    padding that evens them out), its bytes and every next step's self-attention keys (with the chunk's own)
    shrink by exactly that; the uncompacted form holds and reads the dense cache."""
    settings = StreamSettings(frames=10, seed=3, window_frames=window)  # CFG: 2 rows
    calls: list[int] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recorded(q, k, v, **kw):
        calls.append(k.shape[-2])
        return sdpa(q, k, v, **kw)

    monkeypatch.setattr(torch_dit, "F", type("F", (), {"scaled_dot_product_attention": staticmethod(recorded)}))
    ref = FastARDiT(dit_tiny_eager, modes.settings(tempcache=0.3))
    dead = []  # per chunk, per layer: dead slots per (row, head) [2 * heads]
    for chunk in rollout(ref, settings):
        dead.append([CFG.tokens_per_frame * len(chunk.resident) - (c.count > 0).sum(1).numpy()
                     for c in ref.state.caches])
    assert max(int(g.max()) for layers in dead for g in layers) > 0
    T, L, H, s = CFG.tokens_per_frame, CFG.layers, CFG.heads, CFG.chunk_frames * CFG.tokens_per_frame
    slot = 2 * 4 * CFG.head_dim + 8 + 4  # key, value float32; count int64; frame int32
    for compact in (True, False):
        fast = apply_dit(dit_tiny_eager, tempcache=0.3)
        fast.compact_cache = compact
        calls.clear()
        widths = [0] * L  # the cache the next chunk's steps read
        for n, chunk in enumerate(rollout(fast, settings)):
            steps = calls[0::2]  # (self, cross) per layer and step
            assert len(steps) % L == 0 and steps == [w + s for w in widths] * (len(steps) // L)
            calls.clear()
            dense = T * len(chunk.resident)
            widths = [dense - int(g.min()) if compact else dense for g in dead[n]]
            assert [k.shape[2] for k in fast.cache.key] == widths
            assert fast.cache.nbytes == sum(2 * H * w for w in widths) * slot


@pytest.mark.parametrize("kw, words", [
    ({"annsa": "lsh"}, "'annsa' is not supported"),
    ({"tempcache": 0.5, "tempcache_match": "lsh"}, "tempcache_match='lsh' is not supported"),
    ({"threshold": "x"}, "threshold"),
    ({"fastcar_tau": 0.5}, "renamed: use threshold"),
])
def test_unsupported_options_are_one_line_errors(dit_tiny_eager, kw, words):
    with pytest.raises(FastCarError) as e:
        apply_dit(dit_tiny_eager, **kw)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_not_a_dit_is_refused():
    with pytest.raises(FastCarError, match="ChunkDiT"):
        apply_dit(torch.nn.Linear(2, 2), threshold=0.0)
