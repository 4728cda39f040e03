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
ADAPTIVE_MAX = 16  # longest adaptive draft: a 17-token step costs ~2x a 1-token one (docs/speculation.md)
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
    """K per verify step: fixed, or adaptive (doubled after a fully accepted draft, halved when fewer than half
    were accepted), so long static stretches verify many tokens a step and moving ones waste little."""

    def __init__(self, fixed: int | None):
        self.fixed = fixed
        self.k = fixed if fixed is not None else ADAPTIVE_START

    def update(self, proposed: int, accepted: int) -> None:
        if self.fixed is not None or proposed < self.k:  # a draft cut short (video end, no source) says nothing
            return
        if accepted >= proposed:
            self.k = min(2 * self.k, ADAPTIVE_MAX)
        elif accepted < self.k // 2:
            self.k = max(1, self.k // 2)


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


def verify(draft: np.ndarray, get_guided: Callable[[int], np.ndarray], sampler: Sampler,
           rng: np.random.Generator) -> tuple[np.ndarray, int]:
    """Accept the draft against the model's guided logits, position by position, the batch together.

    draft: the draft tokens [rows, k]. get_guided(i) -> guided logits [rows, vocab] of position i (the prediction
    after the fed token and i draft tokens), fetched lazily: a rejection at i needs no later position.
    Returns (tokens [rows, a + 1], a): the kept tokens of every row, a = accepted draft tokens (batch minimum).
    Greedy keeps the draft while it equals the argmax, then the argmax. Sampling accepts draft token x of a row
    with probability p(x), else draws from p with x zeroed (renormalised); after k accepted tokens it draws
    from p. A row that accepted where another rejected keeps its draft token: the batch stops there."""
    rows, k = draft.shape
    kept: list[np.ndarray] = []
    for i in range(k + 1):
        g = get_guided(i)
        if i == k:  # the whole draft was accepted: the model's next token after it
            kept.append(sampler(g, rng))
            break
        d = draft[:, i]
        if not sampler.do_sample:
            t = g.argmax(axis=-1).astype(np.int64)
            ok = t == d
            tok = np.where(ok, d, t)
        else:
            p = sampler.probs(g)
            ok = rng.random(rows) < p[np.arange(rows), d]
            tok = d.copy()
            bad = np.flatnonzero(~ok)
            if bad.size:  # the residual of a one-hot draft: p without x, renormalised
                q = p[bad].copy()
                q[np.arange(bad.size), d[bad]] = 0.0
                tok[bad] = draw(q, rng)
        kept.append(tok)
        if not ok.all():
            break
    return np.stack(kept, axis=1), len(kept) - 1
