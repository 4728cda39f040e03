"""Progress bars only on a terminal: a bar redrawn with carriage returns is thousands of characters of noise in a
log or a pipe, so every bar of the package goes through `bar`, which shows one only where stderr is a terminal."""

from __future__ import annotations

from typing import Any


def bar(iterable: Any = None, *, enabled: bool = True, **kwargs: Any):
    """A tqdm bar when `enabled` and stderr is a terminal (tqdm's own check: disable=None), else a silent one
    that still iterates and counts."""
    from tqdm.auto import tqdm

    return tqdm(iterable, disable=None if enabled else True, **kwargs)
