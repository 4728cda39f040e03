"""Token sampling: empirical frequencies against the distribution top-k / top-p define (computed here by hand)."""

from __future__ import annotations

import numpy as np
import pytest

from fastcar_compile.core.errors import FastCarError
from fastcar_compile.runtime.sampling import Sampler, guide

LOGITS = np.array([2.0, 1.5, 1.0, 0.2, -1.0, -3.0])


def _expected(logits: np.ndarray, temperature: float, keep: list[int]) -> np.ndarray:
    p = np.zeros_like(logits)
    e = np.exp(logits[keep] / temperature)
    p[keep] = e / e.sum()
    return p


@pytest.mark.parametrize(
    "kw, keep",
    [
        (dict(temperature=1.0), [0, 1, 2, 3, 4, 5]),
        (dict(temperature=0.7, top_k=3), [0, 1, 2]),
        # softmax(LOGITS) = .42 .26 .15 .07 .02 .003: the smallest prefix reaching 0.8 is the top 3
        (dict(temperature=1.0, top_p=0.8), [0, 1, 2]),
        (dict(temperature=1.0, top_k=4, top_p=0.5), [0, 1]),
    ],
)
def test_sampling_frequencies(kw, keep):
    s = Sampler(do_sample=True, **kw)
    rng = np.random.default_rng(0)
    n = 40000
    draws = s(np.tile(LOGITS, (n, 1)), rng)
    freq = np.bincount(draws, minlength=6) / n
    exp = _expected(LOGITS, kw["temperature"], keep)
    assert set(np.flatnonzero(freq)) == set(keep)
    np.testing.assert_allclose(freq, exp, atol=0.01)


def test_greedy_and_guidance():
    x = np.array([[0.1, 3.0, -1.0], [5.0, 0.0, 1.0]])
    assert Sampler()(x, np.random.default_rng(0)).tolist() == [1, 0]
    c, u = np.array([[1.0, 2.0]]), np.array([[3.0, -1.0]])
    np.testing.assert_allclose(guide(c, u, 1.5), [[3.0 + 1.5 * (1 - 3), -1.0 + 1.5 * 3]])


def test_bad_sampler_arguments():
    for kw in (dict(temperature=0.0), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5)):
        with pytest.raises(FastCarError):
            Sampler(do_sample=True, **kw)
