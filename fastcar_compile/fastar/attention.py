"""Decode attention over a compressed KV cache for a whole q/k/v trace, with dense attention on the side.

A trace is one layer's pre-RoPE queries [T, Hq, d], pre-RoPE keys [T, Hkv, d] and values [T, Hkv, d] for
positions 0..T-1; step p writes token p into every KV head's cache, then each query head attends (GQA: query
head h reads KV head h // (Hq / Hkv)). Metrics (docs/semantics.md section 3) over steps p >= measure_from:
- density: executed q.k pairs / dense pairs (p + 1 per query head and step);
- recall: overlap of the dense softmax with the compressed one mapped back to tokens, sum_t min(p_dense(t),
  p_slot(t) / count(slot(t))). For pure selection it is the dense mass on the attended keys (the paper's
  definition); for identical merged keys it is exactly 1 (the lemma); evicted tokens count 0;
- kept_mass: dense mass on tokens whose slot was attended (ignores how merging reshapes the distribution);
- out_err: ||o - o_dense|| / ||o_dense|| per query head and step (mean);
- KV bytes: resident slots x (key + value) at `bytes_per` bytes, plus an int32 count (TempCache) and the
  bit-packed LSH codes or int8 bucket bytes (AnnSA) per slot.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from fastcar_compile.core.errors import FastCarError
from fastcar_compile.fastar.cache import HeadCache, hasher
from fastcar_compile.fastar.config import KVCompressConfig
from fastcar_compile.fastar.rope import apply_rope


@dataclass
class TraceMetrics:
    density: float
    recall: float
    kept_mass: float
    out_err: float
    kv_bytes: int
    dense_kv_bytes: int
    slots_per_head: float
    merges: int
    evicted: int
    recall_per_head: list[float]  # per query head: shows which heads a mode hurts

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class TraceResult:
    out: np.ndarray  # [T, Hq, d] compressed attention output
    dense_out: np.ndarray  # [T, Hq, d]
    metrics: TraceMetrics
    caches: list[HeadCache]
    slots: np.ndarray  # [T, Hkv] resident slots after each step (flat once a budget fills)


def _check(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> tuple[int, int, int, int]:
    if q.ndim != 3 or k.ndim != 3 or v.shape != k.shape or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise FastCarError(f"trace shapes must be q [T, Hq, d], k and v [T, Hkv, d]; got {q.shape}, {k.shape}, "
                           f"{v.shape}")
    T, hq, d = q.shape
    hkv = k.shape[1]
    if hq % hkv:
        raise FastCarError(f"query heads {hq} must be a multiple of KV heads {hkv} (GQA)")
    return T, hq, hkv, d


def dense_step(q_post: np.ndarray, k_post: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Plain softmax attention of one query [d] over keys/values [n, d]: (output, probs)."""
    logits = k_post @ q_post / np.sqrt(q_post.shape[-1])
    w = np.exp(logits - logits.max())
    w /= w.sum()
    return w @ v, w


def recall_and_kept(c: HeadCache, slots: np.ndarray, w_slot: np.ndarray, w_dense: np.ndarray) -> tuple[float, float]:
    """(recall, kept mass) of one query: `w_slot` the compressed softmax over `slots`, `w_dense` the dense one
    over the p + 1 tokens seen (module docstring: a merged slot's probability is shared equally by its
    members; evicted tokens count 0)."""
    p1 = len(w_dense)
    per_slot = np.zeros(c.capacity)
    per_slot[slots] = w_slot / c.count[slots]
    ts = c.token_slot[:p1]
    resident = ts >= 0
    idx = np.where(resident, ts, 0)
    comp = np.where(resident, per_slot[idx], 0.0)
    attended = np.zeros(c.capacity, bool)
    attended[slots] = True
    return float(np.minimum(w_dense, comp).sum()), float(w_dense[resident & attended[idx]].sum())


def slot_bytes(cfg: KVCompressConfig, d: int, bytes_per: int) -> int:
    """Key + value, an int32 count with TempCache, the bit-packed LSH codes or one byte per int8 table with
    AnnSA, an int32 hit frame with prompt pruning."""
    extra = (4 if cfg.tempcache_sim is not None else 0) + (4 if cfg.prune_prompt is not None else 0)
    if cfg.lsh_bits is not None:
        extra += -(-cfg.lsh_bits * cfg.lsh_tables // 8)
    if cfg.int8_dirs is not None:
        extra += cfg.int8_tables
    return 2 * d * bytes_per + extra


def run_trace(q: np.ndarray, k: np.ndarray, v: np.ndarray, cfg: KVCompressConfig | list[KVCompressConfig],
              theta: float | None = 10000.0, measure_from: int = 0, bytes_per: int = 2) -> TraceResult:
    """Replay one layer's trace through per-KV-head compressed caches; see the module docstring.

    cfg may be one config for every KV head or a list with one per KV head (heads differ: a head that reads a
    fixed relative offset wants a window, a content-addressed head tolerates merging).
    """
    T, hq, hkv, d = _check(q, k, v)
    group = hq // hkv
    cfgs = list(cfg) if isinstance(cfg, list | tuple) else [cfg] * hkv
    if len(cfgs) != hkv:
        raise FastCarError(f"got {len(cfgs)} per-head configs for {hkv} KV heads; give one per KV head or one")
    caches = [HeadCache(c, d, T, theta, hasher(c, d)) for c in cfgs]
    pos = np.arange(T)
    q_post = apply_rope(np.swapaxes(q, 0, 1), pos, theta)  # [Hq, T, d]
    k_post = apply_rope(np.swapaxes(k, 0, 1), pos, theta)  # [Hkv, T, d]
    vv = np.swapaxes(np.asarray(v, np.float64), 0, 1)
    out = np.zeros((T, hq, d))
    dense_out = np.zeros((T, hq, d))
    executed = dense = 0
    recall, kept, errs = [], [], []
    head_recall = [[] for _ in range(hq)]
    slot_trace = np.zeros((T, hkv), np.int64)
    for p in range(T):
        for j, c in enumerate(caches):
            c.append(k[p, j], v[p, j])
            slot_trace[p, j] = c.slots_used()
        for h in range(hq):
            c = caches[h // group]
            qp = q_post[h, p]
            slots = c.select(qp)
            out[p, h], w_slot = c.attend(qp, slots)
            dense_out[p, h], w_dense = dense_step(qp, k_post[h // group, : p + 1], vv[h // group, : p + 1])
            if p < measure_from:
                continue
            executed += slots.size
            dense += p + 1
            r, m = recall_and_kept(c, slots, w_slot, w_dense)
            recall.append(r)
            head_recall[h].append(r)
            kept.append(m)
            errs.append(np.linalg.norm(out[p, h] - dense_out[p, h]) / max(np.linalg.norm(dense_out[p, h]), 1e-30))
    if dense == 0:
        raise FastCarError(f"measure_from={measure_from} leaves no step of a {T}-token trace to measure")
    slots = sum(c.slots_used() for c in caches)
    metrics = TraceMetrics(
        density=executed / dense, recall=float(np.mean(recall)), kept_mass=float(np.mean(kept)),
        out_err=float(np.mean(errs)),
        kv_bytes=sum(c.slots_used() * slot_bytes(c.cfg, d, bytes_per) for c in caches),
        dense_kv_bytes=T * hkv * 2 * d * bytes_per, slots_per_head=slots / hkv,
        merges=sum(c.merges for c in caches), evicted=sum(c.evicted for c in caches),
        recall_per_head=[float(np.mean(r)) for r in head_recall])
    return TraceResult(out, dense_out, metrics, caches, slot_trace)
