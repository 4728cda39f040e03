"""Token choice from logits: greedy, temperature / top-k / top-p sampling, classifier-free guidance.

Done in NumPy float64 on the host so a dense and a compiled session given the same logits and seed make
exactly the same choices.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fastcar_compile.core.errors import FastCarError


@dataclass(frozen=True)
class Sampler:
    """How to pick the next token; `do_sample=False` is greedy (argmax)."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise FastCarError(f"temperature must be > 0, got {self.temperature} (use do_sample=False for greedy)")
        if self.top_k < 0:
            raise FastCarError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise FastCarError(f"top_p must be in (0, 1], got {self.top_p}")

    def __call__(self, logits: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """logits [rows, vocab] -> token ids [rows]."""
        if not self.do_sample:
            return np.asarray(logits, dtype=np.float64).argmax(axis=-1).astype(np.int64)
        return draw(self.probs(logits), rng)

    def probs(self, logits: np.ndarray) -> np.ndarray:
        """The distribution a sampled token is drawn from ([rows, vocab] float64): temperature, then top-k, then
        top-p. Speculative sampling accepts draft tokens against exactly this distribution."""
        x = np.asarray(logits, dtype=np.float64) / self.temperature
        vocab = x.shape[-1]
        if 0 < self.top_k < vocab:
            kth = np.partition(x, vocab - self.top_k, axis=-1)[:, vocab - self.top_k][:, None]
            x = np.where(x < kth, -np.inf, x)
        p = np.exp(x - x.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        if self.top_p < 1.0:
            order = np.argsort(-p, axis=-1, kind="stable")
            sp = np.take_along_axis(p, order, axis=-1)
            # keep the smallest prefix whose mass reaches top_p (always at least the top token)
            drop_sorted = np.cumsum(sp, axis=-1) - sp >= self.top_p
            drop = np.zeros_like(drop_sorted)
            np.put_along_axis(drop, order, drop_sorted, axis=-1)
            p = np.where(drop, 0.0, p)
            p /= p.sum(axis=-1, keepdims=True)
        return p


def draw(p: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One token per row from probabilities p [rows, vocab] (need not be normalised): inverse CDF, one uniform
    number per row."""
    u = rng.random(p.shape[0])
    cdf = np.cumsum(p, axis=-1)
    tok = (cdf < (u * cdf[:, -1])[:, None]).sum(axis=-1)
    return np.minimum(tok, p.shape[-1] - 1).astype(np.int64)


def guide(cond: np.ndarray, uncond: np.ndarray, scale: float) -> np.ndarray:
    """Classifier-free guidance as VILA-U does it: u + s (c - u), in float64."""
    c = np.asarray(cond, dtype=np.float64)
    u = np.asarray(uncond, dtype=np.float64)
    return u + scale * (c - u)
