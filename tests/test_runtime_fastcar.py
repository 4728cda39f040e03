"""Runtime on compiled fast.onnx models: fresh state per video, tau=+inf == dense, replay bookkeeping against
the eager PyTorch reference, CFG rows deciding independently, threshold calibration and baking."""

from __future__ import annotations

import json
import math

import numpy as np
import onnx
import ort_driver
import pytest
import zoo
from reference import FastCarReference

from fastcar_compile.api import bake_threshold
from fastcar_compile.core.errors import FastCarError
from fastcar_compile.runtime import FastCarSession, calibrate_threshold
from fastcar_compile.runtime.decode import left_pad

L = 8


def _compile(src, dst, **kw):
    fc = pytest.importorskip("fastcar_compile")
    if not hasattr(fc, "compile"):
        pytest.skip("compiler pass not available")
    fc.compile(str(src), str(dst), **kw)
    return dst


@pytest.fixture(scope="module")
def dense_path(zoo_model):
    return zoo_model("llama", "dynamo20")


@pytest.fixture(scope="module")
def fast_path(dense_path, tmp_path_factory):
    return _compile(dense_path, tmp_path_factory.mktemp("rt") / "fast.onnx", frame_tokens=L)


@pytest.fixture(scope="module")
def diag_path(dense_path, tmp_path_factory):
    return _compile(dense_path, tmp_path_factory.mktemp("rt") / "fast_diag.onnx", frame_tokens=L,
                    emit_diagnostics=True)


@pytest.fixture(scope="module")
def fast(fast_path):
    return FastCarSession(fast_path, threads=1)


def test_two_videos_in_a_row_equal_fresh_sessions(fast, fast_path):
    fast.generate([[1, 2, 3]], 4, threshold=0.0)  # video 1 must leave nothing behind
    b = fast.generate([[7, 8, 9]], 4, threshold=0.0)
    assert 0 < b.stats.replay_ratio
    fresh = FastCarSession(fast_path, threads=1).generate([[7, 8, 9]], 4, threshold=0.0)
    np.testing.assert_array_equal(b.tokens, fresh.tokens)
    assert b.stats.steps == fresh.stats.steps


def test_dense_and_fast_at_inf_give_identical_tokens(fast, dense_path):
    dense = FastCarSession(dense_path, frame_tokens=L, threads=1)
    kw = dict(do_sample=True, top_k=30, top_p=0.95, temperature=1.2, seed=3)
    d = dense.generate([[4, 5, 6], [1]], 4, **kw)
    f = fast.generate([[4, 5, 6], [1]], 4, threshold=math.inf, **kw)
    np.testing.assert_array_equal(d.tokens, f.tokens)
    assert f.stats.replay_ratio == 0.0
    g = fast.generate([[4, 5, 6], [1]], 4, threshold=-50.0, **kw)
    assert g.stats.replay_ratio > 0.5 and not np.array_equal(g.tokens, d.tokens)


def test_replay_trace_matches_eager_reference(fast):
    """The replay bits the runtime reads from the age counters are the reference's decisions."""
    prompt = [[3, 1, 4, 1, 5]]
    res = fast.generate(prompt, 4, threshold=0.0)
    model = zoo.build_model("llama")
    steps = [np.array(prompt)] + [res.tokens[:, k: k + 1] for k in range(res.tokens.shape[1] - 1)]
    with FastCarReference(model, frame_tokens=L, threshold=0.0, video_start=5) as ref:
        run = ref.run(steps)
    got = res.stats.replay_array()  # [steps, layers, batch]
    for li, layer in enumerate(fast.layers):
        want = np.array([r[:, 0] for r in run.replay[layer][1:]])  # decode steps, [steps, batch]
        tas = np.array([t[:, 0] for t in run.tas[layer][1:]])
        close = np.abs(np.nan_to_num(tas, nan=1e9)) < 1e-4  # ties at tau: float order may differ
        assert (got[:, li, :] == want)[~close].all(), layer
    assert 0.2 < res.stats.replay_ratio < 0.8
    # and the greedy tokens are the reference's argmax over the same history
    ref_tok = np.stack([lg[:, -1].argmax(-1) for lg in run.logits], axis=1)
    np.testing.assert_array_equal(ref_tok, res.tokens)


def test_replay_from_ages_equals_diagnostics_outputs(fast, diag_path):
    diag = FastCarSession(diag_path, threads=1)
    assert diag.has_diagnostics and not fast.has_diagnostics
    a = fast.generate([[2, 7, 1]], 3, threshold=0.5)
    b = diag.generate([[2, 7, 1]], 3, threshold=0.5, collect_tas=True)
    assert a.stats.steps == b.stats.steps  # ages (fast) vs replay_mask outputs (diag)
    tas = np.array(b.stats.tas)  # [steps, layers, rows]
    rep = b.stats.replay_array()
    pos = np.array([s["pos"] for s in b.stats.steps])
    eligible = (pos - L >= 3)[:, None, None]
    np.testing.assert_array_equal(rep, eligible & (tas > 0.5))
    with pytest.raises(FastCarError, match="emit-diagnostics"):
        fast.generate([[1]], 2, collect_tas=True)


def test_cfg_rows_decide_replay_independently(fast):
    """Conditional and unconditional rows replay differently, each exactly as it would alone."""
    cond, uncond = [1, 2, 3, 4], [9, 9]
    res = fast.generate([cond], 4, threshold=0.0, cfg_scale=2.5, uncond_prompt_ids=[uncond])
    rep = res.stats.replay_array()  # [steps, layers, 2]
    assert (rep[:, :, 0] != rep[:, :, 1]).any(), "rows never differ: test model too uniform"
    for row, prompt in ((0, cond), (1, uncond)):
        st = fast.new_state(1, video_start=len(prompt))
        out = fast.step(st, np.array([prompt]), threshold=0.0)
        alone = []
        for t in res.tokens[0, :-1]:
            out = fast.step(out.state, np.array([[t]]), threshold=0.0)
            alone.append(out.replay[:, 0])
        np.testing.assert_array_equal(np.array(alone), rep[:, :, row])
    assert len(res.stats.replay_per_row) == 2


def test_calibration_reaches_target_on_heldout(fast_path, dense_path, tmp_path):
    """Bisection on the calibration prompts; the held-out ratio lands within 3 points of the target."""
    path = _compile(dense_path, tmp_path / "fast16.onnx", frame_tokens=16)
    rng = np.random.default_rng(0)
    calib, held = rng.integers(0, zoo.VOCAB, (32, 4)), rng.integers(0, zoo.VOCAB, (32, 4))
    for target in (0.3, 0.6):
        r = calibrate_threshold(path, calib, num_frames=4, target_replay=target, heldout_prompts=held,
                                progress=False, batch_size=16)
        assert abs(r.replay_calib - target) <= 0.005 + 1e-9, r.summary()
        assert abs(r.replay_heldout - target) <= 0.03, r.summary()
        check = FastCarSession(path, threads=1).generate(held[:16], 4, threshold=r.tau)
        assert abs(check.stats.replay_ratio - target) <= 0.06
    with pytest.raises(FastCarError, match="outside"):
        calibrate_threshold(path, calib, num_frames=4, target_replay=0.9)


def test_calibration_quality_budget(fast_path, dense_path):
    rng = np.random.default_rng(1)
    calib = rng.integers(0, zoo.VOCAB, (8, 3))
    r = calibrate_threshold(fast_path, calib, num_frames=3, quality_budget=0.05, dense_model_path=dense_path,
                            progress=False)
    assert r.divergence_calib <= 0.05 and r.replay_calib > 0
    # every probe with more replay than the chosen tau broke the budget
    assert all(d > 0.05 for t, rep, d in r.probes if rep > r.replay_calib)
    # independent check of the divergence: dense logits from a plain ORT prefill over the same tokens
    fast = FastCarSession(fast_path, threads=1)
    res = fast.generate(calib, 3, threshold=r.tau, keep_logits=True)
    dense = FastCarSession(dense_path, frame_tokens=L, threads=1)
    ids, mask = left_pad([list(x) for x in calib], 0)
    seq = np.concatenate([ids, res.tokens[:, :-1]], 1)
    out = dense.step(dense.new_state(len(calib)), seq,
                     attention_mask=np.concatenate([mask, np.ones_like(res.tokens[:, :-1])], 1))
    p = out.logits[:, ids.shape[1] - 1:].astype(np.float64)
    q = res.logits.astype(np.float64)
    lp = p - np.log(np.exp(p - p.max(-1, keepdims=True)).sum(-1, keepdims=True)) - p.max(-1, keepdims=True)
    lq = q - np.log(np.exp(q - q.max(-1, keepdims=True)).sum(-1, keepdims=True)) - q.max(-1, keepdims=True)
    kl = float((np.exp(lp) * (lp - lq)).sum(-1).mean())
    assert kl == pytest.approx(r.divergence_calib, rel=1e-3, abs=1e-6)


def test_bake_threshold(fast_path, dense_path, tmp_path):
    out = bake_threshold(fast_path, tmp_path / "baked.onnx", 0.25)
    m = onnx.load(str(out))
    assert json.loads({p.key: p.value for p in m.metadata_props}["fastcar.threshold"]) == 0.25
    baked = FastCarSession(out, threads=1)
    assert baked.default_threshold == 0.25
    a = baked.generate([[5, 4, 3]], 3)  # the model's own default
    b = FastCarSession(fast_path, threads=1).generate([[5, 4, 3]], 3, threshold=0.25)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert a.stats.steps == b.stats.steps and a.stats.replay_ratio > 0
    with pytest.raises(FastCarError, match="fastcar_threshold"):
        bake_threshold(dense_path, tmp_path / "x.onnx", 0.0)
    with pytest.raises(FastCarError, match="shape"):
        bake_threshold(fast_path, tmp_path / "x.onnx", [0.0, 1.0])
    assert not (tmp_path / "x.onnx").exists()


def test_threshold_checks_and_report(fast, diag_path, tmp_path):
    """The run's replay ratios against an independent count: the diagnostics model's replay_mask.N outputs,
    run by the tests' own ORT driver on the same tokens (teacher forced), averaged with NumPy."""
    from fastcar_compile.cli import main

    with pytest.raises(FastCarError, match="scalar"):
        fast.generate([[1]], 2, threshold=[0.0, 0.0])
    res = fast.generate([[1, 2]], 3, threshold=0.0, trace=str(tmp_path / "run.json"))
    st = res.stats
    steps = [np.array([[1, 2]])] + [res.tokens[:, k:k + 1] for k in range(res.tokens.shape[1] - 1)]
    ref = ort_driver.decode(diag_path, steps, threshold=0.0, video_start=2)
    bits = np.array([[ref.replay_mask[n][k][0, 0] for n in fast.layers] for k in range(1, len(steps))])  # [step, layer]
    assert len(bits) == 3 * L - 1 and 0 < bits.mean() < 1
    assert st.replay_ratio == pytest.approx(bits.mean())
    frame = np.arange(len(bits)) // L  # decode step k feeds the token at position 2 + k: frame k // L
    want = [[bits[frame == f, i].mean() for f in range(3)] for i in range(len(fast.layers))]
    np.testing.assert_allclose(st.replay_layer_frame, want)
    np.testing.assert_allclose(st.replay_per_frame, [bits[frame == f].mean() for f in range(3)])
    assert st.replay_per_frame[0] == 0.0  # frame 0's aligned tokens are the prompt: never eligible
    trace = json.loads((tmp_path / "run.json").read_text())
    assert trace["frame_tokens"] == L and trace["layers"] == fast.layers and trace["batch"] == 1
    assert all(len(s["replay"]) == len(fast.layers) and len(s["replay"][0]) == 1 for s in trace["steps"])
    assert main(["report", str(tmp_path / "run.json")]) == 0
    assert (tmp_path / "run.replay.png").stat().st_size > 1000


def test_given_frame_and_logits_processor(fast):
    """A prompt ending in a given frame: video_start sits before it, so generated frame 0 may replay."""

    def low_ids(g):
        g = g.copy()
        g[:, 32:] = -np.inf
        return g

    prompt = [[1, 2] + list(range(40, 40 + L))]
    res = fast.generate(prompt, 2, threshold=-1e9, given_video_tokens=L, logits_processor=low_ids)
    assert res.stats.video_start == 2 and (res.tokens < 32).all()
    assert res.stats.replay_per_frame[0] == 1.0 and res.stats.eligible_ratio_ceiling == 1.0
    plain = fast.generate(prompt, 2, threshold=-1e9)
    assert plain.stats.replay_per_frame[0] == 0.0
    with pytest.raises(FastCarError, match="given_video_tokens"):
        fast.generate([[1, 2]], 1, given_video_tokens=3)


def test_per_layer_threshold(dense_path, tmp_path):
    path = _compile(dense_path, tmp_path / "pl.onnx", frame_tokens=L, per_layer_threshold=True)
    s = FastCarSession(path, threads=1)
    assert s.per_layer_threshold and len(s.layers) == 2
    res = s.generate([[1, 2, 3]], 3, threshold=[math.inf, -math.inf])
    assert res.stats.replay_per_layer[0] == 0.0
    assert res.stats.replay_per_layer[1] == pytest.approx(res.stats.eligible_ratio_ceiling)
    with pytest.raises(FastCarError, match="one per rewritten layer"):
        s.generate([[1]], 2, threshold=[0.0, 0.0, 0.0])
    baked = bake_threshold(path, tmp_path / "pl_baked.onnx", 0.5)  # a scalar fills every layer
    assert FastCarSession(baked, threads=1).default_threshold == [0.5, 0.5]
