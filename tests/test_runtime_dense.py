"""Runtime on the dense (uncompiled) export: decode loop vs eager PyTorch, padding, state checks, stats, report."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import zoo
from reference import plain_logits

from fastcar_compile.core.errors import FastCarError
from fastcar_compile.runtime import FastCarSession, RunStats
from fastcar_compile.runtime.decode import left_pad

L = 8


@pytest.fixture(scope="module")
def dense(zoo_model) -> FastCarSession:
    return FastCarSession(zoo_model("llama", "dynamo20"), frame_tokens=L, threads=1)


@pytest.fixture(scope="module")
def torch_llama():
    return zoo.build_model("llama")


def test_greedy_tokens_match_eager_pytorch(dense, torch_llama):
    """Every greedy token is the argmax of the eager model's logits over the same history."""
    prompts = [[5, 6, 7, 8], [9, 10]]
    res = dense.generate(prompts, 3)
    assert res.tokens.shape == (2, 3 * L)
    ids, mask = left_pad(prompts, 0)
    pad = (mask == 0).sum(1).tolist()
    steps = [ids] + [res.tokens[:, k: k + 1] for k in range(res.tokens.shape[1] - 1)]
    with torch.no_grad():
        ref = plain_logits(torch_llama, steps, pad=pad)
    ref_tok = np.stack([lg[:, -1].argmax(-1) for lg in ref], axis=1)
    np.testing.assert_array_equal(ref_tok, res.tokens)


def test_left_padded_rows_equal_rows_alone(dense):
    both = dense.generate([[1, 2, 3, 4, 5], [7, 8]], 2).tokens
    alone = dense.generate([[7, 8]], 2).tokens
    np.testing.assert_array_equal(both[1], alone[0])


def test_sampling_is_seeded(dense):
    a = dense.generate([[3, 4]], 2, do_sample=True, top_k=20, seed=7).tokens
    b = dense.generate([[3, 4]], 2, do_sample=True, top_k=20, seed=7).tokens
    c = dense.generate([[3, 4]], 2, do_sample=True, top_k=20, seed=8).tokens
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_cfg_combines_rows_as_vila_u(dense):
    """Guided logits are u + s (c - u) of the two rows, and both rows are fed the chosen token."""
    res = dense.generate([[1, 2, 3]], 2, cfg_scale=3.0, uncond_prompt_ids=[[4]], keep_logits=True)
    ids, mask = left_pad([[1, 2, 3], [4]], 0)
    st = dense.new_state(2, video_start=ids.shape[1])
    out = dense.step(st, ids, attention_mask=mask)
    c, u = out.logits[0, -1].astype(np.float64), out.logits[1, -1].astype(np.float64)
    np.testing.assert_allclose(res.logits[0, 0], u + 3.0 * (c - u), rtol=1e-5, atol=1e-4)
    assert res.tokens[0, 0] == int(np.argmax(u + 3.0 * (c - u)))
    out2 = dense.step(out.state, np.array([[res.tokens[0, 0]]] * 2))
    g2 = out2.logits[1, -1] + 3.0 * (out2.logits[0, -1] - out2.logits[1, -1])
    np.testing.assert_allclose(res.logits[0, 1], g2, rtol=1e-4, atol=1e-3)


def test_state_checks(dense, zoo_model):
    other = FastCarSession(zoo_model("gpt2", "dynamo20"), frame_tokens=L, threads=1)
    with pytest.raises(FastCarError, match="another model"):
        dense.step(other.new_state(1), np.array([[1]]))
    st = dense.new_state(1)
    st.arrays["past_key_values.0.key"] = st.arrays["past_key_values.0.key"].astype(np.float64)
    with pytest.raises(FastCarError, match="dtype"):
        dense.step(st, np.array([[1]]))
    st = dense.new_state(1)
    st.arrays["past_key_values.1.value"] = np.zeros((1, 2, 3, 16), np.float32)
    with pytest.raises(FastCarError, match="shape"):
        dense.step(st, np.array([[1]]))
    with pytest.raises(FastCarError, match="batch"):
        dense.step(dense.new_state(2), np.array([[1]]))
    with pytest.raises(FastCarError, match="dense model"):
        dense.generate([[1]], 1, threshold=0.0)
    with pytest.raises(FastCarError, match="uncond_prompt_ids"):
        dense.generate([[1]], 1, cfg_scale=2.0)
    with pytest.raises(FastCarError, match="frame size"):
        FastCarSession(dense.path, threads=1).generate([[1]], 1)


def test_callback_stop_and_interrupt(dense):
    seen = []

    def cb(frame, toks):
        seen.append((frame, toks.shape))
        return frame < 1  # stop after the second frame

    res = dense.generate([[1, 2]], 5, callback=cb)
    assert seen == [(0, (1, L)), (1, (1, L))]
    assert res.tokens.shape == (1, 2 * L) and res.stats.frames_done == 2

    def ctrl_c(frame, toks):
        raise KeyboardInterrupt

    res = dense.generate([[1, 2]], 5, callback=ctrl_c)
    assert res.stats.interrupted and res.tokens.shape == (1, L)
    full = dense.generate([[1, 2]], 5).tokens
    np.testing.assert_array_equal(res.tokens, full[:, :L])


def test_stats_json_roundtrip_and_report(dense, tmp_path):
    from fastcar_compile.cli import main

    res = dense.generate([[1, 2]], 3, trace=str(tmp_path / "run.json"))
    st = res.stats
    assert len(st.step_ms) == 3 * L - 1 and len(st.frame_ms) == 3
    assert [s["pos"] for s in st.steps] == list(range(2, 2 + 3 * L - 1))
    back = RunStats.from_json((tmp_path / "run.json").read_text())
    assert back.to_dict() == json.loads(st.to_json())
    assert main(["report", str(tmp_path / "run.json")]) == 0
    assert (tmp_path / "run.latency.png").stat().st_size > 1000
    (tmp_path / "bad.json").write_text("[1]")
    assert main(["report", str(tmp_path / "bad.json")]) == 2


def test_memory_report(dense):
    n = dense.state_nbytes(2)
    # llama zoo model: 2 layers x (K + V) x 2 kv heads x 16 dims x float32, per row
    assert n == {"fastcar_state": 0, "kv_per_token": 2 * 2 * 2 * 2 * 16 * 4}
    assert "KiB per token" in dense.describe_memory(2, 100)
