"""Token ids from the user, checked before they reach ONNX Runtime: a negative id would silently
wrap to the end of the vocabulary in Gather, a float would be truncated, 2**70 would overflow."""

from __future__ import annotations

from typing import Any

import numpy as np

from fastcar_compile.core.errors import FastCarError


def check_token_ids(ids: Any, vocab: int | None, what: str) -> np.ndarray:
    """Integer token ids in [0, vocab) as an array; one FastCarError naming the first problem otherwise."""
    try:
        a = np.asarray(ids)
    except (TypeError, ValueError, OverflowError):
        raise FastCarError(f"{what} must be integer token ids, got {type(ids).__name__}") from None
    if a.dtype == object:  # Python ints beyond int64 (2**70), or floats/bools mixed in
        odd = next((x for x in a.ravel() if isinstance(x, float | bool) or not isinstance(x, int | np.integer)), None)
        if odd is not None:
            raise FastCarError(f"{what} must hold integer token ids, got {odd!r} (floats are not truncated)")
        raise FastCarError(f"{what} holds a token id beyond int64 ({max(a.ravel(), key=abs)}); ids are 0..vocab-1")
    if a.dtype == np.bool_ or not np.issubdtype(a.dtype, np.integer):
        raise FastCarError(f"{what} must hold integer token ids, got dtype {a.dtype}")
    if a.size and a.min() < 0:
        raise FastCarError(f"{what} holds negative token id {int(a.min())}; ids are 0..vocab-1")
    if vocab is not None and a.size and a.max() >= vocab:
        raise FastCarError(f"{what} holds token id {int(a.max())}, beyond this model's vocabulary (0..{vocab - 1})")
    return a
