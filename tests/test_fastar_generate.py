"""Generation on the FAST-AR reference path (fastcar_compile/fastar/generate.py) against eager PyTorch.

Dense configs must reproduce transformers' own eager attention (logits and greedy tokens); a sinks + window
cache must equal an independent masked attention written here (keys j < S or j >= p - W visible).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")

from fastcar_compile.core.errors import FastCarError  # noqa: E402
from fastcar_compile.fastar.config import KVCompressConfig  # noqa: E402
from fastcar_compile.fastar.generate import ReferenceAttention, generate, reference_attention  # noqa: E402

VOCAB = 40


def _model(layers: int = 2, seed: int = 0):
    torch.manual_seed(seed)
    cfg = tf.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256, attention_bias=True,
                         tie_word_embeddings=False)
    cfg._attn_implementation = "eager"
    m = tf.LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():  # larger weights: sharper attention, so a wrong mask shows in the logits
        for p in m.parameters():
            p.mul_(3.0)
    return m


def _eager_greedy(model, ids: list[int], new: int, mask_fn=None) -> tuple[np.ndarray, np.ndarray]:
    """Greedy tokens and the logits of every step by full re-forwards (no KV cache), optionally with an
    attention function masking keys (independent of the reference code)."""
    seq = list(ids)
    logits = []
    for _ in range(new):
        with torch.no_grad():
            out = model(input_ids=torch.tensor([seq])).logits[0, -1]
        logits.append(out.numpy())
        seq.append(int(out.argmax()))
    return np.array(seq[len(ids):]), np.stack(logits)


def test_dense_configs_equal_eager_transformers():
    model = _model()
    ids = [1, 5, 7, 9, 11, 2, 3]
    want, want_logits = _eager_greedy(model, ids, 12)
    got, ref = generate(model, ids, 12, [None, None], VOCAB, measure_from=0)
    np.testing.assert_array_equal(got, want)
    assert model.config._attn_implementation == "eager"  # restored after generation
    for s in ref.stats:
        assert s.summary()["density"] == 1.0 and s.summary()["recall"] == pytest.approx(1.0, abs=1e-9)
    # the logits themselves, step by step, through the reference path with a KV cache
    ref2 = ReferenceAttention([None, None], len(ids) + 12, 10000.0)
    with reference_attention(model, ref2), torch.no_grad():
        res = model(input_ids=torch.tensor([ids]), use_cache=True)
        np.testing.assert_allclose(res.logits[0, -1].numpy(), want_logits[0], atol=1e-4)
        past = res.past_key_values
        for t in range(1, 12):
            res = model(input_ids=torch.tensor([[int(want[t - 1])]]), past_key_values=past, use_cache=True)
            past = res.past_key_values
            np.testing.assert_allclose(res.logits[0, -1].numpy(), want_logits[t], atol=1e-4)


def _local_attention(sinks: int, window: int):
    def attn(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **_kw):
        g = query.shape[1] // key.shape[1]
        k = key.repeat_interleave(g, dim=1)
        v = value.repeat_interleave(g, dim=1)
        S, T = query.shape[2], key.shape[2]
        w = query @ k.transpose(2, 3) * scaling
        p = torch.arange(T - S, T)[:, None]
        j = torch.arange(T)[None, :]
        visible = (j <= p) & ((j < sinks) | (j >= p - window))
        w = w.masked_fill(~visible, float("-inf")).softmax(-1)
        return (w @ v).transpose(1, 2).contiguous(), None
    return attn


def test_window_cache_equals_masked_attention():
    """Budget S + W + 1 with oldest-first eviction keeps exactly sinks + the last W + 1 tokens."""
    model = _model(seed=1)
    sinks, window = 2, 5
    tf.AttentionInterface.register("test_local", _local_attention(sinks, window))
    ids = [3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    model.set_attn_implementation("test_local")
    try:
        want, local_logits = _eager_greedy(model, ids, 15)
    finally:
        model.set_attn_implementation("eager")
    _, dense_logits = _eager_greedy(model, ids, 1)
    assert np.abs(local_logits[0] - dense_logits[0]).max() > 1e-3  # the window matters on this model
    cfg = KVCompressConfig(budget=sinks + window + 1, sinks=sinks, window=window, eviction="oldest")
    got, ref = generate(model, ids, 15, [cfg, cfg], VOCAB, measure_from=len(ids))
    np.testing.assert_array_equal(got, want)
    st = ref.stats[0].summary()
    assert st["slots_last"] == sinks + window + 1
    # density hand-counted: query at position p reads min(p + 1, 8) of p + 1 keys, p = 10..23
    ps = np.arange(len(ids), len(ids) + 14)
    assert st["density"] == pytest.approx(np.minimum(ps + 1, 8).sum() / (ps + 1).sum())


def test_bad_use_is_named():
    model = _model(layers=1)
    with pytest.raises(FastCarError, match="one KV config"):
        generate(model, [1, 2], 3, [None, None], VOCAB)
