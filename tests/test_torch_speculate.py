"""Speculative decoding of a FastCar transformers model through transformers' assisted generation
(fastcar_compile.torch.speculate): previous-frame candidates, verified in one multi-token step whose gates decide
per token, the FastCar state of rejected candidates rolled back.

References: the eager FastCar hook reference (tests/reference.py) decoding greedily one token per step, plain
greedy `generate()` of the same FastCar model, and (tau = +inf) the untouched transformers model."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import zoo
from reference import FastCarReference
from test_pass_reference import TOL

fct = pytest.importorskip("fastcar_compile.torch")
from fastcar_compile.core.errors import FastCarError  # noqa: E402
from fastcar_compile.torch import speculate  # noqa: E402
from fastcar_compile.torch.module import FastCarDecoder  # noqa: E402

L, N = 4, 24


def _prompt() -> np.ndarray:
    """Three repeats of one frame: the previous-frame draft is right at first, then the model moves on."""
    return np.tile(np.random.default_rng(3).integers(0, zoo.VOCAB, L), 3)[None]


def _verify_steps(monkeypatch) -> list[np.ndarray]:
    """Records the replay decisions of every multi-token decode step (the verify steps)."""
    seen: list[np.ndarray] = []
    forward = FastCarDecoder.forward

    def spy(self, input_ids, attention_mask, *past, **kw):
        out = forward(self, input_ids, attention_mask, *past, **kw)
        if input_ids.shape[1] > 1 and past[1].shape[2] > 0:
            seen.append(np.stack([r.numpy() for r in self.last_replay.values()]))
        return out

    monkeypatch.setattr(FastCarDecoder, "forward", spy)
    return seen


def test_greedy_tokens_and_state_equal_sequential_fastcar(monkeypatch):
    model = zoo.build_model("qwen2")
    prompt = _prompt()
    tau = 0.5
    with FastCarReference(model, frame_tokens=L, threshold=tau, video_start=0) as ref:
        run = ref.run([prompt], greedy=N)
        final = {i: (ref.mlp_cache[i].numpy().copy(), ref.mlp_age[i].numpy().copy()) for i in ref.layers}
    dec = np.concatenate([np.concatenate(run.replay[i][1:], 1) for i in run.replay])
    assert 0.1 < dec.mean() < 0.9  # a tau that mixes replay and compute
    fm = fct.apply(model, frame_tokens=L, threshold=tau, video_start=0)
    with torch.no_grad():
        plain = fm.generate(torch.as_tensor(prompt), max_new_tokens=N, do_sample=False)
        verify = _verify_steps(monkeypatch)
        out = speculate.generate(fm, torch.as_tensor(prompt), draft_tokens=3, max_new_tokens=N, do_sample=False,
                                 return_dict_in_generate=True)
        gen = fm.fastcar.last_candidates
        want = np.concatenate(run.steps, 1)  # the reference's tokens: prompt, then N greedy ones
        np.testing.assert_array_equal(plain.numpy(), want)
        np.testing.assert_array_equal(out.sequences.numpy(), want)
        assert gen.verify_steps > 0 and 0 < gen.accepted < gen.proposed  # drafts accepted and rejected
        assert any(v.any() for v in verify) and not all(v.all() for v in verify)  # verify steps replay per token
        # generate() never feeds its last token: feed it, then the state is the reference's after all N steps
        mask = torch.ones(1, want.shape[1], dtype=torch.int64)
        fm(input_ids=torch.as_tensor(want[:, -1:]), attention_mask=mask, past_key_values=out.past_key_values)
    for j, i in enumerate(fm.fastcar.layers):
        np.testing.assert_array_equal(fm.fastcar.state[2 * j + 1].numpy(), final[i][1])
        np.testing.assert_allclose(fm.fastcar.state[2 * j].numpy(), final[i][0], atol=TOL, rtol=0)


def test_rejected_candidates_leave_no_state():
    """One verify step by hand: candidates that are all rejected leave the state of one single-token step."""
    model = zoo.build_model("llama")
    prompt = _prompt()
    fm = fct.apply(model, frame_tokens=L, threshold=-100.0, video_start=0)  # every eligible token replays
    ref_model = fct.apply(model, frame_tokens=L, threshold=-100.0, video_start=0)
    with torch.no_grad():
        gen = speculate.PreviousFrameCandidates(fm.fastcar, "temporal", 3, 100)
        ids = torch.as_tensor(prompt)
        out = fm(input_ids=ids)  # the prefill
        ref_out = ref_model(input_ids=ids)
        nxt = out.logits[:, -1:].argmax(-1)
        seq = torch.cat([ids, nxt], 1)
        gen.first = False
        cand, _ = gen.get_candidates(seq)
        wrong = cand.clone()
        wrong[:, seq.shape[1]:] = (cand[:, seq.shape[1]:] + 1) % zoo.VOCAB  # candidates that will not match
        fm.fastcar.decode_program = speculate.decode_program
        mask = torch.ones(1, wrong.shape[1], dtype=torch.int64)
        fm(input_ids=wrong[:, -4:], attention_mask=mask, past_key_values=out.past_key_values)
        assert any(r.any() for r in fm.fastcar.last_replay.values())  # the rejected tokens did write their slots
        gen.update_candidate_strategy(wrong, None, 0)
        ref_model(input_ids=nxt, attention_mask=torch.ones(1, seq.shape[1], dtype=torch.int64),
                  past_key_values=ref_out.past_key_values)  # sequential: only the kept token
    for now, want in zip(fm.fastcar.state, ref_model.fastcar.state, strict=True):
        torch.testing.assert_close(now, want, atol=TOL, rtol=0)


def test_at_inf_equals_plain_transformers():
    model = zoo.build_model("llama")
    prompt = torch.as_tensor(_prompt())
    fm = fct.apply(model, frame_tokens=L, threshold=math.inf)
    with torch.no_grad():
        want = model.generate(prompt, max_new_tokens=N, do_sample=False)
        got = speculate.generate(fm, prompt, max_new_tokens=N, do_sample=False)  # adaptive K
    assert torch.equal(got, want)
    assert fm.fastcar.last_candidates.verify_steps > 0


def test_refuses_what_cannot_be_exact():
    fm = fct.apply(zoo.build_model("llama"), frame_tokens=L, threshold=0.0)
    with pytest.raises(FastCarError, match="fit one frame"):
        speculate.generate(fm, torch.as_tensor(_prompt()), draft_tokens=L, max_new_tokens=4)
    with pytest.raises(FastCarError, match="batch 1"):
        speculate.generate(fm, torch.as_tensor(np.repeat(_prompt(), 2, 0)), max_new_tokens=4)
