"""A bounded KV cache on the accelerator: how many KV slots a decode step's attention reads per layer.

Why here and not in the program: the bundles are compiled once with a run-time context (flag CTX on QK,
softmax and PV); a fixed-capacity cache (StreamingLLM: S sinks + the last W tokens, or a budget of C slots
per KV head, FAST-AR's TempCache merging tokens into shared slots) changes only that run-time length. So
the simulator takes the attended length per step and layer instead of the context; this module says what it
is for a bound, and checks lengths given from a trace (e.g. the NumPy reference's resident slots).
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from fastcar_compile.core.errors import FastCarError

from .isa import MAX_CONTEXT

# The bundle metadata key holding the compiled model's bounded layers: {"<layer>": {budget, sinks, window}}.
META_KEY = "kv"


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
        for name in ("budget", "sinks", "window"):
            v = getattr(self, name)
            if v is None and name == "budget":
                continue
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v > MAX_CONTEXT:
                raise FastCarError(f"kv {name} must be an integer in 0..{MAX_CONTEXT}, got {str(v)[:40]}")
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


    def to_dict(self) -> dict[str, Any]:
        return {"budget": self.budget, "sinks": self.sinks, "window": self.window}


def from_settings(settings: Mapping[str, Any]) -> KVBound | None:
    """The bound of one layer's compressed-cache settings (fastcar.kv_compress, fastar.KVCompressConfig
    fields): its budget caps the slots read; without a budget the cache keeps every token (sinks and window
    only say which slots survive eviction), so attention reads the whole context (None)."""
    if settings.get("budget") is None:
        return None
    return KVBound(budget=settings["budget"], sinks=settings.get("sinks", 0), window=settings.get("window", 0))


def recorded_bounds(meta: Mapping[str, Any], layers: int | None = None) -> dict[int, KVBound]:
    """Layer -> bound recorded in a bundle's metadata (``META_KEY``); {} when the model's KV cache is dense.
    Raises FastCarError naming a malformed entry (a decoded file is untrusted)."""
    rec = meta.get(META_KEY)
    if rec is None:
        return {}
    if not isinstance(rec, dict):
        raise FastCarError(f"bundle metadata: {META_KEY} must map layer -> KV settings, got {str(rec)[:40]}")
    n_layers = layers if layers is not None else meta.get("model", {}).get("layers")
    out: dict[int, KVBound] = {}
    for key, value in rec.items():
        if not isinstance(key, str) or not key.isdecimal() or not key.isascii() or \
                not (isinstance(n_layers, int) and int(key) < n_layers):
            raise FastCarError(f"bundle metadata: {META_KEY} names layer {key[:20]!r}, not a layer of the model")
        if not isinstance(value, dict) or set(value) - {"budget", "sinks", "window"} or "budget" not in value:
            raise FastCarError(f"bundle metadata: {META_KEY}[{key}] must be {{budget, sinks, window}}, got "
                               f"{str(value)[:60]}")
        bound = from_settings(value)
        if bound is None:
            raise FastCarError(f"bundle metadata: {META_KEY}[{key}] has no budget (only bounded layers are recorded)")
        out[int(key)] = bound
    return out


def describe(bounds: Mapping[int, KVBound]) -> str:
    """One phrase for a report line: 'budget 16 (sinks 2, window 8) on layers [0, 1]' per distinct setting."""
    groups: dict[KVBound, list[int]] = {}
    for layer, b in sorted(bounds.items()):
        groups.setdefault(b, []).append(layer)
    return "; ".join(f"{b.capacity} slots (sinks {b.sinks}, window {b.window}) on layers {ls}"
                     for b, ls in groups.items())


def kv_lengths(context: np.ndarray, layers: int, bound: KVBound | None = None,
               slots: np.ndarray | None = None, per_layer: Mapping[int, KVBound] | None = None) -> np.ndarray:
    """(steps, layers) attended KV lengths: the context (dense), a bound's, per-layer bounds' (layers not
    named read the whole context), or explicit per-step slots.

    slots: (steps,) or (steps, layers) resident slots read per step (e.g. TempCache's merged cache), each in
    1..context.
    """
    ctx = np.asarray(context, np.int64)
    if sum(x is not None for x in (bound, slots, per_layer)) > 1:
        raise FastCarError("give one of a KV bound, per-layer bounds or explicit KV slot counts")
    if per_layer is not None:
        out = np.repeat(ctx[:, None], layers, axis=1)
        for layer, b in per_layer.items():
            if not 0 <= layer < layers:
                raise FastCarError(f"KV bound for layer {layer}, which the {layers}-layer model lacks")
            out[:, layer] = b.attended(ctx)
        return out
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
