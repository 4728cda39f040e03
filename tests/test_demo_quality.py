"""The video evaluation against independent references: scikit-image's PSNR / SSIM, loops for token accuracy,
copy rate and the freeze test, the generator's own camera path for the pan check, and the targets' logic."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("skimage")

from skimage.metrics import peak_signal_noise_ratio, structural_similarity  # noqa: E402

from fastcar_compile.demo import quality as q  # noqa: E402
from fastcar_compile.demo import scenes  # noqa: E402
from fastcar_compile.demo.tokenizer import train_tokenizer  # noqa: E402


def test_freeze_frame_against_a_loop() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        T = int(rng.integers(2, 9))
        t = rng.integers(0, 2, (T, 3))
        # loop reference: the earliest f whose frames f..T-1 all equal frame f - 1
        want = next((f for f in range(1, T) if all((t[k] == t[f - 1]).all() for k in range(f, T))), None)
        if want is not None and T - want < 2:
            want = None
        assert q.freeze_frame(t) == want


def test_pan_shift_recovered_from_pixels_and_a_still_fails() -> None:
    """A clean pan's per-pair view shift comes back from the truth's pixels (the camera path is the reference);
    a frozen video (frame 0 repeated) matches no pair."""
    for cam, speed in (("pan_right", "fast"), ("pan_up_left", "slow")):
        c = scenes.make_scene_clip("eval", 5, 12, labels={"camera": cam, "speed": speed, "objects": "objects_0",
                                                          "occluder": "no_occluder", "cut": "no_cut"})
        assert q.is_clean_pan(c.labels, c.cut_at, 12)
        true = q.true_shifts(c.camera)
        want = np.array([(c.camera[t + 1, :2] - c.camera[t, :2]) / c.camera[t, 2] for t in range(11)])
        np.testing.assert_allclose(true, want)
        assert np.hypot(*true.T).min() > 0.6  # it moves every frame
        assert q.pan_match(true, q.recovered_shifts(c.frames)) >= 0.9
        assert q.pan_match(true, q.recovered_shifts(np.repeat(c.frames[:1], 12, axis=0))) == 0.0


def test_clip_quality_against_skimage_and_loops() -> None:
    c = scenes.make_scene_clip("eval", 7, 6, labels={"camera": "pan_down", "speed": "fast", "objects": "objects_0",
                                                     "occluder": "no_occluder", "cut": "no_cut"})
    tok = train_tokenizer(np.concatenate([x.frames for x in scenes.make_scene_clips("train", 6, 6)]), codes=64)
    truth = tok.encode(c.frames)
    rng = np.random.default_rng(1)
    dense = truth.copy()
    dense[1:] = np.where(rng.random(truth[1:].shape) < 0.3, rng.integers(0, 64, truth[1:].shape), truth[1:])
    fast = dense.copy()
    fast[3:] = fast[2]  # FastCar's video freezes from frame 3 on
    r = q.clip_quality(c.frames, truth, dense, fast, tok.decode, c)
    gt, dv, fv = c.frames[1:], tok.decode(dense)[1:], tok.decode(fast)[1:]
    assert r["psnr_dense_vs_truth"] == pytest.approx(peak_signal_noise_ratio(gt, dv))
    assert r["psnr_fast_vs_dense"] == pytest.approx(peak_signal_noise_ratio(dv, fv))
    rep = np.repeat(tok.decode(truth[:1]), 5, axis=0)
    assert r["psnr_repeat_last_vs_truth"] == pytest.approx(peak_signal_noise_ratio(gt, rep))
    want_ssim = np.mean([structural_similarity(gt[t], dv[t], channel_axis=-1, data_range=255) for t in range(5)])
    assert r["ssim_dense_vs_truth"] == pytest.approx(want_ssim, abs=1e-6)
    n = truth[1:].size
    assert r["token_acc_dense"] == pytest.approx(sum(int(a == b) for a, b in zip(dense[1:].flat, truth[1:].flat,
                                                                                    strict=True)) / n)
    same = [int(truth[t, i] == truth[t - 1, i]) for t in range(1, 6) for i in range(truth.shape[1])]
    assert r["copy_rate_truth"] == pytest.approx(np.mean(same))
    assert r["freeze_frame_fast"] == 3 and r["freeze_frame_dense"] is None
    assert r["pan"]["true"] == pytest.approx(q.true_shifts(c.camera).sum(0).tolist())
    assert r["pan"]["fast_match"] <= 0.5 < r["pan"]["truth_match"]


def _clip(**kw) -> dict:
    base = {"frames_generated": 15, "psnr_dense_vs_truth": 20.0, "psnr_fast_vs_truth": 19.6,
            "psnr_repeat_last_vs_truth": 17.5, "copy_rate_dense": 0.40, "copy_rate_truth": 0.45,
            "copy_rate_fast": 0.5, "freeze_frame_dense": None, "freeze_frame_fast": None, "freeze_frame_truth": None}
    return {**base, **kw}


def test_targets_met_and_missed() -> None:
    ok = q.summarize_quality([_clip(), _clip(psnr_dense_vs_truth=21.0, psnr_fast_vs_truth=20.6)], replay_ratio=0.52)
    t = ok["targets"]
    assert t["dense_vs_repeat_last_db"]["value"] == pytest.approx(3.0) and t["dense_vs_repeat_last_db"]["met"]
    assert t["copy_rate_gap"]["met"] and t["frozen_clips"]["met"]
    assert t["fast_drop_at_50pct_db"]["value"] == pytest.approx(0.4) and t["fast_drop_at_50pct_db"]["met"]
    assert "fast_drop_at_80pct_db" not in t
    bad = q.summarize_quality([_clip(psnr_dense_vs_truth=18.0, copy_rate_dense=0.99, freeze_frame_dense=4,
                                     psnr_fast_vs_truth=16.5)], replay_ratio=0.8)
    assert not any(v["met"] for v in bad["targets"].values())
    assert bad["frozen_fraction_dense"] == 1.0 and bad["targets"]["fast_drop_at_80pct_db"]["value"] == pytest.approx(1.5)


def test_summary_intervals_are_students_t_over_clips_and_paired_differences() -> None:
    """Every mean carries its 95% interval over clips (scipy's Student t), and dense - repeat / FastCar - dense
    carry the interval of the per-clip differences, which is tighter than the two means' when clips vary alike."""
    from scipy import stats

    rng = np.random.default_rng(0)
    base = rng.normal(19.0, 2.0, 16)
    dense, rep = base + rng.normal(-0.5, 0.3, 16), base
    fast = dense + rng.normal(0.1, 0.2, 16)
    clips = [_clip(psnr_dense_vs_truth=float(d), psnr_repeat_last_vs_truth=float(r), psnr_fast_vs_truth=float(f))
             for d, r, f in zip(dense, rep, fast, strict=True)]
    s = q.summarize_quality(clips, replay_ratio=0.5)

    def half(v):
        lo, hi = stats.t.interval(0.95, len(v) - 1, loc=np.mean(v), scale=stats.sem(v))
        return (hi - lo) / 2

    assert s["ci95"]["psnr_dense_vs_truth"] == pytest.approx(half(dense), rel=1e-3)
    assert s["dense_minus_repeat_db"] == pytest.approx(np.mean(dense - rep))
    assert s["ci95"]["dense_minus_repeat_db"] == pytest.approx(half(dense - rep), rel=1e-3)
    assert s["ci95"]["fast_minus_dense_db"] == pytest.approx(half(fast - dense), rel=1e-3)
    assert s["dense_minus_repeat_db_clips_above"] == int(np.sum(dense > rep))
    assert s["ci95"]["dense_minus_repeat_db"] < s["ci95"]["psnr_dense_vs_truth"]
    assert q.db(s, "dense_minus_repeat_db", "+").endswith(f"+- {half(dense - rep):.2f} (95%, 16 clips)")
