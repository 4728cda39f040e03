"""One KV head's compressed cache: fixed capacity, sinks + window, TempCache merging, eviction, LSH codes.

Slots hold the key post-RoPE at the position of its most recent member (so q.k keeps true relative
distances), that key pre-RoPE (TempCache compares before rotation), the running mean of the members'
values, the member count (attention adds log(count): the TempCache lemma) and the cumulative attention
probability the slot received (for 'mass' eviction), and for prompt pruning the latest frame in which a query
hit the slot (`hit_frame`, frame index + 1; 0 = never). `token_slot[t]` maps every token seen to its slot, or
-1 once evicted: the bookkeeping that the property tests check (counts sum to tokens seen, no slot lost).
"""

from __future__ import annotations

import numpy as np

from fastcar_compile.core.contract import aligned_is_video
from fastcar_compile.fastar.buckets import Buckets
from fastcar_compile.fastar.config import KVCompressConfig
from fastcar_compile.fastar.int8 import Int8Buckets
from fastcar_compile.fastar.lsh import SignLSH
from fastcar_compile.fastar.rope import apply_rope


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cosine similarity of a [d] with each row of b [n, d] (0 for zero vectors)."""
    den = np.linalg.norm(a) * np.linalg.norm(b, axis=-1)
    return np.where(den > 0, b @ a / np.where(den > 0, den, 1.0), 0.0)


class HeadCache:
    def __init__(self, cfg: KVCompressConfig, head_dim: int, max_tokens: int, theta: float | None = 10000.0,
                 hasher: Buckets | None = None) -> None:
        self.cfg, self.theta, self.hasher = cfg, theta, hasher
        cap = max_tokens if cfg.budget is None else min(cfg.budget, max_tokens)
        self.capacity = cap
        self.k_post = np.zeros((cap, head_dim))
        self.k_pre = np.zeros((cap, head_dim))
        self.v = np.zeros((cap, head_dim))
        self.count = np.zeros(cap, np.int64)
        self.pos = np.full(cap, -1, np.int64)
        self.mass = np.zeros(cap)
        self.live = np.zeros(cap, bool)
        self.hit_frame = np.zeros(cap, np.int64)
        self.codes = np.zeros((cap, hasher.tables if hasher else 0), np.int64)
        self.token_slot = np.full(max_tokens, -1, np.int64)
        self.seen = 0
        self.evicted = 0
        self.merges = 0

    # --- writing ----------------------------------------------------------------------------------------------
    def append(self, k_pre: np.ndarray, v: np.ndarray) -> int:
        """Write the next token (position = tokens seen so far); return its slot."""
        p = self.seen
        k_pre = np.asarray(k_pre, np.float64)
        v = np.asarray(v, np.float64)
        k_post = apply_rope(k_pre, p, self.theta)
        slot = self._merge_target(p, k_pre)
        if slot >= 0:
            c = self.count[slot]
            self.v[slot] = (self.v[slot] * c + v) / (c + 1)
            self.count[slot] = c + 1
            self.merges += 1
        else:
            if self.live.all():
                self._evict(p)
            slot = int(np.flatnonzero(~self.live)[0])
            self.live[slot] = True
            self.v[slot] = v
            self.count[slot] = 1
            self.mass[slot] = 0.0
            self.hit_frame[slot] = 0
        self.k_pre[slot], self.k_post[slot], self.pos[slot] = k_pre, k_post, p
        if self.hasher is not None:
            self.codes[slot] = self.hasher.codes(k_post)
        self.token_slot[p] = slot
        self.seen = p + 1
        return slot

    def _mergeable(self, slots: np.ndarray) -> np.ndarray:
        slots = slots[slots >= 0]
        return np.unique(slots[self.live[slots] & (self.pos[slots] >= self.cfg.sinks)])

    def _merge_target(self, p: int, k_pre: np.ndarray) -> int:
        """The slot the new key merges into (TempCache), or -1."""
        cfg = self.cfg
        if cfg.tempcache_sim is None or p < cfg.sinks or not aligned_is_video(p, cfg.frame_tokens, cfg.video_start):
            return -1
        cand = [self.token_slot[p - cfg.frame_tokens : p - cfg.frame_tokens + 1]]
        if cfg.correspondence == "aligned+top1":
            frame_start = p - (p - cfg.video_start) % cfg.frame_tokens
            cand.append(self.token_slot[frame_start - cfg.frame_tokens : frame_start])
        slots = self._mergeable(np.concatenate(cand))
        if slots.size == 0:
            return -1
        sims = _cos(k_pre, self.k_pre[slots])
        best = int(np.argmax(sims))
        return int(slots[best]) if sims[best] > cfg.tempcache_sim else -1

    def _evict(self, p: int) -> None:
        """Free one slot that holds neither a sink nor a window token (p = the incoming position)."""
        cfg = self.cfg
        ok = self.live & (self.pos >= cfg.sinks) & (self.pos <= p - cfg.window)
        cand = np.flatnonzero(ok)
        key = {"mass": lambda: self.mass[cand], "oldest": lambda: self.pos[cand],
               "mean": lambda: self.mass[cand] / self.count[cand]}[cfg.eviction]()
        slot = int(cand[np.argmin(key)])
        self.token_slot[self.token_slot == slot] = -1
        self.evicted += int(self.count[slot])
        self.live[slot] = False
        self.count[slot] = 0
        self.pos[slot] = -1

    # --- reading ----------------------------------------------------------------------------------------------
    def protected(self, p: int) -> np.ndarray:
        """[cap] bool: live slots holding a sink or a token of the last `window` positions up to p."""
        return self.live & ((self.pos < self.cfg.sinks) | (self.pos > p - self.cfg.window))

    def _frame(self, p: int) -> int:
        """Video frame index of position p (-1 for the prompt prefix)."""
        return (p - self.cfg.video_start) // self.cfg.frame_tokens if p >= self.cfg.video_start else -1

    def pruned(self, p: int) -> np.ndarray:
        """[cap] bool: prompt-prefix slots skipped at position p (--prune-prompt): from video frame 1 on, a
        prefix slot (position < video_start) is skipped unless a query of the previous frame (or of this one)
        hit it. Skipped slots cannot be hit, so a pruned prefix key stays pruned for the rest of the video."""
        f = self._frame(p)
        if self.cfg.prune_prompt is None or f < 1:
            return np.zeros(self.capacity, bool)
        return self.live & (self.pos < self.cfg.video_start) & (self.hit_frame < f)

    def select(self, q_post: np.ndarray) -> np.ndarray:
        """Slots one decode query attends to: all live ones, or (AnnSA) bucket matches + sinks + window; minus
        the pruned prompt slots (pruning overrides sinks).

        The current token's own slot is always included, so a selection is never empty (window 0, no hit).
        """
        p = self.seen - 1
        if self.hasher is None:
            keep = self.live.copy()
        else:
            hit = self.hasher.shares_bucket(self.codes, self.hasher.codes(q_post))
            keep = self.live & (hit | self.protected(p))
        keep &= ~self.pruned(p)
        keep[self.token_slot[p]] = True
        return np.flatnonzero(keep)

    def attend(self, q_post: np.ndarray, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Softmax over the chosen slots with the log(count) bias; returns (output [d], probs [len(slots)])."""
        d = q_post.shape[-1]
        logits = self.k_post[slots] @ q_post / np.sqrt(d) + np.log(self.count[slots])
        w = np.exp(logits - logits.max())
        w /= w.sum()
        self.mass[slots] += w
        p = self.seen - 1
        if self.cfg.prune_prompt is not None and p >= self.cfg.video_start:  # a hit: weight >= the threshold
            hits = slots[(w >= self.cfg.prune_prompt) & (self.pos[slots] < self.cfg.video_start)]
            self.hit_frame[hits] = self._frame(p) + 1
        return w @ self.v[slots], w

    def slots_used(self) -> int:
        return int(self.live.sum())


def hasher(cfg: KVCompressConfig, dim: int) -> SignLSH | Int8Buckets | None:
    """The AnnSA bucketing of a fastar.KVCompressConfig, or None when it has none (dense selection): the
    reference (attention.py, generate.py) and the compiler's attribute writer (passes/fused_attention.py)
    draw the same planes from it."""
    if cfg.lsh_bits:
        return SignLSH(dim, cfg.lsh_bits, cfg.lsh_tables, cfg.seed)
    if cfg.int8_dirs:
        return Int8Buckets(dim, cfg.int8_dirs, cfg.int8_tables, cfg.seed)
    return None
