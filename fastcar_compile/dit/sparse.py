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

import ctypes
from dataclasses import dataclass

import torch

from fastcar_compile.fastar.buckets import Buckets
from fastcar_compile.fastar.config import make_hasher  # noqa: F401 - the bucketings, re-exported for this runtime

CODE_SPAN = 1 << 16  # bucket ids are below this (lsh bits <= 16, int8 tables: 8 bits): group * SPAN + code is unique


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
    bucket by bucket: the keys and the queries of each occupied (table, group, bucket) are gathered into a
    block, and the blocks of every table whose key counts are within 2x are multiplied as one batched matmul
    (block-sparse: a key is gathered once per table, not once per pair; a skewed bucket pads its own class only;
    one loop over the few size classes, no loop over tables or buckets). A pair that already met in an earlier
    table is masked, so each executed pair counts once. Returns (one Part per table, pairs executed)."""
    nq, d = q.shape
    tables = q_codes.shape[1]
    if k.shape[0] == 0 or nq == 0:
        return [], 0
    tab = torch.arange(tables)
    groups = int(max(k_group.max(), q_group.max())) + 1
    # one id per (table, group, bucket): keys and queries of every table in one space
    kkey = ((tab[None] * groups + k_group[:, None]) * CODE_SPAN + k_codes).flatten()
    ukey, kb = torch.unique(kkey, return_inverse=True)  # kb: bucket of key (i // tables) in table i % tables
    nb = ukey.numel()
    qkey = ((tab[None] * groups + q_group[:, None]) * CODE_SPAN + q_codes).flatten()
    qb = torch.searchsorted(ukey, qkey).clamp(max=nb - 1)
    hit = torch.nonzero(ukey[qb] == qkey).flatten()  # (query, table) entries whose bucket holds keys
    if hit.numel() == 0:
        return [], 0
    qb = qb[hit]
    kcount = torch.bincount(kb, minlength=nb)
    qcount = torch.bincount(qb, minlength=nb)
    cls = torch.where(qcount > 0, _size_class(kcount), -1)
    b_table = ukey // CODE_SPAN // groups
    mm, ss = torch.zeros(tables * nq), torch.zeros(tables * nq)
    oo = torch.zeros(tables * nq, v.shape[-1])
    executed = 0
    kent = torch.arange(kb.numel())
    for c in torch.unique(cls[cls >= 0]).tolist():
        members = torch.nonzero(cls == c).flatten()
        local = torch.full((nb,), -1, dtype=torch.int64)
        local[members] = torch.arange(members.numel())
        kin = kent[local[kb] >= 0]
        qin = hit[local[qb] >= 0]
        kpad = _by_bucket(local[kb[kin]], members.numel())
        qpad = _by_bucket(local[qb[local[qb] >= 0]], members.numel())
        kpad = torch.where(kpad >= 0, kin[kpad.clamp(min=0)], -1)  # (key, table) entries
        qpad = torch.where(qpad >= 0, qin[qpad.clamp(min=0)], -1)  # (query, table) entries
        kc, qc = kpad.clamp(min=0) // tables, qpad.clamp(min=0) // tables  # key / query rows
        logits = q[qc] @ k[kc].transpose(1, 2) * d ** -0.5 + bias[kc][:, None, :]
        ok = (kpad >= 0)[:, None, :] & (qpad >= 0)[:, :, None]
        if tables > 1:  # met in an earlier table: counted there
            bt = b_table[members][:, None, None]
            for u in range(tables - 1):
                ok &= (bt <= u) | (q_codes[qc, u][:, :, None] != k_codes[kc, u][:, None, :])
        logits = torch.where(ok, logits, torch.full_like(logits, -torch.inf))
        executed += int(ok.sum())
        m = logits.amax(-1)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        e = torch.exp(logits - m[..., None])
        rows = qpad >= 0
        ent = qpad[rows]
        idx = (ent % tables) * nq + ent // tables
        mm[idx], ss[idx], oo[idx] = m[rows], e.sum(-1)[rows], (e @ v[kc])[rows]
    return [Part(mm[t * nq:(t + 1) * nq], ss[t * nq:(t + 1) * nq], oo[t * nq:(t + 1) * nq]) for t in range(tables)], \
        executed


_NATIVE: dict[str, object] = {}  # "fn": the C entry point, or "off": why not (looked up once per process)


def _native_fn():
    """FastcarAnnSAGroups of the native ai.fastcar library (runtime/native/bucket_attention.h), None without it."""
    if "fn" not in _NATIVE and "off" not in _NATIVE:
        from fastcar_compile.runtime.native import library_path

        lib = library_path()
        if lib is None:
            _NATIVE["off"] = True
        else:
            fn = ctypes.CDLL(str(lib)).FastcarAnnSAGroups
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_void_p] * 11 + [ctypes.c_int64] * 6
            _NATIVE["fn"] = fn
    return _NATIVE.get("fn")


def native_annsa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past_k: torch.Tensor, past_v: torch.Tensor,
                 bias: torch.Tensor, dense: torch.Tensor, q_codes: torch.Tensor, k_codes: torch.Tensor
                 ) -> tuple[torch.Tensor, int] | None:
    """AnnSA in the native kernel (each bucket's queries x its slots as dense blocks) and the q.k pairs it computed
    (each once), or None where it cannot run (no native library, or tensors off the CPU). Per group g: query i of
    q [G, Q, d] (scaled) attends to the chunk's k, v [G, Q, d], to the slots p of past_k / past_v [G, S, d] with
    dense[g, p] and to the slots sharing a bucket id with it in some table (k_codes [G, S, T] >= 0, q_codes
    [G, Q, T]); a slot's logit takes bias[g, p] (-inf: no slot). The same attention as dense_part + bucket_parts +
    combine."""
    fn = _native_fn()
    if fn is None or any(t.device.type != "cpu" for t in (q, past_k)):
        return None
    G, Q, d = q.shape
    S, T = past_k.shape[1], q_codes.shape[-1]
    ts = [q.float().contiguous(), k.float().contiguous(), v.float().contiguous(), past_k.float().contiguous(),
          past_v.float().contiguous(), bias.float().contiguous(), dense.to(torch.uint8).contiguous(),
          q_codes.long().contiguous(), k_codes.long().contiguous()]
    out = torch.empty(G, Q, d)
    executed = torch.zeros(G, dtype=torch.int64)
    if fn(*(t.data_ptr() for t in ts), out.data_ptr(), executed.data_ptr(), G, Q, d, S, T,
          torch.get_num_threads()) != 0:
        raise RuntimeError("the native AnnSA kernel failed")
    return out, int(executed.sum())
