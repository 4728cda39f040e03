"""Sign random projections (SimHash) for AnnSA: a key is hashed once when written, a query per step.

Two vectors share a bucket in one table with probability (1 - angle/pi)^bits, so more bits make buckets
sharper (lower density) and more tables give a key more chances to meet its query (higher recall). Tables
are drawn from one seeded stream so the first t tables of a 2t-table hasher are the t-table hasher: recall
can only rise with tables, which makes sweeps comparable.
"""

from __future__ import annotations

import numpy as np

from fastcar_compile.fastar.buckets import Buckets


class SignLSH(Buckets, kind="lsh"):
    """`bits` sign bits of seeded Gaussian projections per table (SimHash): bucket id = the bits packed."""

    @classmethod
    def from_settings(cls, dim: int, bits: int, dirs: int, tables: int, seed: int) -> SignLSH:
        return cls(dim, bits, tables, seed)

    def __init__(self, dim: int, bits: int, tables: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.bits, self.tables = bits, tables
        self.planes = rng.standard_normal((tables, bits, dim))
        self._weights = (1 << np.arange(bits, dtype=np.int64))

    def codes(self, x: np.ndarray) -> np.ndarray:
        """Bucket ids [..., tables] (int64) of vectors x [..., dim]."""
        signs = np.einsum("tbd,...d->...tb", self.planes, np.asarray(x, np.float64)) > 0
        return (signs.astype(np.int64) * self._weights).sum(-1)
