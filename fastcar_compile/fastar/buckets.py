"""What AnnSA's bucketings share: codes per table for a vector, and "a key meets its query" = equal codes in
at least one table. SignLSH (lsh.py) and Int8Buckets (int8.py) differ only in how they compute the codes.

Each bucketing registers itself under its name (`class X(Buckets, kind="name")`) with how it is drawn from the
bucket settings (`from_settings`), so that every runtime (the eager DiT runtime, the compiled one's cache writes,
the metadata a compiled graph records) finds it by name in `KINDS`.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

KINDS: dict[str, type[Buckets]] = {}  # name -> bucketing (registered by the subclasses)


class Buckets:
    """A bucketing of head_dim vectors into `tables` independent tables (one code per table)."""

    tables: int
    kind: ClassVar[str] = ""

    def __init_subclass__(cls, kind: str = "", **kw) -> None:
        super().__init_subclass__(**kw)
        if kind:
            cls.kind = kind
            KINDS[kind] = cls

    @classmethod
    def from_settings(cls, dim: int, bits: int, dirs: int, tables: int, seed: int) -> Buckets:
        """This bucketing drawn from the bucket settings (--lsh-bits, --int8-dirs, --ann-tables, --ann-seed)."""
        raise NotImplementedError

    def codes(self, x: np.ndarray) -> np.ndarray:
        """Bucket ids [..., tables] (int64) of vectors x [..., dim]."""
        raise NotImplementedError

    @staticmethod
    def shares_bucket(key_codes: np.ndarray, query_codes: np.ndarray) -> np.ndarray:
        """[n] bool: key i shares a bucket with the query in at least one table (key_codes [n, tables])."""
        return (key_codes == query_codes[None, :]).any(-1)
