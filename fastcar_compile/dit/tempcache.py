"""TempCache compiled into a DiT step graph: the merge a written frame makes on the runtime's ring buffers
(stream.RingCache), for each correspondence ('aligned', 'lsh', 'quant'; config.MODES_KEY records which).

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

from fastcar_compile.core.errors import FastCarError
from fastcar_compile.core.options import TEMPCACHE_MATCHES
from fastcar_compile.dit.modes import bucket_hasher, bucket_record
from fastcar_compile.fastar.buckets import Buckets


def record(match: str | None, values: dict) -> dict:
    """What the metadata (config.MODES_KEY) records of the correspondence (None: TempCache off): its name and,
    for a bucketed match, its buckets (dit/modes.bucket_record, from the compile's --lsh-bits, --quant-dirs,
    --ann-tables, --ann-seed) that the runtime redraws."""
    return {"tempcache_match": match,
            "tempcache_buckets": None if match in (None, "aligned") else bucket_record(match, values)}


def hasher(modes: dict, head_dim: int) -> Buckets | None:
    """The bucketing a compiled graph's metadata names (None: 'aligned', or a graph from before the record)."""
    match = modes.get("tempcache_match") or "aligned"
    if match not in TEMPCACHE_MATCHES:
        raise FastCarError(f"the step graph's metadata names TempCache match {match!r}, not one of "
                           f"{', '.join(TEMPCACHE_MATCHES)}; compile it again")
    return None if match == "aligned" else bucket_hasher(modes["tempcache_buckets"], head_dim)


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
    cos = _unit(k_pre) @ np.swapaxes(_unit(prev_pre), -1, -2)  # [..., T new, T prev]
    share = (codes[..., :, None, :] == prev_codes[..., None, :, :]).any(-1) & live[..., None, :]
    cos = np.where(share, cos, -np.inf)
    t = cos.shape[-1]
    pick = t - 1 - np.argmax(cos[..., ::-1], axis=-1)  # the last position at the maximum
    best = np.take_along_axis(cos, pick[..., None], -1)[..., 0]
    return np.where(best > sim, pick, -1)


def merge(target: np.ndarray, prev_value: np.ndarray, prev_count: np.ndarray, value: np.ndarray
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A frame's write given its targets [..., T]: (values [..., T, d] and counts [..., T] of the new frame's
    positions, the previous frame's counts after it). A slot joined by tokens S moves to the position of the
    last one with count c + |S| and value (c v + sum_S v_s) / (c + |S|); the other positions of S and the
    slot's old position get count 0."""
    lead, t, d = value.shape[:-2], value.shape[-2], value.shape[-1]
    g = int(np.prod(lead))
    tgt, v = target.reshape(g, t), value.reshape(g, t, d)
    pv, pc = prev_value.reshape(g, t, d), prev_count.reshape(g, t)
    gi, si = np.nonzero(tgt >= 0)
    flat = gi * t + tgt[gi, si]
    add = np.bincount(flat, minlength=g * t).reshape(g, t)
    vsum = np.zeros((g * t, d), np.float64)
    np.add.at(vsum, flat, v[gi, si])
    last = np.full(g * t, -1)
    np.maximum.at(last, flat, si)
    count = np.where(tgt >= 0, 0, 1).astype(pc.dtype)
    out = v.copy()
    hg, hp = np.nonzero(add > 0)
    hs = last[hg * t + hp]
    c = pc[hg, hp].astype(np.float32)
    n = add[hg, hp]
    out[hg, hs] = ((pv[hg, hp] * c[:, None] + vsum[hg * t + hp].astype(np.float32)) / (c + n)[:, None])
    count[hg, hs] = pc[hg, hp] + n
    left = np.where(add > 0, 0, pc)
    return out.reshape(value.shape), count.reshape(target.shape), left.reshape(prev_count.shape)
