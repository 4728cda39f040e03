"""FAST-AR and FastCar on the chunk-causal DiT (dit/fastar.py), each op against an independent reference:
TempCache's bookkeeping against fastar/cache.HeadCache (the NumPy decoder reference), the merged attention
against dense attention over every token (the lemma), AnnSA / AnnCA against NumPy selections made with the
reference bucketings, FFN replay against computing every row; the stream with every mode off against the
exported dense graph in ONNX Runtime; recall against its NumPy definition; the `stream` command line's record."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dit_modes_helpers import refusal  # noqa: E402

from fastcar_compile.cli import main  # noqa: E402
from fastcar_compile.dit import modes, sparse  # noqa: E402
from fastcar_compile.dit.cache import kept_frames  # noqa: E402
from fastcar_compile.dit.config import PRESETS  # noqa: E402
from fastcar_compile.dit.fastar import (  # noqa: E402
    FastARDiT,
    SlotCache,
    attend_cache,
    cross_attend,
    replay_ffn,
    temporal_scores,
)
from fastcar_compile.dit.stream import StreamSettings, TorchDiT, rollout  # noqa: E402
from fastcar_compile.fastar.attention import dense_step  # noqa: E402
from fastcar_compile.fastar.cache import HeadCache  # noqa: E402
from fastcar_compile.fastar.config import KVCompressConfig  # noqa: E402

CFG = PRESETS["tiny"]


def _frames(rng, n_frames, T, d, copy=0.6, noise=0.0, permute=False):
    """Keys/values [n_frames, T, d]: a share of each frame's tokens copy a previous-frame key (same position,
    or a permuted one), the rest are fresh."""
    k = np.zeros((n_frames, T, d), np.float32)
    k[0] = rng.standard_normal((T, d))
    for f in range(1, n_frames):
        src = rng.permutation(T) if permute else np.arange(T)
        fresh = rng.standard_normal((T, d)).astype(np.float32)
        cp = rng.random(T) < copy
        k[f] = np.where(cp[:, None], k[f - 1][src] + noise * rng.standard_normal((T, d)), fresh)
    return k, rng.standard_normal((n_frames, T, d)).astype(np.float32)


def _write_slotcache(k, v, mode, sim, sinks, tables=2, window=0, token_maps=False, budget=0):
    n, T, d = k.shape
    hasher = sparse.make_hasher(mode if mode != "aligned" else "lsh", d, 4, 2, tables, 0)
    c = SlotCache(1, T, d, 0, tables if mode != "aligned" else 0)
    for f in range(n):
        kk, vv = torch.from_numpy(k[f])[None], torch.from_numpy(v[f])[None]
        cp = sparse.codes(hasher, kk) if mode != "aligned" else torch.zeros(1, T, 0, dtype=torch.int64)
        if f < sinks:
            tgt = torch.full((1, T), -1)
        elif mode == "aligned":
            tgt = c.aligned_targets(f, kk, sim, sinks)
        else:
            tgt = c.ann_targets(f, kk, cp, sim, sinks)
        c.write_frame(f, kk, kk, vv, torch.zeros(1, T, 0, dtype=torch.int64), cp, tgt)
        c.evict(kept_frames(f + 1, sinks, window), set(range(f + 1)) if token_maps else {f})
        if budget:
            c.evict_budget(budget, sinks)
    return c


def _reference(k, v, correspondence, sim, sinks):
    n, T, d = k.shape
    ref = HeadCache(KVCompressConfig(tempcache_sim=sim, correspondence=correspondence, sinks=sinks * T,
                                     frame_tokens=T, video_start=0), d, n * T, theta=None)
    for f in range(n):
        for s in range(T):
            ref.append(k[f, s], v[f, s])
    return ref


def _assert_same_slots(c: SlotCache, ref: HeadCache, n_tokens: int, keep: set[int] | None = None):
    """Same partition of the tokens into slots, and per slot the same count, key and mean value (`keep`: only
    the reference's slots whose newest member is in these frames)."""
    live = np.flatnonzero(ref.live)
    if keep is not None:
        live = live[np.isin(ref.pos[live] // c.T, sorted(keep))]
    assert int(c.live.sum()) == live.size
    # a slot of the reference is named by its first member, as the id of ours is
    first = {int(slot): int(np.flatnonzero(ref.token_slot[:n_tokens] == slot)[0]) for slot in live}
    ours = {int(sid): i for i, sid in enumerate(c.sid[0].tolist()) if c.count[0, i] > 0}
    assert sorted(ours) == sorted(first.values())
    for slot, sid in first.items():
        i = ours[sid]
        assert c.count[0, i] == ref.count[slot]
        np.testing.assert_allclose(c.k_pre[0, i].numpy(), ref.k_pre[slot], atol=1e-6)
        np.testing.assert_allclose(c.v[0, i].numpy(), ref.v[slot], atol=1e-5)


@pytest.mark.parametrize("seed,sinks,noise,sim", [(0, 0, 0.0, 0.9), (1, 1, 0.3, 0.9), (2, 2, 0.1, 0.95),
                                                  (3, 1, 0.5, 0.5)])
def test_tempcache_aligned_bookkeeping_matches_numpy_reference(seed, sinks, noise, sim):
    rng = np.random.default_rng(seed)
    k, v = _frames(rng, 7, 12, 8, noise=noise)
    c = _write_slotcache(k, v, "aligned", sim, sinks)
    ref = _reference(k, v, "aligned", sim, sinks)
    assert ref.merges > 0
    _assert_same_slots(c, ref, k.shape[0] * k.shape[1])
    # the counts partition the tokens: no token lost, none counted twice
    assert int(c.count.sum()) == k.shape[0] * k.shape[1]


@pytest.mark.parametrize("sinks,window", [(1, 2), (0, 1), (2, 3)])
def test_tempcache_eviction_keeps_slots_of_window_frames(sinks, window):
    """With a window, a slot stays while its newest member's frame is kept (a merged slot outlives its older
    members' frames): the reference's slots (no eviction) restricted to those frames."""
    rng = np.random.default_rng(10 + window)
    k, v = _frames(rng, 9, 10, 8, noise=0.2)
    c = _write_slotcache(k, v, "aligned", 0.9, sinks, window=window)
    ref = _reference(k, v, "aligned", 0.9, sinks)
    keep = kept_frames(k.shape[0], sinks, window)
    _assert_same_slots(c, ref, k.shape[0] * k.shape[1], keep)
    assert int(c.live.sum()) < int(ref.live.sum())


@pytest.mark.parametrize("sinks,budget", [(1, 14), (0, 10), (2, 25)])
def test_tempcache_budget_keeps_the_most_recently_merged_slots(sinks, budget):
    """With a slot budget (no window), the sink frames' slots stay and, of the others, the `budget` slots whose
    newest member is most recent (ties: the later first member): the reference's slots (no eviction) ranked by
    hand. A budget of at least a frame never evicts a merge target (the previous frame's slots rank first)."""
    rng = np.random.default_rng(20 + budget)
    k, v = _frames(rng, 9, 10, 8, noise=0.2)
    n, T = k.shape[:2]
    c = _write_slotcache(k, v, "aligned", 0.9, sinks, budget=budget)
    ref = _reference(k, v, "aligned", 0.9, sinks)
    live = np.flatnonzero(ref.live)
    newest = ref.pos[live] // T
    first = np.array([np.flatnonzero(ref.token_slot[:n * T] == s)[0] for s in live])
    other = sorted(zip(newest[newest >= sinks], first[newest >= sinks], strict=True), reverse=True)[:budget]
    want = sorted(first[newest < sinks].tolist() + [f for _, f in other])
    got = sorted(int(sid) for sid, cnt in zip(c.sid[0].tolist(), c.count[0].tolist(), strict=True) if cnt > 0)
    assert got == want
    assert int(c.live.sum()) == sinks * T + min(budget, int((newest >= sinks).sum()))
    assert int((newest >= sinks).sum()) > budget  # the budget did evict
    for i in range(c.count.shape[1]):  # the kept slots are the reference's (count, key, mean value)
        if c.count[0, i] > 0:
            slot = int(ref.token_slot[int(c.sid[0, i])])
            assert c.count[0, i] == ref.count[slot]
            np.testing.assert_allclose(c.v[0, i].numpy(), ref.v[slot], atol=1e-5)


@pytest.mark.parametrize("mode", ["lsh", "int8"])
def test_tempcache_top1_matches_numpy_reference(mode):
    """Each frame copies a permutation of part of the previous one: the top-1 match is found through the
    buckets (an exact copy shares every bucket) and no two tokens pick one slot, where both semantics agree."""
    rng = np.random.default_rng(4)
    k, v = _frames(rng, 6, 16, 16, copy=0.7, permute=True)
    c = _write_slotcache(k, v, mode, 0.9, 1)
    ref = _reference(k, v, "aligned+top1", 0.9, 1)
    assert ref.merges > 20
    _assert_same_slots(c, ref, k.shape[0] * k.shape[1])


def test_tempcache_lemma_exact_for_identical_keys():
    """Frames repeating the same keys merge into one slot per position; attention over the merged cache
    (log(count) on the logit) equals dense attention over every token."""
    rng = np.random.default_rng(5)
    T, d, n = 6, 8, 5
    k = np.repeat(rng.standard_normal((1, T, d)).astype(np.float32), n, 0)
    v = rng.standard_normal((n, T, d)).astype(np.float32)
    c = _write_slotcache(k, v, "aligned", 0.99, 0)
    assert int(c.live.sum()) == T and c.count.max() == n
    q = rng.standard_normal((3, d)).astype(np.float32)
    out, _, _ = sparse.combine([sparse.dense_part(torch.from_numpy(q)[None], c.k_post, c.v, c.bias())])
    for i in range(3):
        want, _ = dense_step(q[i].astype(np.float64), k.reshape(-1, d), v.reshape(-1, d))
        np.testing.assert_allclose(out[i].numpy(), want, atol=1e-5)


def _softmax_out(q, keys, vals, bias):
    lg = keys @ q / np.sqrt(q.size) + bias
    w = np.exp(lg - lg.max())
    return (w / w.sum()) @ vals


@pytest.mark.parametrize("native", [True, False], ids=["native-kernel", "torch"])
@pytest.mark.parametrize("mode", ["lsh", "int8"])
def test_annsa_matches_numpy_selection(mode, native, monkeypatch):
    """The chunk's queries over a merged cache: dense over the kept slots and the chunk, bucket matches
    elsewhere == NumPy softmax over exactly that selection, with log(count); in the native kernel
    (sparse.native_annsa) and in torch ops (gathered pairs, sparse.bucket_parts)."""
    if not native:
        monkeypatch.setattr(sparse, "_NATIVE", {"off": True})
    elif sparse._native_fn() is None:
        pytest.skip("native ai.fastcar kernels not built here")
    rng = np.random.default_rng(6)
    T, d, Q, G = 10, 16, 8, 3
    c = SlotCache(G, T, d, 3, 0)
    hasher = sparse.make_hasher(mode, d, 3, 2, 3, 1)
    for f in range(5):
        kk = torch.from_numpy(rng.standard_normal((G, T, d)).astype(np.float32))
        vv = torch.from_numpy(rng.standard_normal((G, T, d)).astype(np.float32))
        tgt = torch.where(torch.rand(G, T) < 0.3, c.aligned_targets(f, kk, -2.0, 0), -1) if f else \
            torch.full((G, T), -1)
        c.write_frame(f, kk, kk, vv, sparse.codes(hasher, kk), torch.zeros(G, T, 0, dtype=torch.int64), tgt)
        c.evict(None, {f})
    assert c.count.max() > 1
    q = torch.from_numpy(rng.standard_normal((G, Q, d)).astype(np.float32))
    k = torch.from_numpy(rng.standard_normal((G, Q, d)).astype(np.float32))
    v = torch.from_numpy(rng.standard_normal((G, Q, d)).astype(np.float32))
    keep = (c.frame == 0) | (c.frame >= 4)
    out, info = attend_cache(q, k, v, c, keep, hasher, diag=False)
    pairs = Q * Q * G
    for g in range(G):
        live = c.count[g].numpy() > 0
        kc = c.codes[g].numpy()
        for i in range(Q):
            qc = hasher.codes(q[g, i].double().numpy())
            sel = live & (keep[g].numpy() | hasher.shares_bucket(kc, qc))
            pairs += int(sel.sum())
            keys = np.concatenate([c.k_post[g].numpy()[sel], k[g].numpy()])
            vals = np.concatenate([c.v[g].numpy()[sel], v[g].numpy()])
            bias = np.concatenate([np.log(c.count[g].numpy()[sel]), np.zeros(Q)])
            np.testing.assert_allclose(out[g, i].numpy(), _softmax_out(q[g, i].numpy(), keys, vals, bias), atol=1e-5)
    assert info["executed"] == pairs < Q * G * (Q + int(c.live.sum()) // G + 1)


@pytest.mark.parametrize("mode", ["lsh", "int8"])
def test_annca_matches_numpy_selection(mode):
    rng = np.random.default_rng(7)
    G, frames, per, L, d = 2, 3, 5, 9, 8
    hasher = sparse.make_hasher(mode, d, 3, 4, 2, 0)
    cq, ck, cv = (torch.from_numpy(rng.standard_normal(s).astype(np.float32))
                  for s in ((G, frames * per, d), (G, L, d), (G, L, d)))
    out, kept, executed = cross_attend(cq, ck, cv, sparse.codes(hasher, cq), sparse.codes(hasher, ck), frames)
    pairs = 0
    for g in range(G):
        kc = hasher.codes(ck[g].double().numpy())
        for f in range(frames):
            qs = cq[g, f * per:(f + 1) * per].double().numpy()
            want_kept = np.zeros(L, bool)
            for qq in qs:
                want_kept |= hasher.shares_bucket(kc, hasher.codes(qq))
            np.testing.assert_array_equal(kept[g, f].numpy(), want_kept)
            pairs += per * int(want_kept.sum())
            for i, qq in enumerate(qs):
                got = out[g, f * per + i].numpy()
                if want_kept.any():
                    want = _softmax_out(qq, ck[g].numpy()[want_kept], cv[g].numpy()[want_kept], 0.0)
                    np.testing.assert_allclose(got, want, atol=1e-5)
                else:
                    assert not got.any()
    assert executed == pairs and 0 < pairs < G * frames * per * L


def test_replay_skips_rows_and_chains_frames():
    """Replayed rows never reach the FFN; each takes the output of the same position one frame back (the
    previous chunk's for frame 0), chained; against computing every row and selecting in NumPy."""
    rng = np.random.default_rng(8)
    B, Fr, T, D = 2, 3, 5, 6
    lin = torch.nn.Linear(D, D)
    seen = []

    def ffn(rows):
        seen.append(rows.shape[0])
        return lin(rows)

    x = torch.from_numpy(rng.standard_normal((B, Fr, T, D)).astype(np.float32))
    tas = torch.from_numpy(rng.standard_normal((B, Fr, T)).astype(np.float32))
    eligible = torch.ones(B, Fr, T, dtype=torch.bool)
    eligible[1, 0] = False
    prev = torch.from_numpy(rng.standard_normal((B, T, D)).astype(np.float32))
    with torch.no_grad():
        out, replay = replay_ffn(ffn, x, tas, eligible, 0.2, prev)
        full = lin(x).numpy()
    rep = eligible.numpy() & (tas.numpy() > 0.2)
    np.testing.assert_array_equal(replay.numpy(), rep)
    assert seen == [int((~rep).sum())] and 0 < rep.sum() < rep.size
    want = full.copy()
    for j in range(Fr):
        src = want[:, j - 1] if j else prev.numpy()
        want[:, j] = np.where(rep[:, j, :, None], src, want[:, j])
    np.testing.assert_allclose(out.numpy(), want, atol=1e-6)


def test_temporal_scores_match_numpy():
    """TAS of a 3-frame chunk: frame j's query against frame j-1's key at the same (h, w), the previous chunk's
    last frame for j = 0; heads averaged, / sqrt(d)."""
    rng = np.random.default_rng(9)
    B, H, Fr, T, d = 2, 3, 3, 4, 8
    q, k = (rng.standard_normal((B, H, Fr * T, d)).astype(np.float32) for _ in range(2))
    prev = rng.standard_normal((B, H, T, d)).astype(np.float32)
    tas, eligible = temporal_scores(torch.from_numpy(q), torch.from_numpy(k), T, torch.from_numpy(prev), 6)
    qq, kk = q.reshape(B, H, Fr, T, d).astype(np.float64), k.reshape(B, H, Fr, T, d).astype(np.float64)
    want = np.empty((B, Fr, T))
    for j in range(Fr):
        back = prev if j == 0 else kk[:, :, j - 1]
        want[:, j] = np.einsum("bhtd,bhtd->bt", qq[:, :, j], back) / H / np.sqrt(d)
    np.testing.assert_allclose(tas.numpy(), want, atol=1e-5)
    assert eligible.all()
    _, first = temporal_scores(torch.from_numpy(q), torch.from_numpy(k), T, None, 0)
    assert not first[:, 0].any() and first[:, 1:].all()


@pytest.fixture(scope="module")
def exported(dit_tiny_export):
    return dit_tiny_export  # exported once per test session (conftest)


@pytest.mark.parametrize("kw", [
    {},
    {"diagnostics": True},
    # no merging (a cosine never exceeds 1), AnnSA whose always-kept frames cover the whole cache,
    # FastCar whose tau no TAS exceeds: each machinery on, nothing dropped
    {"tempcache": 1.0, "tempcache_match": "aligned", "annsa": "lsh", "annsa_local": 64, "threshold": 1e30,
     "diagnostics": True},
    {"tempcache": 1.0, "tempcache_match": "int8", "annsa": "int8", "annsa_local": 64},
])
def test_no_compression_equals_the_dense_export(exported, dit_tiny_eager, kw):
    """5 chunks with eviction: the FAST-AR runtime with nothing merged or skipped == the exported dense graph
    in ONNX Runtime within 1e-4; density and recall read 1."""
    from fastcar_compile.dit.stream import OrtDiT

    settings = StreamSettings(frames=10, seed=5)
    want = list(rollout(OrtDiT(exported), settings))
    rt = FastARDiT(dit_tiny_eager, modes.settings(**kw))
    got = list(rollout(rt, settings))
    for a, b in zip(got, want, strict=True):
        assert a.resident == b.resident
        np.testing.assert_allclose(a.frames, b.frames, atol=1e-4, rtol=0)
    for s in rt.layer_summary():
        assert s["self_density"] == 1.0 and s["cross_density"] == 1.0 and s["replay_ratio"] == 0.0
        assert s["kv_density"] == 1.0
        if kw.get("diagnostics"):
            assert s["self_recall"] == pytest.approx(1.0, abs=1e-5)


def test_modes_compress_and_measure(dit_tiny_eager):
    """Every mode on: less attention executed, fewer resident slots, replayed FFN rows, recall below 1
    but measured; the merged stream differs from the dense one (the modes act)."""
    settings = StreamSettings(frames=8, seed=1)
    dense = [c.frames for c in rollout(TorchDiT(dit_tiny_eager), settings)]
    fa = modes.settings(tempcache=0.3, tempcache_match="aligned", annsa="lsh", annca=True, threshold=0.0, ann_always=True,
                        diagnostics=True)
    rt = FastARDiT(dit_tiny_eager, fa)
    got = [c.frames for c in rollout(rt, settings)]
    assert max(np.abs(a - b).max() for a, b in zip(got, dense, strict=True)) > 1e-3
    for s in rt.layer_summary():
        assert 0 < s["self_density"] < 1 and 0 < s["self_recall"] < 1
        assert 0 < s["cross_density"] < 1 and 0 < s["cross_recall"] <= 1
        assert 0 < s["replay_ratio"] < 1 and 0 < s["kv_density"] < 1
        assert s["resident_kv_bytes"] < s["dense_kv_bytes"]


def test_calibrate_replay(dit_tiny_eager):
    from fastcar_compile.dit.fastar import calibrate_tau

    settings = StreamSettings(frames=4, seed=2)
    fa = modes.settings(calibrate_replay=0.4)
    tau = calibrate_tau(dit_tiny_eager, fa, settings)
    rt = FastARDiT(dit_tiny_eager, modes.settings(threshold=tau))
    list(rollout(rt, settings))
    ratio = sum(s.ffn_replayed for s in rt.stats) / sum(s.ffn_rows for s in rt.stats)
    # over all rows (frame 0's cannot replay: 3 of 4 frames are eligible), replay changes later layers' TAS
    assert 0.4 * 0.75 - 0.15 < ratio < 0.4 * 0.75 + 0.15


def test_stream_cli_records_modes(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["stream", "tiny", "--frames", "6", "-o", str(out), "--tempcache", "0.9", "--tempcache-match", "lsh",
            "--annsa", "int8", "--annca", "--ann-always", "--threshold", "0.5", "--diagnostics"]
    assert main(argv) == 0
    doc = json.loads((out / "stream.json").read_text())
    assert doc["fastar"]["settings"]["tempcache_match"] == "lsh" and doc["fastar"]["settings"]["annsa"] == "int8"
    assert doc["fastar"]["settings"]["threshold"] == 0.5 and doc["fastar"]["mode"].startswith("TempCache-lsh")
    layers = doc["fastar"]["layers"]
    assert len(layers) == CFG.layers and all(0 < x["self_density"] <= 1 and x["self_recall"] > 0 for x in layers)
    assert (out / "fastar.png").is_file() and (out / "stream.png").is_file()
    assert "self density" in capsys.readouterr().out


def test_stream_cli_says_when_the_cost_model_keeps_a_mode_dense(tmp_path, capsys):
    """tiny's 32 queries a chunk: AnnCA would cost more than the dense cross-attention (passes/dit_cost.py), so
    the stream runs it dense, says so in one line, and records the verdict and the mode it ran."""
    out = tmp_path / "run"
    assert main(["stream", "tiny", "--frames", "4", "-o", str(out), "--annca"]) == 0
    said = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("--annca: ")]
    assert len(said) == 1 and "kept dense" in said[0]
    doc = json.loads((out / "stream.json").read_text())
    assert doc["fastar"]["settings"]["annca"] is False and doc["fastar"]["mode"] == "dense"
    assert doc["fastar"]["cost_model"]["annca"].startswith("kept dense")


@pytest.mark.parametrize("argv,words", [
    (["--tempcache", "0.9", "--tempcache-match", "nearest"], "invalid choice"),
    (["--tempcache", "lsh"], "renamed: --tempcache takes SIM"),
    (["--tempcache-match", "lsh"], "--tempcache-match lsh needs --tempcache SIM"),
    (["--int8-dirs", "3"], "--int8-dirs must be one of"),
    (["--quant-dirs", "2"], "--quant-dirs: renamed: use --int8-dirs"),
    (["--fastcar-tau", "1"], "--fastcar-tau: renamed: use --threshold"),
    (["--threshold", "1", "--calibrate-replay", "0.5"], "not both"),
    (["--lsh-bits", "17"], "--lsh-bits must be in 1..16"),
    (["--tempcache", "0.9", "--ann-tables", "0"], "--ann-tables must be in 1..64"),
    (["--tempcache-budget", "14"], "give --tempcache SIM too"),
])
def test_stream_cli_bad_modes(tmp_path, capsys, argv, words):
    assert words in refusal(["stream", "tiny", "--frames", "2", "-o", str(tmp_path / "x"), *argv], capsys)
    assert not (tmp_path / "x").exists()


def test_stream_cli_unknown_model_is_one_line(tmp_path, capsys):
    rc = main(["stream", str(tmp_path / "nothing"), "--frames", "2", "-o", str(tmp_path / "x")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "no such file or preset" in err and len(err.splitlines()) == 1


def test_stream_cli_refuses_modes_on_an_onnx_graph(exported, tmp_path, capsys):
    rc = main(["stream", str(exported), "--frames", "2", "-o", str(tmp_path / "x"), "--tempcache", "0.9"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "eager" in err and len(err.splitlines()) == 1


def test_annca_frame_keeping_nothing_attends_to_nothing():
    """A frame whose queries share no bucket with any prompt token gets a zero cross-attention output."""
    hasher = sparse.make_hasher("lsh", 4, 1, 2, 1, 0)
    n = torch.from_numpy(hasher.planes[0, 0].astype(np.float32))
    cq = torch.stack([n, n, -n, -n])[None]  # frame 0 on one side of the plane, frame 1 on the other
    ck = torch.stack([-n, -n])[None]
    out, kept, executed = cross_attend(cq, ck, ck, sparse.codes(hasher, cq), sparse.codes(hasher, ck), 2)
    assert kept[0, 0].sum() == 0 and kept[0, 1].all() and executed == 2 * 2
    assert not out[0, :2].any() and torch.allclose(out[0, 2:], -n.expand(2, -1))


def test_recall_matches_numpy_definition():
    """Self-attention recall of the chunk's queries over a merged cache with AnnSA: sum over tokens of
    min(dense softmax, compressed softmax of its slot / the slot's count), the chunk's own keys included;
    computed in NumPy with the reference cache's token -> slot map and counts."""
    from types import SimpleNamespace

    from fastcar_compile.dit.cache import FrameCache

    rng = np.random.default_rng(12)
    n, T, d, Q = 6, 8, 8, 6
    k, v = _frames(rng, n, T, d, noise=0.3)
    c = _write_slotcache(k, v, "aligned", 0.8, 1, token_maps=True)
    ref = _reference(k, v, "aligned", 0.8, 1)
    assert ref.merges > 0
    shadow = FrameCache(1, T, 1, 0)
    shadow.write(0, [k.reshape(1, 1, n * T, d), v.reshape(1, 1, n * T, d)])
    hasher = sparse.make_hasher("lsh", d, 2, 2, 1, 3)
    c.codes = sparse.codes(hasher, c.k_post)
    q, kq, vq = (rng.standard_normal((1, Q, d)).astype(np.float32) for _ in range(3))
    keep = (c.frame == 0) | (c.frame >= n - 1)
    _, info = attend_cache(torch.from_numpy(q), torch.from_numpy(kq), torch.from_numpy(vq), c, keep, hasher, True)
    got = FastARDiT.recall(None, 0, torch.from_numpy(q)[None], torch.from_numpy(kq)[None], c,
                           SimpleNamespace(shadow=shadow), info)
    want = 0.0
    live = np.flatnonzero(ref.live)
    for i in range(Q):
        qq = q[0, i].astype(np.float64)
        frame_of = ref.pos[live] // T
        codes = hasher.codes(ref.k_pre[live])
        sel = live[(frame_of == 0) | (frame_of >= n - 1) | hasher.shares_bucket(codes, hasher.codes(qq))]
        lg = np.concatenate([ref.k_pre[sel] @ qq / np.sqrt(d) + np.log(ref.count[sel]), kq[0] @ qq / np.sqrt(d)])
        w = np.exp(lg - lg.max())
        w /= w.sum()
        per_slot = np.zeros(ref.capacity)
        per_slot[sel] = w[:sel.size] / ref.count[sel]
        _, dense = dense_step(qq, np.concatenate([k.reshape(-1, d), kq[0]]), np.concatenate([v.reshape(-1, d), vq[0]]))
        comp = np.concatenate([per_slot[ref.token_slot[:n * T]], w[sel.size:]])
        want += np.minimum(dense, comp).sum()
    assert 0.2 * Q < want < 0.999 * Q
    assert got == pytest.approx(want, abs=1e-4)
