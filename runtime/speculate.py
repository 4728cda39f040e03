"""Speculative decoding for video: draft tokens for free, verify many in one step of the model, lossless.

In a video the token at the same position one frame earlier is a free draft (static regions repeat), and a
step over K+1 tokens costs far less than K+1 steps (the weights are read once). The model verifies the draft in
one multi-token step; what it keeps is exactly what it would have generated (docs/speculation.md):
- greedy: the longest prefix on which the draft equals the argmax, plus the model's own next token: the output
  is identical to plain greedy decoding;
- sampling: a draft token x is accepted with probability p(x), else the token is drawn from p with x removed
  and renormalised (the residual max(p - onehot(x), 0) of a deterministic draft), so every token is
  distributed as the model's p (the sampler's distribution: temperature, top-k, top-p, after guidance).
A batch advances by the shortest accepted prefix of its rows (one KV length for all), which keeps both rules
exact: a row's kept tokens are its accepted ones, plus its corrected token when it is the shortest.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from fastcar_compile.core import contract
from fastcar_compile.core.errors import FastCarError
from fastcar_compile.runtime.sampling import Sampler, draw

ADAPTIVE_START = 4  # draft length of an adaptive run's first verify step
ADAPTIVE_MAX = 16  # longest adaptive draft
# a verify step of 1 + K tokens costs about 1 + 0.06 K one-token steps (the video model, batch 2 with CFG: 1.27x
# for K = 4; 1.04x at batch 1; the long demo model 1.4x); adaptive K is chosen against this
STEP_COST_PER_TOKEN = 0.06
ADAPTIVE_DECAY = 0.9  # weight of the previous steps' acceptance counts, per step
MAX_DRAFT_TOKENS = 256
NGRAM_MAX = 3  # the n-gram draft matches the last 3 tokens, else 2, else 1


@dataclass(frozen=True)
class DraftSpec:
    """Which draft, and how many tokens per verify step (None: adaptive)."""

    kind: str
    tokens: int | None = None

    def __str__(self) -> str:
        return self.kind + (f":{self.tokens}" if self.tokens else "")


def parse_draft(draft: str | DraftSpec | None, draft_tokens: int | None = None) -> DraftSpec | None:
    """`draft` ("temporal", "ngram", "temporal+ngram", optionally ":K") and `draft_tokens` as one DraftSpec;
    one FastCarError line naming what is wrong otherwise."""
    if draft is None:
        if draft_tokens is not None:
            raise FastCarError("draft_tokens given without draft; pass draft='temporal' (or 'ngram')")
        return None
    if isinstance(draft, DraftSpec):
        kind, k = draft.kind, draft.tokens
    elif isinstance(draft, str):
        kind, _, tail = draft.partition(":")
        k = None
        if tail:
            if not (tail.isascii() and tail.isdigit()):
                raise FastCarError(f"draft {draft!r}: the part after ':' must be a whole number of draft tokens")
            k = int(tail)
    else:
        raise FastCarError(f"draft must be one of {', '.join(contract.DRAFT_KINDS)}, got {type(draft).__name__}")
    if kind not in contract.DRAFT_KINDS:
        raise FastCarError(f"draft {kind!r} is not one of {', '.join(contract.DRAFT_KINDS)} (optionally ':K')")
    if draft_tokens is not None:
        if isinstance(draft_tokens, bool) or not isinstance(draft_tokens, int | np.integer):
            raise FastCarError(f"draft_tokens must be a whole number, got {draft_tokens!r}")
        if k is not None and k != draft_tokens:
            raise FastCarError(f"draft {draft!r} and draft_tokens={draft_tokens} disagree; give K once")
        k = int(draft_tokens)
    if k is not None and not 1 <= k <= MAX_DRAFT_TOKENS:
        raise FastCarError(f"draft tokens must be in [1, {MAX_DRAFT_TOKENS}], got {k}")
    return DraftSpec(kind, k)


class DraftLength:
    """K per verify step: fixed, or adaptive. Adaptive keeps a running estimate of the chance a draft token is
    accepted (alpha: accepted tokens over tokens tried, the first rejection of a step counted as tried, old steps
    decayed) and takes the K that maximises the expected tokens per step, (1 - alpha^(K+1)) / (1 - alpha), over
    the step's relative cost 1 + STEP_COST_PER_TOKEN x K: long drafts on static stretches (alpha near 1), one or
    two where the video moves."""

    def __init__(self, fixed: int | None):
        self.fixed = fixed
        self.k = fixed if fixed is not None else ADAPTIVE_START
        self._acc, self._tried = 1.0, 2.0  # a prior of one accepted token in two

    def update(self, proposed: int, accepted: int) -> None:
        if self.fixed is not None or proposed == 0:
            return
        tried = accepted + (accepted < proposed)  # the tokens up to and including the first rejection
        self._acc = ADAPTIVE_DECAY * self._acc + accepted
        self._tried = ADAPTIVE_DECAY * self._tried + tried
        alpha = min(self._acc / self._tried, 0.999)
        ks = np.arange(1, ADAPTIVE_MAX + 1)
        gain = (1 - alpha ** (ks + 1)) / (1 - alpha) / (1 + STEP_COST_PER_TOKEN * ks)
        self.k = int(ks[np.argmax(gain)])


def _ngram_offset(h: np.ndarray) -> int | None:
    """Distance back to the continuation of the latest earlier occurrence of h's last n tokens (n = NGRAM_MAX
    down to 1); the draft copies h at that offset. None when even the last token never occurred before."""
    T = len(h)
    for n in range(min(NGRAM_MAX, T - 1), 0, -1):
        win = np.lib.stride_tricks.sliding_window_view(h[: T - 1], n)  # windows ending before the last token
        hits = np.flatnonzero((win == h[T - n:]).all(axis=1))
        if hits.size:
            return T - (int(hits[-1]) + n)
    return None


def propose(spec: DraftSpec, histories: list[np.ndarray], video_len: int, frame_tokens: int, k: int) -> np.ndarray:
    """Draft tokens [rows, k'] (k' <= k) for the next positions of every row.

    histories: each row's real tokens so far (prompt without padding, then the video; the token the step feeds
    last). video_len: how many of those tokens are video (the last ones). The temporal draft copies the token
    one frame back (a draft token itself beyond one frame); where no frame precedes, `temporal` drafts nothing
    and `temporal+ngram` uses the n-gram draft; a row without an n-gram match repeats its last token. All rows
    get the same k' (the verify step is one rectangle)."""
    rows = len(histories)
    L = frame_tokens
    temporal = spec.kind != contract.DRAFT_NGRAM and video_len >= L
    if spec.kind == contract.DRAFT_TEMPORAL and not temporal:
        # first frame without a given one: copy the previous frame only from where one exists
        return np.zeros((rows, 0), np.int64)
    out = np.empty((rows, k), np.int64)
    for r, h in enumerate(histories):
        off = L if temporal else _ngram_offset(h)
        ext = np.concatenate([h, np.empty(k, np.int64)])
        T = len(h)
        for i in range(k):  # chained: a copy reaching past the history copies the draft itself
            ext[T + i] = ext[T + i - off] if off is not None else h[-1]
        out[r] = ext[T:]
    return out


def previous_frame_draws(draft: np.ndarray, ring: np.ndarray, ring_pos: np.ndarray, v0: int,
                         rng: np.random.Generator) -> list[np.ndarray | None]:
    """Sampled temporal drafts: draft token i (video index v0 + i) is drawn from the model's distribution at the
    same position one frame back, where that distribution is known (ring[:, slot] holds video index
    ring_pos[slot], slot = index mod L); `draft` is overwritten there, and the distributions are returned for
    `verify` (None: the token draft stays, one-hot).

    Why: with a one-hot draft a token is accepted with probability p(previous token); with the previous frame's
    distribution q, with probability sum(min(p, q)) = 1 - TV(p, q), higher wherever the model is as unsure of
    a static region in both frames (measured on the video model's sampled videos: docs/speculation.md)."""
    L = len(ring_pos)
    out: list[np.ndarray | None] = []
    for i in range(draft.shape[1]):
        src = v0 + i - L
        if i >= L or src < 0 or ring_pos[src % L] != src:
            out.append(None)
            continue
        q = ring[:, src % L].astype(np.float64)
        q /= q.sum(axis=-1, keepdims=True)
        draft[:, i] = draw(q, rng)
        out.append(q)
    return out


def verify(draft: np.ndarray, get_guided: Callable[[int], np.ndarray], sampler: Sampler,
           rng: np.random.Generator, q: list[np.ndarray | None] | None = None
           ) -> tuple[np.ndarray, int, list[np.ndarray]]:
    """Accept the draft against the model's guided logits, position by position, the batch together.

    draft: the draft tokens [rows, k]. get_guided(i) -> guided logits [rows, vocab] of position i (the prediction
    after the fed token and i draft tokens), fetched lazily: a rejection at i needs no later position.
    q[i]: the distribution draft token i was drawn from ([rows, vocab], normalised), None for a token given as
    such (a one-hot draft).
    Returns (tokens [rows, a + 1], a, p): the kept tokens of every row, a = accepted draft tokens (batch
    minimum), and when sampling the model's distributions p at the kept positions (for later drafts).
    Greedy keeps the draft while it equals the argmax, then the argmax. Sampling accepts draft token x of a row
    with probability min(1, p(x) / q(x)) (p(x) for a one-hot draft), else draws from the residual
    max(p - q, 0) renormalised (p with x zeroed for a one-hot draft): each kept token is distributed as p.
    After k accepted tokens it draws from p. A row that accepted where another rejected keeps its draft token:
    the batch stops there."""
    rows, k = draft.shape
    kept: list[np.ndarray] = []
    dists: list[np.ndarray] = []
    r = np.arange(rows)
    for i in range(k + 1):
        g = get_guided(i)
        if not sampler.do_sample:
            t = g.argmax(axis=-1).astype(np.int64)
            if i == k:  # the whole draft was accepted: the model's next token after it
                kept.append(t)
                break
            ok = t == draft[:, i]
            tok = np.where(ok, draft[:, i], t)
        else:
            p = sampler.probs(g)
            dists.append(p)
            if i == k:
                kept.append(draw(p, rng))
                break
            d, qi = draft[:, i], q[i] if q is not None else None
            ratio = p[r, d] if qi is None else p[r, d] / qi[r, d]
            ok = rng.random(rows) < ratio
            tok = d.copy()
            bad = np.flatnonzero(~ok)
            if bad.size:  # the residual: p without the draft's mass, renormalised
                if qi is None:
                    res = p[bad].copy()
                    res[np.arange(bad.size), d[bad]] = 0.0
                else:
                    res = np.maximum(p[bad] - qi[bad], 0.0)
                tok[bad] = draw(res, rng)
        kept.append(tok)
        if not ok.all():
            break
    return np.stack(kept, axis=1), len(kept) - 1, dists
