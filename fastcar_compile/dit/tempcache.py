"""TempCache's merge in PyTorch: one definition for every DiT runtime that writes a frame into a cache (the
compiled step graph's ring buffers: cache.RingCache; the eager FAST-AR runtime's slot lists:
fastar.SlotCache; the PyTorch DiT's compacted cache: torch/dit.ModeCache). The NumPy decoder cache
(fastar/cache.HeadCache, token by token) stays apart as the reference these are tested against, and the
compressed-attention kernel (runtime/native/compressed_attention.h) is the C++ one.

A frame of T new keys is matched against the candidates: the slots whose newest member belongs to the previous
frame (a merge makes the slot's newest member the joining token, so older slots are never candidates). The
caller gathers them, in its own order, as [..., C, d] with a live mask; `targets` picks each new key's slot:
- 'aligned' (no codes): candidate s for key s (the same (h, w) one frame back), if live;
- 'lsh' / 'int8' (codes per table): the best cosine among the live candidates sharing a bucket with the key in
  any table (ties: the later candidate); one [T, C] cosine product per row and head, a few groups at a time.
A merge needs the pre-RoPE cosine > SIM. `merge` then folds each frame into its slots: a slot joined by tokens
S gets count c + |S| and value (c v + sum_S v_s) / (c + |S|), and takes the newest key, the last of S in raster
order (tokens of one frame are matched against the cache as it was before the frame, so a frame is one
vectorised step; the reference appends token by token, which is the same wherever no two tokens pick one slot).
`merge_positional` is the form of the caches that keep a slot at its newest member's position: the slot moves
to the new frame's position and leaves a dead one (count 0) behind.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_PAIRS = 1 << 22  # (new key, candidate) cosines computed at once: the [T, T] products of 1560-token frames add up


def cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row-wise cosine of a and b [..., d] (0 for a zero vector)."""
    den = a.norm(dim=-1) * b.norm(dim=-1)
    return torch.where(den > 0, (a * b).sum(-1) / torch.where(den > 0, den, torch.ones_like(den)),
                       torch.zeros_like(den))


def _unit(x: torch.Tensor) -> torch.Tensor:
    norm = x.norm(dim=-1, keepdim=True)
    return torch.where(norm > 0, x / torch.where(norm > 0, norm, torch.ones_like(norm)), torch.zeros_like(x))


def targets(k_pre: torch.Tensor, cand_pre: torch.Tensor, live: torch.Tensor, sim: float,
            codes: torch.Tensor | None = None, cand_codes: torch.Tensor | None = None) -> torch.Tensor:
    """[..., T] index among the candidates [..., C, d] (pre-RoPE keys, `live` [..., C]) that each new key
    [..., T, d] merges into, or -1 (module docstring). Without codes the aligned candidate (C == T); with codes
    [..., T, tables] and cand_codes [..., C, tables] the top-1 cosine in a shared bucket."""
    if codes is None:
        aligned = torch.arange(k_pre.shape[-2], device=k_pre.device)
        return torch.where(live & (cosine(k_pre, cand_pre) > sim), aligned, torch.full_like(aligned, -1))
    t, d = k_pre.shape[-2:]
    c = cand_pre.shape[-2]
    lead = k_pre.shape[:-2]
    # the candidates in reverse order, so that the first maximum found is the last candidate at the maximum
    k, prev = _unit(k_pre).reshape(-1, t, d), _unit(cand_pre).reshape(-1, c, d).flip(1)
    kc, pc = codes.reshape(-1, t, codes.shape[-1]), cand_codes.reshape(-1, c, codes.shape[-1]).flip(1)
    dead = ~live.reshape(-1, c).flip(1)
    out = torch.empty(k.shape[0], t, dtype=torch.int64, device=k.device)
    step = max(1, MAX_PAIRS // max(t * c, 1))  # rows x heads at a time
    for g in range(0, k.shape[0], step):
        sl = slice(g, g + step)
        cos = torch.bmm(k[sl], prev[sl].transpose(-1, -2))  # [groups, T new, C reversed]
        miss = kc[sl, :, None, 0] != pc[sl, None, :, 0]
        for i in range(1, kc.shape[-1]):  # (a table at a time: far faster than comparing all at once)
            miss &= kc[sl, :, None, i] != pc[sl, None, :, i]
        miss |= dead[sl, None, :]
        best, first = cos.masked_fill_(miss, -torch.inf).max(-1)
        out[sl] = torch.where(best > sim, c - 1 - first, torch.full_like(first, -1))
    return out.reshape(*lead, t)


@dataclass
class Merged:
    """One frame's merge over G = the leading dims flattened: per slot joined, its group, its candidate index,
    the last token joining it (its newest member), and its value and count after the merge."""

    group: torch.Tensor  # [n]
    slot: torch.Tensor  # [n]
    last: torch.Tensor  # [n]
    value: torch.Tensor  # [n, d]
    count: torch.Tensor  # [n]


def merge(target: torch.Tensor, cand_value: torch.Tensor, cand_count: torch.Tensor, value: torch.Tensor) -> Merged:
    """Fold the frame's values [..., T, d] into the candidates they target ([..., T], -1: none) whose values
    [..., C, d] and counts [..., C] are given: the merging tokens grouped by slot (a stable sort, then segment
    sums in token order), each slot's new count and running-mean value."""
    t, d = value.shape[-2:]
    c = cand_value.shape[-2]
    tgt, v = target.reshape(-1, t), value.reshape(-1, t, d)
    pv, pc = cand_value.reshape(-1, c, d), cand_count.reshape(-1, c)
    gi, si = torch.nonzero(tgt >= 0, as_tuple=True)
    flat = gi * c + tgt[gi, si]
    order = torch.argsort(flat, stable=True)
    flat, gi, si = flat[order], gi[order], si[order]
    new = torch.ones_like(flat, dtype=torch.bool)
    new[1:] = flat[1:] != flat[:-1]
    start = torch.nonzero(new, as_tuple=True)[0]
    seg = torch.cumsum(new, 0) - 1
    n = torch.bincount(seg, minlength=start.numel())
    vsum = torch.zeros(start.numel(), d, dtype=v.dtype, device=v.device).index_add_(0, seg, v[gi, si])
    hg, hp, hs = gi[start], flat[start] % c, si[start + n - 1]  # (token order within a slot: the last one)
    cnt = pc[hg, hp]
    cf = cnt.to(v.dtype)[:, None]
    return Merged(hg, hp, hs, (pv[hg, hp] * cf + vsum) / (cf + n[:, None]), cnt + n)


def merge_positional(target: torch.Tensor, prev_value: torch.Tensor, prev_count: torch.Tensor,
                     value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A frame's write into a positional cache, the candidates being the previous frame's T positions: (values
    [..., T, d] and counts [..., T] of the new frame's positions, the previous frame's counts after it). A slot
    moves to the position of its newest member; the other positions of its joining tokens and its old position
    get count 0."""
    t = target.shape[-1]
    merged = target >= 0
    if bool((~merged | (target == torch.arange(t, device=target.device))).all()):  # aligned: one token per slot
        cf = prev_count[..., None].to(value.dtype)
        out = torch.where(merged[..., None], (prev_value * cf + value) / (cf + 1), value)
        one = torch.ones_like(prev_count)
        return out, torch.where(merged, prev_count + 1, one), torch.where(merged, torch.zeros_like(one), prev_count)
    m = merge(target, prev_value, prev_count, value)
    d = value.shape[-1]
    out = value.reshape(-1, t, d).clone()
    out[m.group, m.last] = m.value
    count = torch.where(target >= 0, 0, 1).to(prev_count.dtype).reshape(-1, t)
    count[m.group, m.last] = m.count.to(prev_count.dtype)
    left = prev_count.reshape(-1, t).clone()
    left[m.group, m.slot] = 0
    return out.reshape(value.shape), count.reshape(target.shape), left.reshape(prev_count.shape)
