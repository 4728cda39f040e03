"""The per-token time average used for speedups: group medians weighted by replay share (NumPy reference)."""

from __future__ import annotations

import numpy as np

from fastcar_compile.demo.evaluate import mixture_ms


def test_mixture_ms_weights_group_medians() -> None:
    rng = np.random.default_rng(0)
    rep = rng.random(1000) < 0.8
    t = np.where(rep, 0.1, 0.5) + rng.normal(0, 0.001, 1000)
    t[::97] += 50.0  # machine-noise spikes must not dominate
    got = mixture_ms([t[:600], t[600:]], [rep[:600, None], rep[600:, None]])
    want = rep.mean() * np.median(t[rep]) + (1 - rep.mean()) * np.median(t[~rep])
    assert abs(got - want) < 1e-12
    assert abs(got - (0.8 * 0.1 + 0.2 * 0.5)) < 0.02  # a plain median would give ~0.1, a mean ~0.7


def test_mixture_ms_dense_is_median() -> None:
    t = np.array([1.0, 2.0, 3.0, 100.0])
    assert mixture_ms([t], [np.zeros((4, 0), bool)]) == np.median(t)
