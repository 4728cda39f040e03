"""The attention primitives of the FAST-AR DiT runtime, in PyTorch: bucket joins, block-sparse attention by
bucket, and softmax pieces merged by their statistics.

AnnSA's selection differs per query, head and row, so one padded batch would compute (and mask) the dense
product. Instead the keys and queries of each occupied bucket are gathered into a block and multiplied there
(`bucket_parts`); a softmax `Part` carries (row max, sum of exp, weighted value sum) per query, so the dense
blocks (sinks, local frames, the chunk itself) and the bucket blocks of each table combine exactly into one
softmax (the log-sum-exp merge).
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
    if k.shape[1] == 0:  # no key: an empty piece (combine gives 0 where every piece is empty)
        n = q.shape[0] * q.shape[1]
        return Part(torch.zeros(n), torch.zeros(n), torch.zeros(n, v.shape[-1]))
    logits = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if bias is not None:
        logits = logits + bias[:, None, :]
    m = logits.amax(-1)
    safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(logits - safe[..., None])
    return Part(safe.flatten(), e.sum(-1).flatten(), (e @ v).flatten(0, 1))


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


def _by_bucket(bucket: torch.Tensor, n_buckets: int) -> torch.Tensor:
    """[n_buckets, max members] indices of the items in each bucket (-1 = padding), items in order."""
    order = torch.argsort(bucket, stable=True)
    count = torch.bincount(bucket, minlength=n_buckets)
    start = torch.cumsum(count, 0) - count
    sb = bucket[order]
    pad = torch.full((n_buckets, int(count.max()) if count.numel() else 0), -1, dtype=torch.int64)
    pad[sb, torch.arange(order.numel()) - start[sb]] = order
    return pad


def _size_class(n: torch.Tensor) -> torch.Tensor:
    """ceil(log2(n)) (0 for n <= 1): buckets of one class differ at most 2x in size."""
    return torch.ceil(torch.log2(n.clamp(min=1).to(torch.float32))).to(torch.int64)


def bucket_parts(q: torch.Tensor, q_group: torch.Tensor, q_codes: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 bias: torch.Tensor, k_group: torch.Tensor, k_codes: torch.Tensor) -> tuple[list[Part], int]:
    """Attention pieces of queries q [Nq, d] over keys k, v [Nk, d] (bias [Nk]) that share a bucket, computed
    bucket by bucket: per table, the keys and the queries of each occupied (group, bucket) are gathered into a
    block, and blocks of similar size (within 2x in queries and in keys) are multiplied as one batched matmul
    (block-sparse: a key is gathered once per table, not once per pair, and skewed buckets pad only their own
    class). A pair that already met in an earlier table is masked, so each executed pair counts once.
    Returns (one Part per table, pairs executed)."""
    parts, executed = [], 0
    nq, d = q.shape
    for t in range(q_codes.shape[1]):
        kkey = k_group * CODE_SPAN + k_codes[:, t]
        ukey, kb = torch.unique(kkey, return_inverse=True)
        nb = ukey.numel()
        if nb == 0:
            continue
        qkey = q_group * CODE_SPAN + q_codes[:, t]
        qb = torch.searchsorted(ukey, qkey).clamp(max=nb - 1)
        qi = torch.nonzero(ukey[qb] == qkey).flatten()
        if qi.numel() == 0:
            continue
        qb = qb[qi]
        qcount = torch.bincount(qb, minlength=nb)
        cls = _size_class(qcount) * 64 + _size_class(torch.bincount(kb, minlength=nb))
        cls = torch.where(qcount > 0, cls, -1)
        mm, ss = torch.zeros(nq), torch.zeros(nq)
        oo = torch.zeros(nq, v.shape[-1])
        for c in torch.unique(cls[cls >= 0]).tolist():
            local = torch.full((nb,), -1, dtype=torch.int64)
            members = torch.nonzero(cls == c).flatten()
            local[members] = torch.arange(members.numel())
            kin = torch.nonzero(local[kb] >= 0).flatten()
            qin = torch.nonzero(local[qb] >= 0).flatten()
            kpad = _by_bucket(local[kb[kin]], members.numel())
            qpad = _by_bucket(local[qb[qin]], members.numel())
            kpad = torch.where(kpad >= 0, kin[kpad.clamp(min=0)], -1)
            qpad = torch.where(qpad >= 0, qi[qin[qpad.clamp(min=0)]], -1)
            kc, qc = kpad.clamp(min=0), qpad.clamp(min=0)
            logits = q[qc] @ k[kc].transpose(1, 2) * d ** -0.5 + bias[kc][:, None, :]
            ok = (kpad >= 0)[:, None, :] & (qpad >= 0)[:, :, None]
            for u in range(t):  # met in an earlier table: already counted there
                ok &= q_codes[qc, u][:, :, None] != k_codes[kc, u][:, None, :]
            logits = torch.where(ok, logits, torch.full_like(logits, -torch.inf))
            executed += int(ok.sum())
            m = logits.amax(-1)
            m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
            e = torch.exp(logits - m[..., None])
            rows = qpad >= 0
            idx = qpad[rows]
            mm[idx], ss[idx], oo[idx] = m[rows], e.sum(-1)[rows], (e @ v[kc])[rows]
        parts.append(Part(mm, ss, oo))
    return parts, executed
