"""A bounded KV cache on the accelerator: how many KV slots a decode step's attention reads per layer.

Why here and not in the program: the bundles are compiled once with a run-time context (flag CTX on QK,
softmax and PV); a fixed-capacity cache (StreamingLLM: S sinks + the last W tokens, or a budget of C slots
per KV head, FAST-AR's TempCache merging tokens into shared slots) changes only that run-time length. So
the simulator takes the attended length per step and layer instead of the context; this module says what it
is for a bound, and checks lengths given from a trace (e.g. the NumPy reference's resident slots).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fastcar_compile.errors import FastCarError


@dataclass(frozen=True)
class KVBound:
    """Slots read per step: min(context, capacity); capacity = budget, or sinks + window without a budget.

    Every token is still written once (KV append); a merged token (TempCache) rewrites its slot in place, so
    the write traffic is the dense one and only reads shrink.
    """

    budget: int | None = None
    sinks: int = 0
    window: int = 0

    def __post_init__(self) -> None:
        if self.sinks < 0 or self.window < 0:
            raise FastCarError(f"kv sinks and window must be >= 0, got sinks={self.sinks} window={self.window}")
        if self.budget is None and self.window == 0:
            raise FastCarError("a bounded KV cache needs --kv-window W (local attention) or --kv-budget C")
        if self.budget is not None and self.budget < self.sinks + self.window + 1:
            raise FastCarError(f"kv budget {self.budget} must exceed sinks + window = {self.sinks + self.window}; "
                               "raise --kv-budget or lower --kv-sinks/--kv-window")

    @property
    def capacity(self) -> int:
        return self.budget if self.budget is not None else self.sinks + self.window

    def attended(self, context: np.ndarray | int) -> np.ndarray:
        """Slots read at each context length (context counts the new token)."""
        return np.minimum(np.asarray(context, np.int64), self.capacity)


def kv_lengths(context: np.ndarray, layers: int, bound: KVBound | None = None,
               slots: np.ndarray | None = None) -> np.ndarray:
    """(steps, layers) attended KV lengths: the context (dense), a bound's, or explicit per-step slots.

    slots: (steps,) or (steps, layers) resident slots read per step (e.g. TempCache's merged cache), each in
    1..context.
    """
    ctx = np.asarray(context, np.int64)
    if bound is not None and slots is not None:
        raise FastCarError("give either a KV bound or explicit KV slot counts, not both")
    if slots is not None:
        s = np.asarray(slots, np.int64)
        if s.ndim == 1:
            s = s[:, None]
        if s.shape[0] != ctx.shape[0] or s.shape[1] not in (1, layers):
            raise FastCarError(f"KV slot counts must have shape ({ctx.shape[0]},) or ({ctx.shape[0]}, {layers}), "
                               f"got {np.shape(slots)}")
        if (s < 1).any() or (s > ctx[:, None]).any():
            raise FastCarError("KV slot counts must lie in 1..context of their step (a cache never holds more "
                               "slots than tokens)")
        return np.broadcast_to(s, (ctx.shape[0], layers)).copy()
    att = bound.attended(ctx) if bound is not None else ctx
    return np.repeat(att[:, None], layers, axis=1)
