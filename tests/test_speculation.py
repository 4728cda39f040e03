"""Speculative decoding (generate(draft=...)): greedy output identical to plain greedy and to eager transformers,
sampled output distributed as the model's (against distributions enumerated from the model), refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zoo
from reference import plain_logits

from fastcar_compile.core.errors import FastCarError
from fastcar_compile.runtime import FastCarSession
from fastcar_compile.runtime.decode import left_pad
from fastcar_compile.runtime.sampling import Sampler
from fastcar_compile.runtime.speculate import DraftLength, parse_draft, propose, verify

L_ZOO = 8


@pytest.fixture(scope="module")
def demo():
    """The bundled 1-layer video model (dense export, L = 64): real videos, so drafts are accepted and rejected."""
    from fastcar_compile.demo import data
    from fastcar_compile.demo.evaluate import load_tokenizer
    from fastcar_compile.demo.export import ONNX

    tok = load_tokenizer()
    from fastcar_compile.demo.model import prompt

    clips = data.make_clips("eval", 2, 2)
    rows = [prompt(c.motion) + [int(t) for t in tok.encode(c.frames)[0]] for c in clips]
    rows[1] = rows[1][1:]  # one token shorter: the batch is left-padded
    return FastCarSession(ONNX, frame_tokens=64, threads=1), rows


@pytest.fixture(scope="module")
def zoo_dense(zoo_model) -> FastCarSession:
    return FastCarSession(zoo_model("llama", "dynamo20"), frame_tokens=L_ZOO, threads=1)


@pytest.mark.parametrize("draft", ["temporal", "ngram", "temporal+ngram", "temporal:3", "temporal:16"])
def test_greedy_equals_plain_greedy_on_video(demo, draft):
    """Left-padded batch of two videos, frame 0 given: the same tokens as one-token-per-step greedy, with drafts
    both accepted and rejected (so the multi-token step, the KV rewind and the correction all ran)."""
    sess, rows = demo
    plain = sess.generate(rows, 2, given_video_tokens=64)
    spec = sess.generate(rows, 2, given_video_tokens=64, draft=draft)
    np.testing.assert_array_equal(spec.tokens, plain.tokens)
    st = spec.stats
    assert 0 < st.draft_accepted < st.draft_proposed
    assert st.verify_steps < plain.tokens.shape[1] - 1  # fewer model steps than tokens
    assert len(st.steps) == plain.tokens.shape[1] - 1 and st.frames_done == 2


def test_greedy_equals_eager_transformers(demo):
    """Every token of the speculative run is the argmax of the eager transformers model over its history."""
    from fastcar_compile.demo.export import load_model

    sess, rows = demo
    res = sess.generate(rows, 1, given_video_tokens=64, draft="temporal")
    assert res.stats.draft_accepted > 0
    ids, mask = left_pad(rows, 0)
    pad = (mask == 0).sum(1).tolist()
    steps = [ids] + [res.tokens[:, k: k + 1] for k in range(res.tokens.shape[1] - 1)]
    with torch.no_grad():
        ref = plain_logits(load_model().float().eval(), steps, pad=pad)
    np.testing.assert_array_equal(np.stack([lg[:, -1].argmax(-1) for lg in ref], axis=1), res.tokens)


def test_random_model_batch_cfg_and_logits(zoo_dense):
    """A random decoder (drafts mostly rejected), left padding, CFG pairs verifying one draft and keep_logits:
    tokens and kept logits as plain greedy; and the tokens equal eager transformers' greedy ones."""
    prompts = [[5, 6, 7, 8, 1, 2, 3, 4, 9, 9], [9, 10, 3]]
    kw = dict(given_video_tokens=2, keep_logits=True)
    plain = zoo_dense.generate(prompts, 3, **kw)
    spec = zoo_dense.generate(prompts, 3, draft="ngram:4", **kw)
    np.testing.assert_array_equal(spec.tokens, plain.tokens)
    np.testing.assert_allclose(spec.logits, plain.logits, rtol=1e-4, atol=1e-4)
    ids, mask = left_pad(prompts, 0)
    steps = [ids] + [spec.tokens[:, k: k + 1] for k in range(spec.tokens.shape[1] - 1)]
    with torch.no_grad():
        ref = plain_logits(zoo.build_model("llama"), steps, pad=(mask == 0).sum(1).tolist())
    np.testing.assert_array_equal(np.stack([lg[:, -1].argmax(-1) for lg in ref], axis=1), spec.tokens)
    cfg = dict(cfg_scale=2.5, uncond_prompt_ids=[[4], [4, 4]])
    np.testing.assert_array_equal(zoo_dense.generate(prompts, 2, draft="temporal", **cfg).tokens,
                                  zoo_dense.generate(prompts, 2, **cfg).tokens)


def test_callback_stop_keeps_whole_frames(demo):
    sess, rows = demo
    seen = []
    res = sess.generate(rows[:1], 3, given_video_tokens=64, draft="temporal",
                        callback=lambda f, t: seen.append(f) or False)
    assert seen == [0] and res.tokens.shape == (1, 64)
    np.testing.assert_array_equal(res.tokens, sess.generate(rows[:1], 1, given_video_tokens=64).tokens)


def _exact_first_tokens(sess: FastCarSession, row: list[int], sampler: Sampler, n: int) -> dict[tuple, float]:
    """P(first n generated tokens) enumerated from the model (one full prefill per prefix, no drafts)."""
    probs = {(): 1.0}
    for _ in range(n):
        nxt = {}
        for prefix, q in probs.items():
            out = sess.step(sess.new_state(1), np.array([row + list(prefix)]))
            p = sampler.probs(out.logits[:, -1].astype(np.float64))[0]
            for t in np.flatnonzero(p > 0):
                nxt[(*prefix, int(t))] = q * p[t]
        probs = nxt
    return probs


@pytest.mark.parametrize("rows, frame, draft", [(600, 3, "temporal:2"), (1, 3, "temporal:2"), (1, 1, "temporal:1")])
def test_sampled_tokens_follow_the_model(demo, rows, frame, draft):
    """Exact speculative sampling: the joint law of the first three sampled tokens (verified drafts) equals the
    model's, enumerated prefix by prefix; chi-square over the cells. Many rows in one batch (the batch stops at
    its shortest accepted prefix), single rows over many seeds, and frames of one token, where drafts are drawn
    from the model's distribution one frame back (one position back) rather than copied."""
    from scipy.stats import chisquare

    base, rows_ = demo
    sess = FastCarSession(base.path, frame_tokens=frame, threads=1)
    sampler = Sampler(do_sample=True, temperature=1.5, top_k=3)
    row = rows_[0]
    exact = _exact_first_tokens(sess, row, sampler, 3)
    counts: dict[tuple, int] = {}
    accepted = proposed = 0
    for seed in range(600 // rows):
        # (frames of one token: a fourth token, so the third one is drafted from the second one's distribution)
        res = sess.generate([row] * rows, 4 if frame == 1 else 1, given_video_tokens=frame, draft=draft,
                            do_sample=True, temperature=1.5, top_k=3, seed=seed)
        accepted, proposed = accepted + res.stats.draft_accepted, proposed + res.stats.draft_proposed
        for t in map(tuple, res.tokens[:, :3].tolist()):
            counts[t] = counts.get(t, 0) + 1
    assert proposed and (accepted < proposed if rows > 1 else 0 < accepted < proposed)
    assert set(counts) <= set(exact)
    cells = sorted(exact, key=lambda c: -exact[c])
    big = [c for c in cells if exact[c] * 600 >= 5]  # the rest pooled into one cell
    rest = [c for c in cells if c not in big]
    obs = [counts.get(c, 0) for c in big] + ([sum(counts.get(c, 0) for c in rest)] if rest else [])
    exp = [exact[c] * 600 for c in big] + ([600 * sum(exact[c] for c in rest)] if rest else [])
    assert len(big) >= 10  # a law spread enough to tell a wrong rule apart
    assert chisquare(obs, exp).pvalue > 1e-3


def test_accept_rule_is_exact_for_one_position():
    """verify() on fixed logits: the kept first token is distributed as the sampler's p, whichever one-hot draft
    and whichever draft distribution q the draft token was drawn from."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(1, 6)) * 2
    sampler = Sampler(do_sample=True, temperature=0.8, top_p=0.95)
    p = sampler.probs(logits)[0]
    n = 40000
    qs = [None, None, None, np.full(6, 1 / 6), np.array([0.5, 0.3, 0.1, 0.05, 0.03, 0.02])]
    for x, q in zip((int(p.argmax()), int(p.argmin()), 2, None, None), qs, strict=True):
        if q is None:
            draft = np.full((n, 1), x)
        else:
            draft = rng.choice(6, size=(n, 1), p=q)
        kept, a, dists = verify(draft, lambda i: np.repeat(logits, n, axis=0), sampler, rng,
                                None if q is None else [np.repeat(q[None], n, axis=0)])
        np.testing.assert_allclose(dists[0][0], p)
        freq = np.bincount(kept[:, 0], minlength=6) / n
        assert (np.abs(freq - p) <= 4.5 * np.sqrt(p * (1 - p) / n) + 1e-9).all(), (x, q, freq, p)


def test_drafts_copy_the_previous_frame_and_ngrams():
    h = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9])
    # video = the last 6 tokens, frames of 3: the next 4 tokens copy 3 back, chained past the history
    np.testing.assert_array_equal(propose(parse_draft("temporal"), [h], 6, 3, 4), [[7, 8, 9, 7]])
    assert propose(parse_draft("temporal"), [h], 2, 3, 4).shape == (1, 0)  # no previous frame yet
    g = np.array([5, 1, 2, 9, 7, 1, 2])  # "1 2" occurred before, followed by 9 7
    np.testing.assert_array_equal(propose(parse_draft("ngram"), [g], 0, 3, 3), [[9, 7, 1]])
    np.testing.assert_array_equal(propose(parse_draft("temporal+ngram"), [g], 2, 3, 2), [[9, 7]])


def test_adaptive_length_follows_acceptance():
    """Full acceptance drives K up to the longest draft, rejections at the first token down to one."""
    from fastcar_compile.runtime.speculate import ADAPTIVE_MAX

    k = DraftLength(None)
    for _ in range(30):
        k.update(k.k, k.k)
    assert k.k == ADAPTIVE_MAX
    for _ in range(60):
        k.update(k.k, 0)
    assert k.k == 1
    for _ in range(60):  # half of the tokens accepted: a short draft
        k.update(2, 1)
    assert 1 <= k.k <= 4
    fixed = DraftLength(5)
    fixed.update(5, 0)
    assert fixed.k == 5


@pytest.mark.parametrize("draft, tokens, match", [
    ("future", None, "not one of"), ("temporal:x", None, "whole number"), ("temporal:0", None, r"\[1, 256\]"),
    ("temporal:4", 8, "disagree"), (None, 4, "without draft"), (3, None, "must be one of")])
def test_bad_draft_arguments(draft, tokens, match):
    with pytest.raises(FastCarError, match=match):
        parse_draft(draft, tokens)


def _oracle(monkeypatch, truth: np.ndarray) -> None:
    """Drafts from the plain run's own tokens, every third one wrong: long accepted prefixes and rejections on
    a random model whose real drafts would all be rejected."""
    from fastcar_compile.runtime import decode

    calls = [0]

    def propose(spec, histories, video_len, L, k):
        n = video_len - 2  # tokens generated so far (given_video_tokens = 2 below)
        d = truth[:, n: n + k].copy()
        calls[0] += 1
        if calls[0] % 3 == 0 and d.shape[1]:
            d[:, -1] = (d[:, -1] + 1) % 50
        return d

    monkeypatch.setattr(decode, "propose", propose)


@pytest.mark.parametrize("max_length", [None, 96])
def test_accepted_drafts_on_shared_kv_buffers(genai_model, monkeypatch, max_length):
    """An onnxruntime-genai graph (GroupQueryAttention): with max_length its KV buffers are fixed and written in
    place, and a rejection rewinds by not advancing past the accepted length; tokens equal plain greedy."""
    sess = FastCarSession(genai_model("llama") / "model.onnx", frame_tokens=4, threads=1, max_length=max_length)
    prompts = [[5, 6, 7, 8, 1, 2, 3, 4, 9, 9]]
    plain = sess.generate(prompts, 6, given_video_tokens=2)
    _oracle(monkeypatch, plain.tokens)
    spec = sess.generate(prompts, 6, given_video_tokens=2, draft="temporal:5")
    np.testing.assert_array_equal(spec.tokens, plain.tokens)
    assert 0 < spec.stats.draft_accepted < spec.stats.draft_proposed and spec.stats.tokens_per_step > 2


def test_eval_draft_command(demo, tmp_path, capsys):
    """`eval --model dense.onnx --prompts p.npy --draft temporal:8`: plain vs draft in one run, the tokens
    compared (all equal), acceptance and speed written to eval.json; a FastCar --model and --dense refused."""
    import json

    from fastcar_compile.cli import main

    sess, rows = demo
    np.save(tmp_path / "p.npy", np.array([rows[0], rows[0][:1] + rows[1]]))
    args = ["eval", "--model", str(sess.path), "--prompts", str(tmp_path / "p.npy"), "--frames", "2",
            "--given-video-tokens", "64", "--frame-shape", "8x8", "--threads", "1", "--out", str(tmp_path / "run")]
    assert main([*args, "--draft", "temporal:8"]) == 0
    res = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert res["token_agreement"] == 1.0 and res["draft"] == "temporal:8" and 0 < res["acceptance"] < 1
    assert res["tokens_per_step"] > 1 and res["speedup"] > 0
    assert "tokens equal to plain greedy decoding: 100.0%" in capsys.readouterr().out
    assert main([*args, "--draft", "temporal", "--dense", str(sess.path)]) != 0
    assert "drop --dense" in capsys.readouterr().err
