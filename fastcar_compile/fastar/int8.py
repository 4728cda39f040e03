"""8-bit quantised buckets for AnnSA (FAST-AR's alternative to LSH): keys quantised once when written.

Definition (the native kernel, runtime/native/compressed_attention.h `Int8Codes`, computes the same):
per table t, `dirs` seeded Gaussian directions u (unit length, stored as float32). A vector x (a post-RoPE key,
or the query) is normalised, x^ = x / |x|, and projected: y = sqrt(D) * (u . x^) (about unit variance for a
random direction). Its int8 code is c = clamp(floor(32 y), -128, 127): the projection quantised to 8 bits over
+-4 sigma. The table's bucket takes the top 8 / dirs bits of each direction's code, floor(c / 2^(8 - 8/dirs)),
shifted to be non-negative and packed into one 8-bit bucket id. So `int8:1xT` = 256 levels of one direction,
`int8:2xT` = 16 x 16 levels of 0.5 sigma, `int8:4xT` = 4 levels per direction (+-2 sigma), `int8:8xT` = the
sign of 8 directions (8-bit SimHash). A query attends to keys sharing its bucket in >= 1 table (plus sinks,
window, own slot: cache.HeadCache.select). Storage per slot: one byte per table.
"""

from __future__ import annotations

import numpy as np

from fastcar_compile.fastar.buckets import Buckets

SCALE = 32.0  # int8 steps per sigma of a projection: +-4 sigma fill the int8 range


class Int8Buckets(Buckets, kind="int8"):
    """`dirs` int8-quantised projections per table, their top 8 / dirs bits packed into one byte (module
    docstring); keys are quantised once when written, so a slot stores one byte per table."""

    @classmethod
    def from_settings(cls, dim: int, bits: int, dirs: int, tables: int, seed: int) -> Int8Buckets:
        return cls(dim, dirs, tables, seed)

    def __init__(self, dim: int, dirs: int, tables: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        planes = rng.standard_normal((tables, dirs, dim))
        planes /= np.linalg.norm(planes, axis=-1, keepdims=True)
        # the kernel receives float32 planes (an attribute): use the same rounded values
        self.planes = planes.astype(np.float32).astype(np.float64)
        self.dim, self.dirs, self.tables = dim, dirs, tables
        self.bits = 8 // dirs

    def quantise(self, x: np.ndarray) -> np.ndarray:
        """int8 codes [..., tables, dirs] of vectors x [..., dim]."""
        x = np.asarray(x, np.float64)
        norm = np.linalg.norm(x, axis=-1, keepdims=True)
        unit = np.divide(x, norm, out=np.zeros_like(x), where=norm > 0)
        y = np.sqrt(self.dim) * np.einsum("trd,...d->...tr", self.planes, unit)
        return np.clip(np.floor(SCALE * y), -128, 127).astype(np.int64)

    def codes(self, x: np.ndarray) -> np.ndarray:
        """Bucket ids [..., tables] in [0, 256) of vectors x [..., dim]."""
        c = self.quantise(x)
        part = np.floor_divide(c, 1 << (8 - self.bits)) + (1 << (self.bits - 1))  # [0, 2^bits)
        return (part << (self.bits * np.arange(self.dirs, dtype=np.int64))).sum(-1)
