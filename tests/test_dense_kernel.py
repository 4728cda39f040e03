"""The native dense attention core (CompressedAttention plain mode, runtime/native/dense_attention.h) on the paths
its layout adds, against the independent NumPy attention of test_compressed_attention: key ranges split across
work items (contexts >= 512 at batch x KV heads below the core count, lengths not divisible by the split),
8-, 16- and (AVX-512 CPUs) 32-lane row chunks (G = 1, 2, 8, 16, 32; multi-token steps), head sizes 64, 80 and 96, one KV head, batch 2
with left padding (rows that see no key in one split, or in all of them), in a shared buffer longer than T."""

from __future__ import annotations

import numpy as np
import ort_driver
import pytest
from test_compressed_attention import reference, session

CASES = {  # name: (heads, kv heads, head dim, batch, past, step tokens, left pads per row)
    "decode 16/2x64 split": (16, 2, 64, 1, 1100, 1, [0]),
    "decode 8/1x64 split, pad across a split": (8, 1, 64, 2, 1300, 1, [0, 700]),
    "decode 2/1x80 split, pad": (2, 1, 80, 2, 777, 1, [0, 3]),
    "decode 3/3x96 (G=1)": (3, 3, 96, 2, 900, 1, [5, 0]),
    "decode 16/1x64 (16 lanes)": (16, 1, 64, 1, 700, 1, [0]),
    "decode row sees nothing": (8, 1, 64, 2, 600, 1, [0, 601]),
    "3 tokens 16/2x64 split": (16, 2, 64, 2, 800, 3, [0, 10]),
    "2 tokens 8/2x64 (16 lanes, causal lanes)": (8, 2, 64, 1, 530, 2, [0]),
    "37 tokens 4/2x80 tiles, pads into the step": (4, 2, 80, 2, 50, 37, [0, 60]),
    "5 tokens 8/1x64 (32 + 8 lanes)": (8, 1, 64, 2, 300, 5, [0, 2]),
    "decode 32/1x64 (32 lanes, split)": (32, 1, 64, 1, 600, 1, [0]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_dense_core_equals_numpy(name):
    """Outputs within 2e-5 of the float64 reference; present rows P..T-1 hold the new keys / values and the
    buffer's other rows are untouched (written in place semantics)."""
    hq, hkv, d, B, P, S, pad = CASES[name]
    rng = np.random.default_rng(sum(map(ord, name)))
    T, N = P + S, P + S + 5
    q = rng.standard_normal((B, hq, S, d)).astype(np.float32)
    k, v = (rng.standard_normal((B, hkv, S, d)).astype(np.float32) for _ in range(2))
    pk, pv = (rng.standard_normal((B, hkv, N, d)).astype(np.float32) for _ in range(2))
    mask, _ = ort_driver.left_pad_masks(pad, T)
    sess = session(True, num_heads=hq, kv_num_heads=hkv, scale=float(1 / np.sqrt(d)))
    out, pres_k, pres_v = sess.run(None, {"q": q, "k": k, "v": v, "past_key": pk, "past_value": pv,
                                          "attention_mask": mask, "total_len": np.array(T, np.int32)})
    want_k = np.concatenate([pk[:, :, :P], k, pk[:, :, T:]], axis=2)
    want_v = np.concatenate([pv[:, :, :P], v, pv[:, :, T:]], axis=2)
    np.testing.assert_array_equal(pres_k, want_k)
    np.testing.assert_array_equal(pres_v, want_v)
    want = reference(q.astype(np.float64), want_k.astype(np.float64), want_v.astype(np.float64), mask, P,
                     1 / np.sqrt(d))
    assert np.abs(out - want).max() <= 2e-5, np.abs(out - want).max()
