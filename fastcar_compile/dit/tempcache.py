"""TempCache compiled into a DiT step graph: the merge a written frame makes on the runtime's ring buffers
(stream.RingCache), for each correspondence ('aligned', 'lsh', 'quant'; contract.DIT_MODES_KEY records which).

The graph is the same for all three (each slot's log(count) in as `past_bias.N`, the chunk's pre-RoPE keys out
as `present_pre.N.key`): which slot a key joins is decided here, in NumPy, when the runtime writes the clean
chunk, because every candidate sits in one place. A slot whose newest member is frame f-1 lives in frame f-1's
ring positions (a merge moves the slot to the new frame's positions), so the candidates of frame f's keys
are those T positions: 'aligned' compares position s with position s, 'lsh' / 'quant' take the top-1 cosine
among the live ones sharing a bucket with the key in any table (the eager runtime's
dit/fastar.SlotCache.ann_targets, and the paper's). That is one [T, T] cosine product per row, head, frame and
layer over a frame's tokens, done once per chunk rather than per denoising step; no search over the cache.

A merge: the slot's count grows by the tokens joining it, its value becomes the running mean, and it moves
to the position of the last of them (raster order, as the eager runtime keeps that token's key); the other
joining tokens' positions and the previous position are dead (count 0, logit -inf) until their frame leaves
the ring.
"""

from __future__ import annotations

import numpy as np

from fastcar_compile.core.contract import DiTModes
from fastcar_compile.fastar.buckets import Buckets
from fastcar_compile.fastar.config import hasher_of

MAX_PAIRS = 1 << 22  # (new key, previous slot) pairs the top-1 match holds at once


def hasher(modes: DiTModes, head_dim: int) -> Buckets | None:
    """The bucketing a compiled graph's modes name for TempCache's match (None: 'aligned')."""
    if modes.tempcache_match in (None, "aligned") or modes.tempcache_buckets is None:
        return None
    return hasher_of(modes.tempcache_buckets, head_dim)


def _unit(x: np.ndarray) -> np.ndarray:
    norm = np.linalg.norm(x, axis=-1, keepdims=True)
    return np.divide(x, norm, out=np.zeros_like(x), where=norm > 0)


def targets(k_pre: np.ndarray, prev_pre: np.ndarray, live: np.ndarray, sim: float, codes: np.ndarray | None = None,
            prev_codes: np.ndarray | None = None) -> np.ndarray:
    """[..., T] position among the previous frame's T slots that each new key (pre-RoPE, [..., T, d]) merges
    into, or -1. live [..., T]: the previous frame's positions holding a slot. Without codes the aligned slot
    (same position); with codes [..., T, tables] the best cosine among live slots sharing a bucket (ties: the
    later position). A merge needs the cosine > sim."""
    if codes is None:
        den = np.linalg.norm(k_pre, axis=-1) * np.linalg.norm(prev_pre, axis=-1)
        cos = np.where(den > 0, (k_pre * prev_pre).sum(-1) / np.where(den > 0, den, 1), 0)
        return np.where(live & (cos > sim), np.arange(k_pre.shape[-2]), -1)
    t, d = k_pre.shape[-2:]
    lead = k_pre.shape[:-2]
    k, prev = _unit(k_pre).reshape(-1, t, d), _unit(prev_pre).reshape(-1, t, d)
    c, pc, lv = codes.reshape(-1, t, codes.shape[-1]), prev_codes.reshape(-1, t, codes.shape[-1]), live.reshape(-1, t)
    out = np.empty((k.shape[0], t), np.int64)
    step = max(1, MAX_PAIRS // (t * t))  # rows x heads at a time: the [T, T] products of 1560-token frames add up
    for g in range(0, k.shape[0], step):
        sl = slice(g, g + step)
        cos = k[sl] @ np.swapaxes(prev[sl], -1, -2)  # [groups, T new, T prev]
        share = np.logical_or.reduce([c[sl, :, None, i] == pc[sl, None, :, i]
                                      for i in range(c.shape[-1])])  # (a table at a time: 15x faster than any)
        share &= lv[sl, None, :]
        cos = np.where(share, cos, -np.inf)
        pick = t - 1 - np.argmax(cos[..., ::-1], axis=-1)  # the last position at the maximum
        best = np.take_along_axis(cos, pick[..., None], -1)[..., 0]
        out[sl] = np.where(best > sim, pick, -1)
    return out.reshape(*lead, t)


def merge(target: np.ndarray, prev_value: np.ndarray, prev_count: np.ndarray, value: np.ndarray
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A frame's write given its targets [..., T]: (values [..., T, d] and counts [..., T] of the new frame's
    positions, the previous frame's counts after it). A slot joined by tokens S moves to the position of the
    last one with count c + |S| and value (c v + sum_S v_s) / (c + |S|); the other positions of S and the
    slot's old position get count 0."""
    t = target.shape[-1]
    merged = target >= 0
    if np.all(~merged | (target == np.arange(t))):  # one token per slot, at its own position (aligned)
        cf = prev_count[..., None].astype(np.float32)
        out = np.where(merged[..., None], (prev_value * cf + value) / (cf + 1), value)
        return out, np.where(merged, prev_count + 1, 1).astype(prev_count.dtype), np.where(merged, 0, prev_count)
    d = value.shape[-1]
    tgt, v = target.reshape(-1, t), value.reshape(-1, t, d)
    pv, pc = prev_value.reshape(-1, t, d), prev_count.reshape(-1, t)
    gi, si = np.nonzero(tgt >= 0)  # the merging tokens, grouped by the slot they join (sort + segment sums)
    flat = gi * t + tgt[gi, si]
    order = np.argsort(flat, kind="stable")
    flat, gi, si = flat[order], gi[order], si[order]
    start = np.flatnonzero(np.r_[True, flat[1:] != flat[:-1]])
    n = np.diff(np.r_[start, flat.size])
    vsum = np.add.reduceat(v[gi, si], start, axis=0)
    hg, hp, hs = gi[start], flat[start] % t, np.maximum.reduceat(si, start)
    c = pc[hg, hp]
    cf = c[:, None].astype(np.float32)
    out = v.copy()
    out[hg, hs] = (pv[hg, hp] * cf + vsum) / (cf + n[:, None])
    count = np.where(tgt >= 0, 0, 1).astype(pc.dtype)
    count[hg, hs] = c + n
    left = pc.copy()
    left[hg, hp] = 0
    return out.reshape(value.shape), count.reshape(target.shape), left.reshape(prev_count.shape)
