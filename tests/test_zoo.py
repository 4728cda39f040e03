"""Checks of the test infrastructure itself: the zoo's ONNX graphs and the eager FastCar reference.

The reference is what the compiler is judged against, so it is checked here against things it does not share
code with: the plain transformers model, a NumPy computation of TAS, and counting arguments.
"""

from __future__ import annotations

import math

import numpy as np
import ort_driver
import pytest
import zoo
from reference import FastCarReference, plain_logits

RNG_SEED = 7
FAST_COMBOS = [
    ("llama", "dynamo20"),
    ("qwen2", "torchscript17"),
    ("phi3", "ortfusions20"),
    ("gpt2", "dynamo18"),
]
ALL_COMBOS = [(f, e) for f in zoo.FAMILIES for e in zoo.EXPORTERS]


def _steps(batch: int, prompt: int, decode: int, seed: int = RNG_SEED) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, zoo.VOCAB, (batch, prompt))] + [
        rng.integers(0, zoo.VOCAB, (batch, 1)) for _ in range(decode)
    ]


def _check_export_matches_torch(zoo_model, family: str, exporter: str, pad: list[int] | None = None) -> None:
    path = zoo_model(family, exporter)
    steps = _steps(2, 5, 4) + [np.random.default_rng(1).integers(0, zoo.VOCAB, (2, 3))]
    pad = [0, 2] if pad is None else pad
    want = plain_logits(zoo.build_model(family), steps, pad)
    got = ort_driver.decode(path, steps, pad=pad).logits
    # Prompt: compare only real tokens (padded query rows are don't-care).
    assert np.abs(got[0][0] - want[0][0]).max() <= 1e-4
    assert np.abs(got[0][1, pad[1] :] - want[0][1, pad[1] :]).max() <= 1e-4
    for g, w in zip(got[1:], want[1:], strict=True):
        assert np.abs(g - w).max() <= 1e-4


@pytest.mark.parametrize("family,exporter", FAST_COMBOS, ids=[f"{f}-{e}" for f, e in FAST_COMBOS])
def test_export_matches_torch(zoo_model, family, exporter):
    """The exported graph is the model: same logits over a left-padded batch-2 decode with KV carried."""
    _check_export_matches_torch(zoo_model, family, exporter)


@pytest.mark.slow
@pytest.mark.parametrize("family,exporter", ALL_COMBOS, ids=[f"{f}-{e}" for f, e in ALL_COMBOS])
def test_export_matches_torch_all(zoo_model, family, exporter):
    _check_export_matches_torch(zoo_model, family, exporter)


@pytest.mark.parametrize("family", zoo.FAMILIES)
def test_reference_at_inf_is_plain_model(family):
    """tau = +inf never replays, so the hooked model equals the unmodified one."""
    model = zoo.build_model(family)
    with FastCarReference(model, frame_tokens=4, threshold=math.inf, tas_query="raw") as ref:
        run = ref.run(_steps(2, 5, 0), pad=[0, 2], greedy=10)
    assert not any(r.any() for rs in run.replay.values() for r in rs)
    want = plain_logits(model, run.steps, pad=[0, 2])
    for g, w in zip(run.logits[1:], want[1:], strict=True):
        np.testing.assert_array_equal(g, w)
    # The TAS is computed at every token with an aligned key, even when nothing replays.
    assert np.isfinite(run.tas[0][-1]).all()


@pytest.mark.parametrize("video_start", [0, 3])
def test_replay_ceiling_frame0_never_replays(video_start):
    """tau = -inf replays every eligible token: exactly the decode tokens at p >= video_start + L."""
    L, frames = 4, 4
    model = zoo.build_model("llama")
    prompt = video_start + 1  # prompt text, then the first video token
    n_decode = video_start + frames * L - prompt
    with FastCarReference(model, frame_tokens=L, threshold=-math.inf, video_start=video_start) as ref:
        run = ref.run(_steps(1, prompt, n_decode))
    for layer in ref.layers:
        dec = np.concatenate(run.replay[layer][1:], axis=1)[0]
        positions = np.arange(prompt, prompt + n_decode)
        np.testing.assert_array_equal(dec, positions >= video_start + L)
        assert not run.replay[layer][0].any()  # prefill never replays
        ratio = dec.mean()
        assert ratio == pytest.approx((frames - 1) * L / n_decode)


def test_drift_guard_pattern():
    """max_replay K: a slot replays K frames in a row, then is recomputed (age resets to 0)."""
    L, K, frames = 3, 2, 7
    model = zoo.build_model("qwen2")
    with FastCarReference(model, frame_tokens=L, threshold=-math.inf, max_replay=K) as ref:
        run = ref.run(_steps(1, L, (frames - 1) * L))  # prompt = frame 0 (written by the multi-token step)
        ages = ref.mlp_age[0][0].tolist()
    dec = np.concatenate(run.replay[1][1:], axis=1)[0].reshape(frames - 1, L)
    # Frames 1.. : replay, replay, compute, replay, replay, compute
    want = np.array([[(f % (K + 1)) != K] * L for f in range(frames - 1)])
    np.testing.assert_array_equal(dec, want)
    assert ages == [(frames - 1) % (K + 1)] * L


def test_batch_rows_decide_independently():
    """Per-row decisions: a batch-2 run equals the two rows run alone, and the rows differ somewhere."""
    model = zoo.build_model("llama")
    steps = _steps(2, 4, 12)
    kw = dict(frame_tokens=4, threshold=0.0, max_replay=2)
    with FastCarReference(model, **kw) as ref:
        both = ref.run(steps)
        rows = [ref.run([s[b : b + 1] for s in steps]) for b in range(2)]
    for layer in ref.layers:
        for k in range(len(steps)):
            for b in range(2):
                np.testing.assert_array_equal(both.replay[layer][k][b], rows[b].replay[layer][k][0])
                np.testing.assert_allclose(both.tas[layer][k][b], rows[b].tas[layer][k][0], atol=1e-5)
    for k in range(len(steps)):
        for b in range(2):
            np.testing.assert_allclose(both.logits[k][b], rows[b].logits[k][0], atol=1e-4)
    dec = np.concatenate([np.concatenate(both.replay[i][1:], 1) for i in ref.layers], 1)
    assert (dec[0] != dec[1]).any() and dec.any() and not dec.all()


def _np_rope(x: np.ndarray, pos: int, theta: float) -> np.ndarray:
    d = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    ang = np.concatenate([pos * inv, pos * inv])
    rot = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], axis=-1)
    return x * np.cos(ang) + rot * np.sin(ang)


def _np_layer0_qk(model, family: str, ids: np.ndarray, positions: np.ndarray, rope: bool):
    """Layer 0 query/key per token, from the weights with NumPy: [S, H, D], [S, Hkv, D]."""
    info = zoo.model_info(family)
    H, Hkv, D = info.num_heads, info.num_kv_heads, info.head_dim
    sd = {k: v.detach().double().numpy() for k, v in model.state_dict().items()}
    if family == "gpt2":
        h = sd["transformer.wte.weight"][ids] + sd["transformer.wpe.weight"][positions]
        mu, var = h.mean(-1, keepdims=True), h.var(-1, keepdims=True)
        eps = model.config.layer_norm_epsilon
        x = (h - mu) / np.sqrt(var + eps) * sd["transformer.h.0.ln_1.weight"] + sd[
            "transformer.h.0.ln_1.bias"
        ]
        qkv = x @ sd["transformer.h.0.attn.c_attn.weight"] + sd["transformer.h.0.attn.c_attn.bias"]
        q, k = qkv[:, : H * D], qkv[:, H * D : 2 * H * D]
    else:
        h = sd["model.embed_tokens.weight"][ids]
        x = h / np.sqrt((h * h).mean(-1, keepdims=True) + model.config.rms_norm_eps)
        x = x * sd["model.layers.0.input_layernorm.weight"]
        pre = "model.layers.0.self_attn."
        if family == "phi3":  # fused projection, rows [q | k | v]
            qkv = x @ sd[pre + "qkv_proj.weight"].T
            q, k = qkv[:, : H * D], qkv[:, H * D : (H + Hkv) * D]
        else:
            q = x @ sd[pre + "q_proj.weight"].T + sd.get(pre + "q_proj.bias", 0.0)
            k = x @ sd[pre + "k_proj.weight"].T + sd.get(pre + "k_proj.bias", 0.0)
    q, k = q.reshape(-1, H, D), k.reshape(-1, Hkv, D)
    if family != "gpt2":
        theta = float(model.config.rope_parameters["rope_theta"])
        k = np.stack([_np_rope(k[s], positions[s], theta) for s in range(len(ids))])
        if rope:
            q = np.stack([_np_rope(q[s], positions[s], theta) for s in range(len(ids))])
    return q, k


@pytest.mark.parametrize(
    "family,tas_query",
    [("llama", "rope"), ("llama", "raw"), ("qwen2", "rope"), ("phi3", "rope"), ("gpt2", "raw")],
)
def test_tas_matches_numpy(family, tas_query):
    """TAS of one decode token at layer 0, computed by hand with NumPy, equals the reference's."""
    L = 3
    model = zoo.build_model(family)
    steps = _steps(1, L + 2, 1)
    with FastCarReference(model, frame_tokens=L, threshold=0.0, tas_query=tas_query) as ref:
        run = ref.run(steps)
    ids = np.concatenate([s[0] for s in steps])
    pos = np.arange(len(ids))
    q, k = _np_layer0_qk(model, family, ids, pos, rope=tas_query == "rope")
    info = zoo.model_info(family)
    g = info.num_heads // info.num_kv_heads
    p = len(ids) - 1
    want = np.mean([q[p, h] @ k[p - L, h // g] for h in range(info.num_heads)]) / math.sqrt(info.head_dim)
    assert run.tas[0][-1][0, 0] == pytest.approx(want, abs=1e-5)
    # In the prompt, a token with p - L >= 0 has a TAS too; the first L have none.
    want_prompt = [
        np.mean([q[j, h] @ k[j - L, h // g] for h in range(info.num_heads)]) / math.sqrt(info.head_dim)
        for j in range(L, L + 2)
    ]
    np.testing.assert_allclose(run.tas[0][0][0, L:], want_prompt, atol=1e-5)
    assert np.isnan(run.tas[0][0][0, :L]).all()
    assert abs(want) > 1e-2  # the weights spread the logits: a zero TAS would test nothing
