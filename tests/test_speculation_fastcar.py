"""Speculative decoding on a FastCar-compiled model: a verify step of K+1 <= L tokens decides replay per token as
single-token steps would, and rejected tokens leave no trace in the MLP cache rows and ages. Checked against the
eager PyTorch FastCar reference decoding one token per step (tests/reference.py), left-padded batches included."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import zoo
from reference import FastCarReference

from fastcar_compile.core.errors import FastCarError
from fastcar_compile.runtime import FastCarSession
from fastcar_compile.runtime.decode import left_pad

L = 8
TAU = 0.0  # about a third to two thirds of the eligible decisions replay on the zoo model (test_runtime_fastcar)
GIVEN = 2  # the last 2 prompt tokens are video: the first generated frame may replay at once
PROMPTS = [[5, 6, 7, 8, 1, 2, 3, 4, 9, 9], [9, 10, 3, 7]]  # left-padded batch of two


@pytest.fixture(scope="module")
def fast_path(zoo_model, fc_compile, tmp_path_factory):
    path = tmp_path_factory.mktemp("specfc") / "fast.onnx"
    fc_compile(zoo_model("llama", "dynamo20"), path, frame_tokens=L, threshold=TAU)
    return path


def _oracle(monkeypatch, truth: np.ndarray, given: int) -> list[int]:
    """Drafts from the plain run's own tokens, the last one wrong every third step: long accepted prefixes and
    rejections on a random model whose previous-frame drafts would all be rejected. Returns the step lengths."""
    from fastcar_compile.runtime import decode

    calls: list[int] = []

    def propose(spec, histories, video_len, frame_tokens, k):
        n = video_len - given  # tokens generated so far
        d = truth[:, n: n + k].copy()
        calls.append(d.shape[1])
        if len(calls) % 3 == 0 and d.shape[1]:
            d[:, -1] = (d[:, -1] + 1) % zoo.VOCAB
        return d

    monkeypatch.setattr(decode, "propose", propose)
    return calls


def _reference(tokens: np.ndarray, pad: list[int], ids: np.ndarray):
    """The reference's one-token-per-step FastCar decode teacher-forced on `tokens`, and the reference itself
    (its MLP caches and ages are those after the last fed token)."""
    model = zoo.build_model("llama")
    ref = FastCarReference(model, frame_tokens=L, threshold=TAU, video_start=ids.shape[1] - GIVEN)
    steps = [ids] + [tokens[:, k: k + 1] for k in range(tokens.shape[1] - 1)]
    return ref.run(steps, pad=pad), ref


@pytest.mark.parametrize("native", [True, False])
def test_verify_steps_equal_single_token_reference(fast_path, monkeypatch, native):
    """Greedy with drafts on the FastCar model: tokens identical to plain FastCar greedy and to the reference's
    argmax; every kept token's replay decision per layer and row is the reference's single-token decision; verify
    steps both replay and compute inside one step. Native kernels (state written in place) and function bodies."""
    if native:
        from fastcar_compile.runtime.native import library_path

        if library_path() is None:
            pytest.skip("native kernels not built here")
    sess = FastCarSession(fast_path, threads=1, native=native)
    plain = sess.generate(PROMPTS, 4, given_video_tokens=GIVEN)
    lengths = _oracle(monkeypatch, plain.tokens, GIVEN)
    spec = sess.generate(PROMPTS, 4, given_video_tokens=GIVEN, draft="temporal:5")
    np.testing.assert_array_equal(spec.tokens, plain.tokens)
    st = spec.stats
    assert 0 < st.draft_accepted < st.draft_proposed and st.tokens_per_step > 2 and max(lengths) == 5

    ids, mask = left_pad(PROMPTS, 0)
    pad = (mask == 0).sum(1).tolist()
    run, ref = _reference(spec.tokens, pad, ids)
    ref.close()
    np.testing.assert_array_equal(np.stack([lg[:, -1].argmax(-1) for lg in run.logits], axis=1), spec.tokens)
    got = st.replay_array()  # [kept tokens, layers, batch]
    assert [s["pos"] for s in st.steps] == list(range(ids.shape[1], ids.shape[1] + spec.tokens.shape[1] - 1))
    for li, layer in enumerate(sess.layers):
        want = np.array([r[:, 0] for r in run.replay[layer][1:]])  # [steps, batch]
        tas = np.array([t[:, 0] for t in run.tas[layer][1:]])
        close = np.abs(np.nan_to_num(tas, nan=1e9) - TAU) < 1e-4  # ties at tau: float order may differ
        assert (got[:, li, :] == want)[~close].all(), layer
    assert 0.2 < st.replay_ratio < 0.8
    assert got.any() and not got.all()


def test_rejected_tokens_restore_the_fastcar_state(fast_path):
    """One verify step whose drafts are all rejected, then rewound: the MLP cache rows and ages equal those of
    the reference after the same tokens one per step (and the step did write the rejected tokens' slots, so a
    missing restore would fail). A fully accepted step keeps its writes: state equal to the reference too."""
    sess = FastCarSession(fast_path, threads=1)
    ids, mask = left_pad(PROMPTS, 0)
    pad = (mask == 0).sum(1).tolist()
    toks = sess.generate(PROMPTS, 3, given_video_tokens=GIVEN).tokens
    vs = ids.shape[1] - GIVEN
    st = sess.new_state(2, video_start=vs)
    out = sess.step(st, ids, attention_mask=mask)
    n = L + 3  # tokens fed after the prompt one by one: past frame 0, so the next ones may replay
    for k in range(n):
        out = sess.step(out.state, toks[:, k: k + 1])
    state = out.state
    for accept in (False, True):
        pos, k = state.past_len, 5
        draft = toks[:, n + 1: n + 1 + k] if accept else (toks[:, n + 1: n + 1 + k] + 1) % zoo.VOCAB
        feed = np.concatenate([toks[:, n: n + 1], draft], axis=1)
        before = {name: a.copy() for name, a in state.arrays.items() if "mlp" in name}
        snap = sess.snapshot(state, k + 1)
        out = sess.step(state, feed)
        assert out.replay.shape == (len(sess.layers), 2, k + 1)
        m = k + 1 if accept else 1
        if not accept:
            slots = (np.arange(pos + 1, pos + k + 1) - vs) % L
            assert any((out.state.arrays[name][:, slots] != a[:, slots]).any() for name, a in before.items())
        state = sess.rewind(out.state, pos + m, snap)
        fed = n + m
        run, ref = _reference(toks[:, : fed + 1], pad, ids)
        ref.close()
        for layer in sess.layers:
            cache = state.arrays[f"past_mlp_cache.{layer}"]
            age = state.arrays[f"past_mlp_age.{layer}"]
            np.testing.assert_array_equal(age, ref.mlp_age[layer].numpy(), err_msg=f"layer {layer}")
            np.testing.assert_allclose(cache, ref.mlp_cache[layer].numpy(), atol=1e-4, err_msg=f"layer {layer}")
        n = fed


def test_cfg_pairs_and_adaptive_drafts_equal_plain(fast_path):
    """Classifier-free guidance (the pair verifies one draft, each row decides replay for itself) with real
    previous-frame drafts and adaptive K: tokens and per-token replay bits equal plain FastCar decoding; a fixed
    K beyond the frame is cut to L - 1 tokens per step."""
    sess = FastCarSession(fast_path, threads=1)
    kw = dict(given_video_tokens=GIVEN, cfg_scale=1.5, uncond_prompt_ids=[[9, 9], [3, 7]])
    plain = sess.generate(PROMPTS, 3, **kw)
    for draft in ("temporal", "temporal+ngram:16"):
        spec = sess.generate(PROMPTS, 3, draft=draft, **kw)
        np.testing.assert_array_equal(spec.tokens, plain.tokens)
        np.testing.assert_array_equal(spec.stats.replay_array(), plain.stats.replay_array())
        assert spec.stats.draft_proposed <= (L - 1) * spec.stats.verify_steps


def test_model_compiled_before_the_rule_refuses(fast_path, tmp_path):
    """A model without `fastcar.multi_token_decode` (compiled when multi-token steps computed every MLP)."""
    model = onnx.load(fast_path, load_external_data=False)
    kept = [p for p in model.metadata_props if p.key != "fastcar.multi_token_decode"]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    old = tmp_path / "old.onnx"
    onnx.save(model, old)
    for f in fast_path.parent.iterdir():  # external data, if any
        if f.suffix != ".onnx" and not (tmp_path / f.name).exists():
            (tmp_path / f.name).write_bytes(f.read_bytes())
    sess = FastCarSession(old, threads=1)
    with pytest.raises(FastCarError, match="compiled before FastCar decided replay per token"):
        sess.generate([[1, 2, 3]], 1, draft="temporal")


def test_eval_draft_on_fastcar_with_dense(fast_path, zoo_model, tmp_path, capsys):
    """`eval --model fast.onnx --dense model.onnx --draft temporal:4`: FastCar plain and with the draft, the dense
    model plain and with the draft, in one run; FastCar + draft gives FastCar's greedy tokens (and the same
    replay ratio), the dense draft the dense tokens; a FastCar model as --dense is refused."""
    import json

    from fastcar_compile.cli import main

    np.save(tmp_path / "p.npy", np.array([PROMPTS[0], PROMPTS[0][::-1]]))
    args = ["eval", "--model", str(fast_path), "--prompts", str(tmp_path / "p.npy"), "--frames", "3",
            "--given-video-tokens", str(GIVEN), "--threads", "1", "--draft", "temporal:4"]
    assert main([*args, "--dense", str(zoo_model("llama", "dynamo20")), "--out", str(tmp_path / "run")]) == 0
    res = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert res["token_agreement"] == 1.0 and res["dense_token_agreement"] == 1.0
    assert res["replay_plain"] == res["replay_draft"] > 0
    assert res["speedup_vs_best_alone"] > 0 and res["verify_steps"] > 0
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == \
        ["dense.json", "dense_draft.json", "draft.json", "eval.json", "plain.json"]
    assert "faster of FastCar alone and the draft alone" in capsys.readouterr().out
    assert main([*args, "--dense", str(fast_path), "--out", str(tmp_path / "run2")]) != 0
    assert "is FastCar-compiled" in capsys.readouterr().err


def test_compressed_kv_cache_refuses_drafts(zoo_model, fc_compile, native_lib, tmp_path):
    """A FastCar model with a compressed KV cache (--kv-budget): merged slots cannot drop a rejected token, so
    drafts are refused in one line naming the option, by generate and by rewind."""
    comp = tmp_path / "comp.onnx"
    fc_compile(zoo_model("llama", "dynamo20"), comp, frame_tokens=L, threshold=TAU, kv_budget=16, kv_sinks=2,
               kv_window=L)
    sess = FastCarSession(comp, threads=1)
    with pytest.raises(FastCarError, match="compressed KV cache cannot drop rejected draft tokens.*--kv-budget"):
        sess.generate([[1, 2, 3]], 1, draft="temporal")
    out = sess.step(sess.new_state(1), np.array([[1, 2, 3]]))
    with pytest.raises(FastCarError, match="--kv-budget"):
        sess.rewind(out.state, 1)


def test_sampled_tokens_follow_the_fastcar_model(fast_path):
    """Exact speculative sampling with FastCar on: the joint law of the first three sampled tokens (two of them
    verified in one step, each deciding replay itself) equals the FastCar model's, enumerated prefix by prefix
    with single-token steps; chi-square over the cells. A frame 0 is given, so every generated token may
    replay, and the drafts are drawn from the model's distribution one frame back. One batch of rows (it stops at
    its shortest accepted prefix) and single rows over many seeds."""
    from scipy.stats import chisquare

    from fastcar_compile.runtime.sampling import Sampler

    sess = FastCarSession(fast_path, threads=1, inplace=False)  # states not written in place: prefixes branch
    row = PROMPTS[0][:2] + PROMPTS[0][:L]  # 2 prompt tokens, then a given frame 0
    sampler = Sampler(do_sample=True, temperature=1.5, top_k=3)
    first = sess.step(sess.new_state(1, video_start=2), np.array([row]))
    law = {(): (1.0, first)}
    for _ in range(3):  # P(first three tokens) through FastCar's own single-token steps
        nxt = {}
        for prefix, (q, out) in law.items():
            p = sampler.probs(out.logits[:, -1].astype(np.float64))[0]
            for t in np.flatnonzero(p > 0):
                step = sess.step(out.state, np.array([[t]])) if len(prefix) < 2 else None
                nxt[(*prefix, int(t))] = (q * p[t], step)
        law = nxt
    exact = {c: q for c, (q, _) in law.items()}
    n = 600
    counts: dict[tuple, int] = {}
    stats = []
    for rows, seed in [(n // 2, 0)] + [(1, s) for s in range(1, n // 2 + 1)]:  # one batch, then single rows
        res = sess.generate([row] * rows, 1, given_video_tokens=L, draft="temporal:2", do_sample=True,
                            temperature=1.5, top_k=3, seed=seed)
        stats.append(res.stats)
        for t in map(tuple, res.tokens[:, :3].tolist()):
            counts[t] = counts.get(t, 0) + 1
    assert 0 < sum(s.draft_accepted for s in stats) < sum(s.draft_proposed for s in stats)
    assert 0 < np.mean([s.replay_ratio for s in stats]) < 1
    assert set(counts) <= set(exact)
    cells = sorted(exact, key=lambda c: -exact[c])
    big = [c for c in cells if exact[c] * n >= 5]  # the rest pooled into one cell
    rest = [c for c in cells if c not in big]
    obs = [counts.get(c, 0) for c in big] + ([sum(counts.get(c, 0) for c in rest)] if rest else [])
    exp = [exact[c] * n for c in big] + ([n * sum(exact[c] for c in rest)] if rest else [])
    assert len(big) >= 10  # a law spread enough to tell a wrong rule apart
    assert chisquare(obs, exp).pvalue > 1e-3
