"""What AnnSA's bucketings share: codes per table for a vector, and "a key meets its query" = equal codes in
at least one table. SignLSH (lsh.py) and Int8Buckets (int8.py) differ only in how they compute the codes."""

from __future__ import annotations

import numpy as np


class Buckets:
    """A bucketing of head_dim vectors into `tables` independent tables (one code per table)."""

    tables: int

    def codes(self, x: np.ndarray) -> np.ndarray:
        """Bucket ids [..., tables] (int64) of vectors x [..., dim]."""
        raise NotImplementedError

    @staticmethod
    def shares_bucket(key_codes: np.ndarray, query_codes: np.ndarray) -> np.ndarray:
        """[n] bool: key i shares a bucket with the query in at least one table (key_codes [n, tables])."""
        return (key_codes == query_codes[None, :]).any(-1)
