"""One-pass (TAS quantile) calibration, its confidence interval, the all-or-nothing threshold warning and
the replay ratio with and without frame 0; checked against direct runs, NumPy and SciPy."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import zoo

from fastcar_compile.runtime import FastCarSession, calibrate_threshold
from fastcar_compile.runtime.calib_stats import ci95, tau_for_share
from fastcar_compile.runtime.decode import ThresholdWarning

L = 16


@pytest.fixture(scope="module")
def models(zoo_model, tmp_path_factory):
    import fastcar_compile as fc

    d = tmp_path_factory.mktemp("cq")
    src = zoo_model("llama", "dynamo20")
    fc.compile(str(src), str(d / "diag.onnx"), frame_tokens=L, emit_diagnostics=True)
    return src, d / "diag.onnx"


def test_tau_for_share_matches_numpy():
    x = np.random.default_rng(0).normal(size=1001)
    for share in (0.0, 0.1, 0.5, 0.873, 1.0):
        tau = tau_for_share(x, share)
        assert (x > tau).sum() == round(share * x.size)


def test_ci95_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    for n in (3, 12, 31, 40, 200):
        v = np.random.default_rng(n).random(n)
        lo, hi = stats.t.interval(0.95, n - 1, loc=v.mean(), scale=stats.sem(v))
        assert ci95(v) == pytest.approx((hi - lo) / 2, rel=1e-3)


def test_quantile_calibration_hits_target_in_few_passes(models):
    _, diag = models
    rng = np.random.default_rng(0)
    calib, held = rng.integers(0, zoo.VOCAB, (24, 4)), rng.integers(0, zoo.VOCAB, (24, 4))
    r = calibrate_threshold(diag, calib, num_frames=4, target_replay=0.4, heldout_prompts=held, progress=False,
                            batch_size=12)
    assert r.method == "quantile" and len(r.probes) <= 4  # the TAS pass + at most 3 refinements
    # independent: run the calibration prompts at the returned tau and count replays from the trace
    sess = FastCarSession(diag, threads=1)
    got = sess.generate(calib, 4, threshold=r.tau).stats.replay_array().mean()
    assert abs(got - 0.4) <= 0.01
    assert r.replay_calib == pytest.approx(got, abs=1e-9)
    # CI of the held-out mean from the per-prompt ratios of a direct run
    per = [sess.generate(p[None], 4, threshold=r.tau).stats.replay_ratio for p in held]
    assert r.replay_heldout == pytest.approx(np.mean(per), abs=1e-9)
    assert r.replay_heldout_ci == pytest.approx(ci95(np.array(per)), rel=1e-6)
    assert abs(r.replay_heldout - 0.4) <= 0.1 and "95% CI" in r.summary()


def test_threshold_warning_and_eligible_ratio(models):
    _, diag = models
    sess = FastCarSession(diag, threads=1)
    p = np.array([[5, 17, 42], [9, 3, 77]])
    with pytest.warns(ThresholdWarning, match="every eligible MLP"):
        sess.generate(p, 3, threshold=-1e9)
    with pytest.warns(ThresholdWarning, match="no MLP"):
        sess.generate(p, 3, threshold=1e9)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ThresholdWarning)
        sess.generate(p, 3, threshold=float("inf"))  # off on purpose: no warning
        res = sess.generate(p, 3, threshold=0.0)
    s = res.stats
    assert 0 < s.replay_ratio < s.replay_ratio_eligible < 1
    rep = s.replay_array()
    elig = np.array([st["pos"] - L >= s.video_start for st in s.steps])
    assert s.replay_ratio == pytest.approx(rep.mean())
    assert s.replay_ratio_eligible == pytest.approx(rep[elig].mean())
    assert "frame 0 included" in s.summary() and "frame 0 excluded" in s.summary()


def test_cli_calibrates_prints_tau_then_compiles(models, tmp_path, capsys):
    import onnx

    from fastcar_compile.cli import main

    src, _ = models
    np.save(tmp_path / "p.npy", np.random.default_rng(3).integers(0, zoo.VOCAB, (12, 4)))
    out = tmp_path / "fast.onnx"
    assert main([str(src), "-o", str(out), "--frame-tokens", str(L), "--calibrate-replay", "0.3",
                 "--calib-data", str(tmp_path / "p.npy"), "--calib-frames", "3"]) == 0
    text = capsys.readouterr().out
    line = next(ln for ln in text.splitlines() if ln.startswith("calibrated tau = "))
    tau = float(line.split("= ")[1].split(";")[0])
    assert text.index("calibrated tau") < text.index("wrote")
    meta = {p.key: p.value for p in onnx.load(str(out)).metadata_props}
    assert float(meta["fastcar.threshold"]) == pytest.approx(tau, rel=1e-5)
    assert "tas.0" not in {o.name for o in onnx.load(str(out)).graph.output}  # the probe's outputs stay out


def test_cli_help_says_defaults_and_kl(capsys):
    from fastcar_compile.cli.compile import build_parser

    text = " ".join(build_parser().format_help().split())
    assert "per calibration prompt (default 3" in text
    assert "KL(dense || FastCar)" in text and "abs diff" not in text
