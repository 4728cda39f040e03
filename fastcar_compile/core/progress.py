"""Progress bars only on a terminal: a bar redrawn with carriage returns is thousands of characters of noise in a
log or a pipe, so every bar of the package goes through `bar`, which shows one only where stderr is a terminal."""

from __future__ import annotations

from typing import Any


def bar(iterable: Any = None, *, enabled: bool = True, **kwargs: Any):
    """A tqdm bar when `enabled` and stderr is a terminal (tqdm's own check: disable=None), else a silent one
    that still iterates and counts."""
    from tqdm.auto import tqdm

    return tqdm(iterable, disable=None if enabled else True, **kwargs)


def hf_bars_on_terminal_only() -> None:
    """transformers (and the hub) draw their own tqdm bars when loading or saving weights: turned off unless stderr
    is a terminal, as ours are."""
    import sys

    if not sys.stderr.isatty():
        from transformers.utils import logging

        logging.disable_progress_bar()
