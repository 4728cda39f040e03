"""The attention primitives of the FAST-AR DiT runtime, in PyTorch: bucket joins and attention over gathered
(query, key) pairs, merged with dense blocks by their softmax statistics.

Why pairs: AnnSA's selection differs per query, head and row, so a padded batch would compute (and mask)
the dense product. Here only the selected pairs are gathered and multiplied; a softmax `Part` carries
(row max, sum of exp, weighted value sum) per query, so a dense block (sinks, local frames, the chunk itself)
and a sparse one combine exactly into one softmax (the log-sum-exp merge).
Bucket codes come from the NumPy hashers of fastcar_compile.fastar (one definition of a bucket).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastcar_compile.fastar.buckets import Buckets
from fastcar_compile.fastar.int8 import Int8Buckets
from fastcar_compile.fastar.lsh import SignLSH

CODE_SPAN = 1 << 16  # bucket ids are below this (lsh bits <= 16, int8 tables: 8 bits): group * SPAN + code is unique


def make_hasher(kind: str, dim: int, bits: int, dirs: int, tables: int, seed: int) -> Buckets:
    """'lsh' (sign bits) or 'quant' (int8-quantised directions): fastar's reference bucketings."""
    return SignLSH(dim, bits, tables, seed) if kind == "lsh" else Int8Buckets(dim, dirs, tables, seed)


def codes(hasher: Buckets, x: torch.Tensor) -> torch.Tensor:
    """Bucket ids [..., tables] of x [..., d] (computed in float64 by the reference hasher)."""
    return torch.from_numpy(hasher.codes(x.detach().double().numpy()))


def bucket_join(q_group: torch.Tensor, q_codes: torch.Tensor, k_group: torch.Tensor, k_codes: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Unique pairs (qi, ki) with equal group and an equal code in at least one table, found by sorting the
    keys per table and looking each query's bucket up (no query x key product). q_codes [Nq, T], k_codes [Nk, T]."""
    qs, ks = [], []
    nk = k_group.numel()
    for t in range(q_codes.shape[1]):
        kkey = k_group * CODE_SPAN + k_codes[:, t]
        skey, order = torch.sort(kkey)
        qkey = q_group * CODE_SPAN + q_codes[:, t]
        lo = torch.searchsorted(skey, qkey, right=False)
        n = torch.searchsorted(skey, qkey, right=True) - lo
        qi = torch.repeat_interleave(torch.arange(qkey.numel()), n)
        first = torch.cumsum(n, 0) - n
        ki = order[lo[qi] + torch.arange(qi.numel()) - first[qi]]
        qs.append(qi)
        ks.append(ki)
    pair = torch.unique(torch.cat(qs) * max(nk, 1) + torch.cat(ks))
    return pair // max(nk, 1), pair % max(nk, 1)


@dataclass
class Part:
    """A piece of one softmax per query: m = max logit, s = sum exp(l - m), o = sum exp(l - m) v."""

    m: torch.Tensor  # [N]
    s: torch.Tensor  # [N]
    o: torch.Tensor  # [N, d]


def dense_part(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None = None) -> Part:
    """q [G, Q, d] over k, v [G, K, d]; bias [G, K] (log count; -inf = not there). Flattened to [G*Q]."""
    logits = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if bias is not None:
        logits = logits + bias[:, None, :]
    m = logits.amax(-1)
    safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(logits - safe[..., None])
    return Part(safe.flatten(), e.sum(-1).flatten(), (e @ v).flatten(0, 1))


def pair_logits(q: torch.Tensor, k: torch.Tensor, qi: torch.Tensor, ki: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """q[qi] . k[ki] / sqrt(d) (+ bias[ki]) for each pair: the only products computed."""
    lg = (q.index_select(0, qi) * k.index_select(0, ki)).sum(-1) * q.shape[-1] ** -0.5
    return lg if bias is None else lg + bias.index_select(0, ki)


def pair_part(logits: torch.Tensor, v: torch.Tensor, qi: torch.Tensor, ki: torch.Tensor, nq: int) -> Part:
    """Segment softmax pieces of pairs (qi, ki) with their logits: per query qi in [0, nq)."""
    m = torch.full((nq,), -torch.inf, dtype=logits.dtype).scatter_reduce(0, qi, logits, "amax")
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(logits - m.index_select(0, qi))
    s = torch.zeros(nq, dtype=logits.dtype).index_add_(0, qi, e)
    o = torch.zeros(nq, v.shape[-1], dtype=v.dtype).index_add_(0, qi, v.index_select(0, ki) * e[:, None])
    return Part(m, s, o)


def combine(parts: list[Part]) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """One softmax from its pieces: (output [N, d] (0 where no key at all), log-sum-exp [N], per-part scale
    exp(m_i - M) / S that turns a part's exp(l - m_i) into probabilities)."""
    ms = [torch.where(p.s > 0, p.m, torch.full_like(p.m, -torch.inf)) for p in parts]  # an empty piece: none
    m = torch.stack(ms).amax(0)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    scales = [torch.exp(mi - m) for mi in ms]
    s = sum(sc * p.s for sc, p in zip(scales, parts, strict=True))
    o = sum(sc[:, None] * p.o for sc, p in zip(scales, parts, strict=True))
    den = torch.where(s > 0, s, torch.ones_like(s))
    return o / den[:, None], m + torch.log(den), [sc / den for sc in scales]
