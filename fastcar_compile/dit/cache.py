"""The stream's caches: what every cache of a chunk-causal DiT rollout shares (`StreamCache`), and the two the
stream runtime keeps for ONNX Runtime: `FrameCache` (the export's: the resident frames concatenated into the
step's inputs) and `RingCache` (a compiled step graph's: preallocated buffers read in place).

A cache keeps the K/V of the first `sinks` frames ever written, then of at most `window` of the most recent
others (window 0: no eviction). The eager FAST-AR runtime's cache (dit/fastar.FastARState) and the PyTorch
DiT's (torch/dit.ModeCache) are StreamCaches too; TempCache's merge, where a cache has it, is
dit/tempcache.py's for all of them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fastcar_compile.fastar.buckets import Buckets


def kept_frames(written: int, sinks: int, window: int) -> set[int] | None:
    """Frames a cache keeps once `written` frames were written: the first `sinks`, then the `window` most
    recent others (None: window 0, every frame)."""
    if not window:
        return None
    return set(range(min(sinks, written))) | set(range(max(sinks, written - window), written))


class StreamCache:
    """What the stream loop (dit/stream.rollout) needs of a cache, and the bookkeeping every cache shares: a
    chunk's K/V are written frame by frame (`write_frame`: the cache's own storage, and TempCache's merge), then
    the frames the sinks and the window no longer keep leave (`evict`). `past` is what a step reads, `resident`
    the frames held, `nbytes` the bytes they take."""

    def __init__(self, layers: int, tokens_per_frame: int, sinks: int, window: int):
        self.layers, self.tokens, self.sinks, self.window = layers, tokens_per_frame, sinks, window
        self.written = 0

    def write(self, first_frame: int, kv: list) -> None:
        """Write a chunk's K/V (as the backend's step returns them: `per_layer`) as frames first_frame.., then
        evict what the sinks and the window no longer keep."""
        layers = self.per_layer(kv)
        t = self.tokens
        frames = layers[0][0].shape[2] // t
        for j in range(frames):
            self.write_frame(first_frame + j, [tuple(None if a is None else a[:, :, j * t:(j + 1) * t] for a in layer)
                                               for layer in layers])
        self.written = max(self.written, first_frame + frames)
        self.evict(kept_frames(self.written, self.sinks, self.window))

    def per_layer(self, kv: list) -> list[tuple[Any, Any, Any]]:
        """(key, value, pre-RoPE key or None) per layer, each [B, heads, F*T, d], of a chunk's K/V: here the
        step graph's outputs, key and value per layer, then (TempCache compiled in) the pre-RoPE keys."""
        n = self.layers
        pre = kv[2 * n:] or [None] * n
        return [(kv[2 * i], kv[2 * i + 1], pre[i]) for i in range(n)]

    def write_frame(self, frame: int, layers: list[tuple[Any, Any, Any]]) -> None:
        """Store one frame (per layer (key, value, pre-RoPE key or None) [B, heads, T, d])."""
        raise NotImplementedError

    def evict(self, keep: set[int] | None) -> None:
        """Drop the frames outside `keep` (None: keep every frame)."""
        raise NotImplementedError

    def past(self, batch: int, heads: int, head_dim: int) -> Any:
        raise NotImplementedError

    @property
    def resident(self) -> list[int]:
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        raise NotImplementedError


class FrameCache(StreamCache):
    """The K/V of resident frames, kept one array per (frame, layer, K|V) so that eviction drops whole frames;
    `past()` concatenates the resident ones in frame order (the exported step graph's inputs)."""

    def __init__(self, layers: int, tokens_per_frame: int, sinks: int, window: int):
        super().__init__(layers, tokens_per_frame, sinks, window)
        self.frames: dict[int, list[np.ndarray]] = {}  # frame index -> 2*layers arrays [B, heads, T, d]

    @property
    def resident(self) -> list[int]:
        return sorted(self.frames)

    def write_frame(self, frame: int, layers: list[tuple[Any, Any, Any]]) -> None:
        self.frames[frame] = [np.ascontiguousarray(a) for key, value, _ in layers for a in (key, value)]

    def evict(self, keep: set[int] | None) -> None:
        if keep is not None:
            for f in [f for f in self.frames if f not in keep]:
                del self.frames[f]

    def past(self, batch: int, heads: int, head_dim: int) -> list[np.ndarray]:
        """Flat past.N.key|value arrays [B, heads, resident*T, d] (0 tokens when empty)."""
        order = self.resident
        if not order:
            return [np.zeros((batch, heads, 0, head_dim), np.float32) for _ in range(2 * self.layers)]
        return [np.concatenate([self.frames[f][i] for f in order], axis=2) for i in range(2 * self.layers)]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for arrays in self.frames.values() for a in arrays)


def _tensor(a: np.ndarray):
    """A NumPy array as a torch tensor sharing its memory (a read-only array is copied: torch would warn)."""
    import torch

    return torch.from_numpy(a if a.flags.writeable else a.copy())


class RingCache(StreamCache):
    """The cache of a compiled step graph (passes/dit_cache.py): per layer and K|V one preallocated buffer
    [B, heads, slots * T, d] that ONNX Runtime reads in place. Sink frames own the first slots, the window's
    frames a ring of the next `window` slots (window 0: a slot per frame, the buffers growing by a quarter when
    full: a copy of the cache every few chunks, and at most a quarter of the slots masked out in attention).
    Slots fill in order, so the first `length` tokens always hold K/V; a write copies the chunk's own K/V
    only, and writing a frame into its ring slot is what evicts the frame there."""

    def __init__(self, layers: int, tokens_per_frame: int, sinks: int, window: int, grow_from: int = 8,
                 tempcache: float | None = None, match: Buckets | None = None):
        super().__init__(layers, tokens_per_frame, sinks, window)
        # TempCache compiled in (SIM): per layer the tokens merged into each slot [B, heads, slots * T] (0: empty,
        # or left by a merge), its log as the graph's past_bias.N (-inf where 0), the last frame's pre-RoPE keys
        # and, for the top-1 match (`match`: its bucketing; None = aligned), their bucket codes (dit/tempcache.py)
        self.tempcache, self.match = tempcache, match
        self.counts: list[np.ndarray] = []
        self.bias: list[np.ndarray] = []
        self.last_pre: list[np.ndarray] = []
        self.last_codes: list[np.ndarray | None] = []
        self.merges = [0, 0]  # tokens merged, tokens written
        self.first_slots = sinks + window if window else max(sinks, grow_from)
        self.buffers: list[np.ndarray] = []  # allocated by the first past() or write() (rows known then)
        self.slot_frame: dict[int, int] = {}
        self.length = 0  # tokens at the start of the buffers that hold K/V
        # FastCar compiled in: per denoising step (the chunk's timesteps), the replay cache the last chunk left
        # (per layer its last frame's FFN output and key), fed back as past_replay.N.* at the same step
        self.replay: dict[tuple, list[np.ndarray]] = {}
        self._listed: dict[int, tuple[tuple[int, int], np.ndarray]] = {}  # layer -> (cache state, resident_slots)

    def _allocate(self, rows: int, heads: int, head_dim: int) -> None:
        if not self.buffers:
            self.buffers = [np.zeros((rows, heads, self.first_slots * self.tokens, head_dim), np.float32)
                            for _ in range(2 * self.layers)]
            if self.tempcache is not None:
                self.counts = [np.zeros((rows, heads, self.first_slots * self.tokens), np.int32)
                               for _ in range(self.layers)]
                self.bias = [np.full(c.shape, -np.inf, np.float32) for c in self.counts]

    @property
    def slots(self) -> int:
        return self.buffers[0].shape[2] // self.tokens

    @property
    def resident(self) -> list[int]:
        return sorted(self.slot_frame.values())

    def slot(self, frame: int) -> int:
        return frame if frame < self.sinks or not self.window else self.sinks + (frame - self.sinks) % self.window

    def write_frame(self, frame: int, layers: list[tuple[Any, Any, Any]]) -> None:
        """Copy a frame's K/V into its slot; with TempCache a token whose pre-RoPE key matches a slot of the
        previous frame (dit/tempcache.py) merges into it, and the slot moves to the new frame's slot (newest key,
        running mean value, count) leaving a dead one (count 0); sink frames never merge."""
        t = self.tokens
        key0 = layers[0][0]
        self._allocate(key0.shape[0], key0.shape[1], key0.shape[3])
        slot = self.slot(frame)
        if slot >= self.slots:  # window 0: the cache grows with the video
            size = max(-(-5 * self.slots // 4), slot + 1) * t
            self.buffers = [self._grown(b, size) for b in self.buffers]
            self.counts = [self._grown(c, size) for c in self.counts]
            self.bias = [self._grown(b, size, -np.inf) for b in self.bias]
        src = self.slot(frame - 1)
        merging = self.tempcache is not None and frame - 1 >= self.sinks and self.slot_frame.get(src) == frame - 1
        new = slice(slot * t, (slot + 1) * t)
        for i, (key, value, pre) in enumerate(layers):
            if self.tempcache is not None:
                value, count = self._merge(i, pre, value, src if merging else None)
                self.counts[i][:, :, new] = count
                with np.errstate(divide="ignore"):  # a position a merge left: count 0, logit -inf
                    self.bias[i][:, :, new] = np.log(count)
            self.buffers[2 * i][:, :, new] = key
            self.buffers[2 * i + 1][:, :, new] = value
        self.slot_frame[slot] = frame
        self.length = max(self.length, (slot + 1) * t)

    def evict(self, keep: set[int] | None) -> None:
        """Nothing to drop: writing a frame into its ring slot replaced the frame the window no longer keeps."""

    def _grown(self, old: np.ndarray, size: int, fill: float = 0) -> np.ndarray:
        """`old` with `size` slots' tokens on axis 2, the filled ones copied (a new array: ORT is rebound)."""
        new = np.full((*old.shape[:2], size, *old.shape[3:]), fill, old.dtype)
        new[:, :, :self.length] = old[:, :, :self.length]
        return new

    def _merge(self, i: int, k_pre: np.ndarray, value: np.ndarray, src: int | None) -> tuple[np.ndarray, np.ndarray]:
        """Layer i's merge of one frame into the previous frame's slot `src` (None: no merge; dit/tempcache.py):
        (values to write, counts); the previous frame's merged positions become dead."""
        codes = None if self.match is None else self.match.codes(k_pre)
        count = np.ones(value.shape[:3], np.int32)
        if src is not None:
            from fastcar_compile.dit import tempcache

            old = slice(src * self.tokens, (src + 1) * self.tokens)
            c = _tensor(self.counts[i][:, :, old])
            target = tempcache.targets(_tensor(k_pre), _tensor(self.last_pre[i]), c > 0, self.tempcache,
                                       *(None if x is None else _tensor(x) for x in (codes, self.last_codes[i])))
            out, cnt, left = tempcache.merge_positional(target, _tensor(self.buffers[2 * i + 1][:, :, old]), c,
                                                        _tensor(value))
            value, count, left = out.numpy(), cnt.numpy(), left.numpy()
            self.counts[i][:, :, old] = left
            self.bias[i][:, :, old] = np.where(left > 0, self.bias[i][:, :, old], -np.inf)
            self.merges[0] += int((target >= 0).sum())
        self.merges[1] += count.size
        if len(self.last_pre) <= i:
            self.last_pre.append(k_pre.copy())
            self.last_codes.append(codes)
        else:
            self.last_pre[i], self.last_codes[i] = k_pre.copy(), codes
        return value, count

    @property
    def kv_density(self) -> float:
        """Resident slots / the slots a dense cache of the same frames holds, all layers, rows and heads (TempCache
        leaves dead slots behind its merges; 1 without it)."""
        if self.tempcache is None or not self.counts:
            return 1.0
        dense = self.layers * self.counts[0][:, :, :1].size * self.tokens * len(self.slot_frame)
        return sum(int((c[:, :, :self.length] > 0).sum()) for c in self.counts) / dense

    def resident_slots(self, layer: int) -> np.ndarray:
        """Layer `layer`'s resident slots [B, heads, N] (resident_slots), listed again only after a write."""
        state = (self.length, self.merges[1])  # every write with TempCache counts its tokens in merges[1]
        held = self._listed.get(layer)
        if held is None or held[0] != state:
            held = self._listed[layer] = (state, resident_slots(self.counts[layer][:, :, :self.length]))
        return held[1]

    def past(self, batch: int, heads: int, head_dim: int) -> RingCache:
        self._allocate(batch, heads, head_dim)
        return self  # the compiled step reads the buffers themselves

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)


def resident_slots(counts: np.ndarray) -> np.ndarray:
    """[B, heads, N] int64: per (row, head) the positions whose count is > 0 (a slot lives there), ascending,
    then -1; N = the most any (row, head) holds (at least 1). What TempCache's `slots` form attends."""
    live = counts > 0
    n = max(int(live.sum(-1).max(initial=0)), 1)
    order = np.argsort(~live, axis=-1, kind="stable")[..., :n]
    return np.where(np.take_along_axis(live, order, -1), order, -1).astype(np.int64)
