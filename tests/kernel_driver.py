"""Drive CompressedAttention's native kernel (the code under test) over a q/k/v trace, for tests that compare it
with the NumPy reference fastcar_compile/fastar (run_trace) on the same trace."""

from __future__ import annotations

import numpy as np
from test_compressed_attention import session

from fastcar_compile.fastar.config import KVCompressConfig
from fastcar_compile.fastar.rope import apply_rope
from fastcar_compile.passes.fused_attention import compressed_attributes, slot_width


def run_kernel(cfg: KVCompressConfig, q, k, v, chunks: list[int], stats: list | None = None,
               pads: list[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Feed pre-RoPE q [T, Hq, D], k / v [T, Hkv, D] through the native op in steps of `chunks` tokens (batch 1,
    no padding); returns the outputs [T, Hq, D] and the final slot records [Hkv, C, F]. With `stats` (a list),
    the op also runs dense attention on the side (diagnostics) and each step's kv_stats [Hkv, 4] are appended
    to it. With `pads` (left pads per row), q / k / v are [B, T, ., D], a row's real tokens sit at positions
    0.. (its pads at 0, masked, as HF's) and the results keep the batch axis ([B, T, Hq, D], [B, Hkv, C, F],
    stats [B, Hkv, 4]). Skips where the native kernels are not built."""
    batched = pads is not None
    if not batched:
        q, k, v, pads = q[None], k[None], v[None], [0]
    B, T, hq, d = q.shape
    hkv = k.shape[2]
    mask = np.ones((B, T), np.int64)
    q_post, k_post = np.zeros_like(q), np.zeros_like(k)
    for b, n in enumerate(pads):
        mask[b, :n] = 0
        pos = np.maximum(np.arange(T) - n, 0)
        q_post[b] = np.swapaxes(apply_rope(np.swapaxes(q[b], 0, 1), pos), 0, 1)
        k_post[b] = np.swapaxes(apply_rope(np.swapaxes(k[b], 0, 1), pos), 0, 1)
    tempcache = cfg.tempcache_sim is not None or stats is not None  # (diagnostics wire the raw keys too)
    prune = cfg.prune_prompt is not None or cfg.tempcache_sim is not None  # video_start (input 11) is fed
    attrs = {**compressed_attributes(cfg, d), "num_heads": hq, "kv_num_heads": hkv, "scale": 1 / np.sqrt(d)}
    sess = session(True, n_in=12 if prune else 11 if stats is not None else 10 if tempcache else 8,
                   n_out=8 if stats is not None else 6 if tempcache else 5, **attrs)
    C, F = cfg.budget, slot_width(cfg)
    state = {"past_key": np.zeros((B, hkv, C, d), np.float32), "past_value": np.zeros((B, hkv, C, d), np.float32),
             "past_slots": np.zeros((B, hkv, C, F), np.float32)}
    empty = np.zeros((0, 0, 0, 0), np.float32)  # an unused optional input before video_start (as the compiler's)
    if tempcache:
        state["past_key_raw"] = np.zeros((B, hkv, C, d), np.float32)
    elif prune:
        state["past_key_raw"] = empty
    if stats is not None:
        state["past_dense"] = np.zeros((B, hkv, T, 2 * d), np.float32)
    elif prune:
        state["past_dense"] = empty
    outs, p = [], 0
    for n in chunks:
        sl = slice(p, p + n)

        def bhsd(x, sl=sl):
            return np.ascontiguousarray(np.swapaxes(x[:, sl], 1, 2), dtype=np.float32)

        feeds = {"q": bhsd(q_post), "k": bhsd(k_post), "v": bhsd(v), "attention_mask": mask[:, : p + n],
                 "total_len": np.array(p + n, np.int32), **state}
        if tempcache:
            feeds["k_raw"] = bhsd(k)
        elif prune:
            feeds["k_raw"] = empty
        if prune:
            feeds["video_start"] = np.array(cfg.video_start, np.int64)
        res = sess.run(None, feeds)
        outs.append(res[0].reshape(B, n, hq, d))
        state["past_key"], state["past_value"], state["past_slots"] = res[1], res[2], res[3]
        if tempcache:
            state["past_key_raw"] = res[5]
        if stats is not None:
            state["past_dense"] = res[6]
            stats.append(res[7] if batched else res[7][0])
        p += n
    got, slots = np.concatenate(outs, axis=1), state["past_slots"]
    return (got, slots) if batched else (got[0], slots[0])
