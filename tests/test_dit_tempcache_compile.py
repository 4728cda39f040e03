"""`fastcar-compile dit.onnx -o fast.onnx --tempcache SIM --tempcache-match lsh|int8`: TempCache's top-1 match
compiled in (dit/tempcache.py: the runtime's cache write picks, among the previous frame's slots sharing a
bucket, the best pre-RoPE cosine). References: the eager runtime's TempCache-lsh / -int8
(dit/fastar.FastARDiT), a per-token NumPy brute force of the match, the NumPy decoder cache
(fastar/cache.HeadCache, exhaustive top-1) for the bookkeeping, and the plain export over the unmerged cache
for the lemma."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")

from dit_modes_helpers import compile_cli, not_a_dit, refusal  # noqa: E402

from fastcar_compile.cli import main  # noqa: E402
from fastcar_compile.core.contract import DIT_MODES_KEY, TEMPCACHE_MASKED, TEMPCACHE_SLOTS  # noqa: E402
from fastcar_compile.core.errors import FastCarError  # noqa: E402
from fastcar_compile.dit import modes, tempcache  # noqa: E402
from fastcar_compile.dit.cache import RingCache  # noqa: E402
from fastcar_compile.dit.config import PRESETS  # noqa: E402
from fastcar_compile.dit.fastar import FastARDiT  # noqa: E402
from fastcar_compile.dit.stream import OrtDiT, StreamSettings, rollout  # noqa: E402
from fastcar_compile.dit.tempcache import merge_positional, targets  # noqa: E402
from fastcar_compile.fastar.cache import HeadCache  # noqa: E402
from fastcar_compile.fastar.config import KVCompressConfig, make_hasher  # noqa: E402
from fastcar_compile.fastar.int8 import Int8Buckets  # noqa: E402
from fastcar_compile.fastar.lsh import SignLSH  # noqa: E402

CFG = PRESETS["tiny"]


def _kernel() -> str:
    """TempCache's compiled form by default: SlotAttention over the resident slots where the native library builds."""
    from fastcar_compile.runtime.native import library_path

    return TEMPCACHE_SLOTS if library_path() is not None else TEMPCACHE_MASKED


def _compile(exported: Path, folder: Path, match: str, sim: str, tau: str = "inf") -> Path:
    return compile_cli(exported, folder, "--threshold", tau, "--tempcache", sim, "--tempcache-match", match,
                       name=f"{match}.onnx")


@pytest.mark.parametrize("match, sim, tau, window", [("lsh", "0.3", "inf", None), ("lsh", "0.3", "inf", 0),
                                                     ("int8", "0.2", "inf", 2), ("int8", "0.3", "0", None)])
def test_compiled_top1_equals_the_eager_mode(dit_tiny_export, tmp_path, dit_tiny_eager, match, sim, tau, window):
    """6 chunks (the default window, the buffers growing, the ring wrapping at 2 frames; with FastCar): the
    compiled rollout == the eager TempCache-lsh / -int8 at the same SIM within 1e-4, with the same merges,
    many of them into a slot other than the aligned one, and the same resident slots."""
    fast = OrtDiT(_compile(dit_tiny_export, tmp_path, match, sim, tau))
    assert fast.sim == float(sim) and fast.match == match  # read back from the metadata
    settings = StreamSettings(frames=12, seed=3, window_frames=window)
    kw = {"tempcache": float(sim), "tempcache_match": match} | ({} if tau == "inf" else {"threshold": 0.0})
    ref = FastARDiT(dit_tiny_eager, modes.settings(**kw))
    for a, b in zip(rollout(fast, settings), rollout(ref, settings), strict=True):
        assert a.resident == b.resident
        np.testing.assert_allclose(a.frames, b.frames, atol=1e-4, rtol=0)
    merged, aligned = sum(s.merges for s in ref.stats), sum(s.merges_aligned for s in ref.stats)
    assert fast.cache.merges == [merged, sum(s.written for s in ref.stats)] and 0 < aligned < merged
    resident = sum(s.resident_slots for s in ref.stats) / sum(s.dense_slots for s in ref.stats)
    assert fast.cache.kv_density == pytest.approx(resident, abs=1e-12) and resident < 1


def _brute_force(k, prev, live, sim, codes, prev_codes):
    """Per key: the live previous-frame slot sharing a bucket in some table with the largest float64 cosine
    (the later one on a tie), if above sim."""
    out = np.full(k.shape[:-1], -1)
    for g in np.ndindex(*k.shape[:-2]):
        for s in range(k.shape[-2]):
            best, pick = -np.inf, -1
            for p in range(prev.shape[-2]):
                if not live[g][p] or not (codes[g][s] == prev_codes[g][p]).any():
                    continue
                a, b = k[g][s].astype(np.float64), prev[g][p].astype(np.float64)
                c = a @ b / (np.linalg.norm(a) * np.linalg.norm(b))
                if c >= best:
                    best, pick = c, p
            out[g][s] = pick if best > sim else -1
    return out


@pytest.mark.parametrize("kind, pairs", [("lsh", None), ("int8", None), ("lsh", 2 * 24 * 24)])
def test_top1_targets_match_a_brute_force(kind, pairs, monkeypatch):
    """Keys that are noisy permuted copies of the previous frame's, fresh ones, duplicates among the previous
    frame's (a tie: the later slot) and dead slots: the vectorised match equals a per-key loop (also when it
    goes through the groups two at a time)."""
    if pairs is not None:
        monkeypatch.setattr(tempcache, "MAX_PAIRS", pairs)
    rng = np.random.default_rng(7)
    G, T, d = 6, 24, 16
    prev = rng.standard_normal((G, T, d)).astype(np.float32)
    prev[:, 5] = prev[:, 2]  # identical slots: ties
    k = np.where(rng.random((G, T, 1)) < 0.7, prev[:, rng.permutation(T)] + 0.3 * rng.standard_normal((G, T, d)),
                 rng.standard_normal((G, T, d))).astype(np.float32)
    k[:, 0] = prev[:, 2]
    live = rng.random((G, T)) < 0.85
    live[:, [2, 5]] = True
    hasher = make_hasher(kind, d, 3, 2, 2, 1)
    codes, prev_codes = hasher.codes(k), hasher.codes(prev)
    k, prev, live, codes, prev_codes = (a.reshape(2, 3, *a.shape[1:]) for a in (k, prev, live, codes, prev_codes))
    for sim in (0.5, 0.9, -1.0):
        got = targets(*map(torch.from_numpy, (k, prev, live)), sim, *map(torch.from_numpy, (codes, prev_codes))).numpy()
        want = _brute_force(k, prev, live, sim, codes, prev_codes)
        np.testing.assert_array_equal(got, want)
        assert (got >= 0).any() and (got[..., 0] == 5).all()  # the exact duplicate: the later of the tied slots
    assert ((got >= 0) & (got != np.arange(T))).mean() > 0.3  # mostly not the aligned slot


def test_merge_of_several_keys_into_one_slot_matches_a_loop():
    """Targets with collisions (several keys joining one slot), keys merging into their own position and keys
    not merging: per slot of the previous frame, a loop over its joining keys gives the count (c + joined),
    the running mean value and the position it moves to (the last joining key's); the rest are dead."""
    rng = np.random.default_rng(3)
    G, T, d = 5, 12, 4
    target = np.where(rng.random((G, T)) < 0.7, rng.integers(0, T // 3, (G, T)), -1)
    target[0] = np.where(rng.random(T) < 0.5, np.arange(T), -1)  # a row where the fast (aligned) form would do
    prev_value, value = rng.standard_normal((G, T, d)), rng.standard_normal((G, T, d))
    prev_count = rng.integers(1, 5, (G, T))
    out, count, left = (a.numpy() for a in merge_positional(*map(torch.from_numpy, (target, prev_value.astype(np.float32),
                                                                       prev_count, value.astype(np.float32)))))
    want_count, want_left, want_value = np.where(target >= 0, 0, 1), prev_count.copy(), value.copy()
    for g in range(G):
        for p in range(T):
            joined = [s for s in range(T) if target[g, s] == p]
            if joined:
                c = prev_count[g, p]
                want_count[g, joined[-1]] = c + len(joined)
                want_value[g, joined[-1]] = (prev_value[g, p] * c + value[g, joined].sum(0)) / (c + len(joined))
                want_left[g, p] = 0
    assert (want_count > 2).any() and (count.sum() + left.sum()) == prev_count.sum() + G * T
    np.testing.assert_array_equal(count, want_count)
    np.testing.assert_array_equal(left, want_left)
    np.testing.assert_allclose(out, want_value, atol=1e-5)
    out, count, left = (a.numpy() for a in merge_positional(*map(torch.from_numpy, (target[:1], prev_value[:1].astype(np.float32),
                                                                       prev_count[:1], value[:1].astype(np.float32)))))
    np.testing.assert_array_equal(count, want_count[:1])
    np.testing.assert_array_equal(left, want_left[:1])
    np.testing.assert_allclose(out, want_value[:1], atol=1e-5)


@pytest.mark.parametrize("window", [0, 3])
def test_ring_top1_bookkeeping_matches_the_numpy_reference(window):
    """Frames that copy a permutation of part of the previous one (exact copies: they share every bucket) and
    fresh keys, written chunk by chunk into a RingCache with the lsh match: per resident frame, the slots,
    their counts, mean values and newest keys equal fastar/cache.HeadCache's exhaustive top-1 merge (the NumPy
    decoder reference, token by token); every other position is dead; counts partition the kept tokens."""
    rng = np.random.default_rng(4)
    frames, T, d, sinks = 8, 16, 16, 1
    k = np.zeros((frames, T, d), np.float32)
    k[0] = rng.standard_normal((T, d))
    for f in range(1, frames):
        fresh = rng.standard_normal((T, d)).astype(np.float32)
        k[f] = np.where((rng.random(T) < 0.7)[:, None], k[f - 1][rng.permutation(T)], fresh)
    v = rng.standard_normal((frames, T, d)).astype(np.float32)
    ring = RingCache(1, T, sinks, window, tempcache=0.9, match=make_hasher("lsh", d, 4, 2, 2, 0))
    for f in range(0, frames, 2):  # 2-frame chunks: [key, value, pre-RoPE key] of layer 0, [1, 1, 2T, d]
        ring.write(f, [np.ascontiguousarray(x[f:f + 2].reshape(1, 1, 2 * T, d)) for x in (k, v, k)])
    ref = HeadCache(KVCompressConfig(tempcache_sim=0.9, correspondence="aligned+top1", sinks=sinks * T,
                                     frame_tokens=T, video_start=0), d, frames * T, theta=None)
    for f in range(frames):
        for s in range(T):
            ref.append(k[f, s], v[f, s])
    assert ref.merges > 30
    newest = {int(ref.pos[i]): i for i in np.flatnonzero(ref.live)}  # a slot by its newest member's position
    kept = 0
    for f in ring.resident:
        at = slice(ring.slot(f) * T, (ring.slot(f) + 1) * T)
        count, value, key = ring.counts[0][0, 0, at], ring.buffers[1][0, 0, at], ring.buffers[0][0, 0, at]
        for s in range(T):
            slot = newest.get(f * T + s)
            assert count[s] == (0 if slot is None else ref.count[slot]), (f, s)
            if slot is not None:
                np.testing.assert_allclose(value[s], ref.v[slot], atol=1e-5)
                np.testing.assert_array_equal(key[s], ref.k_pre[slot])
                kept += count[s]
        assert np.array_equal(ring.bias[0][0, 0, at] > -np.inf, count > 0)
    if not window:
        assert kept == frames * T and ring.resident == list(range(frames))


def test_lemma_merged_identical_keys_equal_the_export_over_every_token(dit_tiny_export, tmp_path):
    """Three frames of identical keys (different values) written with the lsh match merge into one slot per
    position (count 3, mean value); the compiled step over that cache (+log(count) on the logit) equals the
    plain export attending to all three frames' tokens, within 1e-5."""
    fast = OrtDiT(_compile(dit_tiny_export, tmp_path, "lsh", "0.99"))
    plain = OrtDiT(dit_tiny_export)
    rng = np.random.default_rng(2)
    T, H, d, n = CFG.tokens_per_frame, CFG.heads, CFG.head_dim, CFG.layers
    rows, frames = 2, 3
    cache = fast.new_cache(n, T, 1, 4)
    keys = [rng.standard_normal((rows, H, T, d)).astype(np.float32) for _ in range(n)]
    values = [rng.standard_normal((rows, H, frames * T, d)).astype(np.float32) for _ in range(n)]
    written = [np.concatenate([keys[i]] * frames, 2) for i in range(n)]
    kv = [a for i in range(n) for a in (written[i], values[i])]
    cache.write(1, [*kv, *written])  # frames 1-3 (frame 0 is a sink: it would not merge)
    assert cache.merges[0] == 2 * n * rows * H * T and cache.kv_density == pytest.approx(1 / 3)
    latent = rng.standard_normal((rows, CFG.in_channels, CFG.chunk_frames, CFG.latent_h, CFG.latent_w))
    timestep = np.full((rows, CFG.chunk_frames), 500.0, np.float32)
    cross = plain.text_kv(rng.standard_normal((rows, CFG.text_len, CFG.text_dim)).astype(np.float32))
    got = fast.step(latent.astype(np.float32), timestep, 4, cache, cross)
    got = [a.copy() for a in got[:1 + 2 * n]]
    want = plain.step(latent.astype(np.float32), timestep, 4, kv, cross)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_metadata_records_the_match_and_the_runtime_reads_it(dit_tiny_export, tmp_path, capsys):
    path = _compile(dit_tiny_export, tmp_path, "int8", "0.3")
    meta = {p.key: p.value for p in onnx.load(str(path), load_external_data=False).metadata_props}
    buckets = {"kind": "int8"} | {n: modes.BY_NAME[n].default for n in ("lsh_bits", "int8_dirs", "ann_tables",
                                                                          "ann_seed")}
    assert json.loads(meta[DIT_MODES_KEY]) == {"threshold": None, "tempcache": 0.3, "tempcache_match": "int8",
                                           "tempcache_buckets": buckets, "tempcache_kernel": _kernel(),
                                           "annca": None, "annsa": None}
    fast = OrtDiT(path)
    assert isinstance(fast.hasher, Int8Buckets) and (fast.hasher.dirs, fast.hasher.tables) == (2, 2)
    assert isinstance(OrtDiT(_compile(dit_tiny_export, tmp_path, "lsh", "0.3")).hasher, SignLSH)
    capsys.readouterr()
    assert main(["stream", str(path), "--frames", "6", "-o", str(tmp_path / "run")]) == 0
    assert "TempCache compiled in (SIM 0.3, int8 match)" in capsys.readouterr().out
    done = json.loads((tmp_path / "run" / "stream.json").read_text())["compiled_modes"]
    assert done["tempcache_match"] == "int8" and 0 < done["merge_ratio"] < 1 and 0 < done["kv_density"] < 1


@pytest.mark.parametrize("argv, words", [
    (["--tempcache-match", "nearest", "--tempcache", "0.9"], "invalid choice: 'nearest'"),
    (["--tempcache-match", "lsh"], "--tempcache-match lsh needs --tempcache SIM"),
])
def test_bad_match_is_refused_in_one_line(dit_tiny_export, tmp_path, capsys, argv, words):
    assert words in refusal([str(dit_tiny_export), "-o", str(tmp_path / "x.onnx"), *argv], capsys)
    assert not (tmp_path / "x.onnx").exists()


def test_api_takes_the_match_and_its_buckets(dit_tiny_export, tmp_path):
    """fastcar_compile.compile on a DiT step graph: the match and the bucket options recorded (a DiT is not held
    to a decoder's rule that --tempcache needs --kv-budget); a bad value refused in one line."""
    import fastcar_compile as fc

    model, _ = fc.compile(str(dit_tiny_export), str(tmp_path / "api.onnx"), tempcache=0.5, tempcache_match="lsh",
                          lsh_bits=3, ann_tables=4)
    rec = json.loads(model.metadata_props[DIT_MODES_KEY])
    assert rec["tempcache_match"] == "lsh" and rec["tempcache_buckets"] == {
        "kind": "lsh", "lsh_bits": 3, "int8_dirs": 2, "ann_tables": 4, "ann_seed": 0}
    hasher = OrtDiT(tmp_path / "api.onnx").hasher
    assert (hasher.bits, hasher.tables) == (3, 4)
    with pytest.raises(FastCarError, match="must be one of aligned, lsh, int8, got 'nearest'") as err:
        fc.compile(str(dit_tiny_export), tempcache=0.5, tempcache_match="nearest")
    assert "\n" not in str(err.value)


def test_top1_match_on_a_decoder_is_refused(tmp_path, capsys):
    """A graph without the DiT metadata: one line naming the flag, exit 2, nothing written."""
    src = not_a_dit(tmp_path)
    assert main([str(src), "-o", str(tmp_path / "o.onnx"), "--frame-tokens", "4", "--tempcache-match", "lsh"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and "--tempcache-match" in err[0] and "DiT" in err[0]
    assert not (tmp_path / "o.onnx").exists()


def test_calibrate_replay_streams_the_probe_with_the_match(dit_tiny_export, tmp_path, dit_tiny_eager, capsys):
    """`--calibrate-replay 0.4 --tempcache 0.3 --tempcache-match lsh --lsh-bits 3` over 8 frames: the probe's
    rollout merges as the final graph's will, so the tau equals the eager calibration of TempCache-lsh with those
    buckets (and differs from one without TempCache)."""
    from fastcar_compile.dit.fastar import calibrate_tau

    out = tmp_path / "cal.onnx"
    assert main([str(dit_tiny_export), "-o", str(out), "--calibrate-replay", "0.4", "--tempcache", "0.3",
                 "--tempcache-match", "lsh", "--lsh-bits", "3", "--calib-frames", "8"]) == 0
    fast = OrtDiT(out)
    assert fast.match == "lsh" and fast.hasher.bits == 3
    fa = modes.settings(tempcache=0.3, tempcache_match="lsh", lsh_bits=3, calibrate_replay=0.4)
    want = calibrate_tau(dit_tiny_eager, fa, StreamSettings(frames=8, seed=0), chunks=4)
    assert fast.tau == pytest.approx(want, abs=1e-4)
    plain = calibrate_tau(dit_tiny_eager, modes.settings(calibrate_replay=0.4), StreamSettings(frames=8, seed=0), chunks=4)
    assert abs(want - plain) > 1e-3  # the merges change the rollout: a probe without them would miss
