"""Streaming chunk-causal generation: a few-step flow-matching sampler per chunk over a frame KV cache with
attention sinks and a rolling window, one loop for both backends (ONNX Runtime and the eager model).

Per chunk (Self-Forcing's rollout): start from noise; at each step t (1000, 750, 500, 250) the denoiser predicts
the flow velocity v over the chunk + the cache; x0 = x_t - sigma v; the next step re-noises x0 to its sigma
with fresh noise (DMD-style). With CFG the model runs on two rows (prompt, empty prompt) and
v = v_u + s (v_c - v_u). After the last step the model runs once more on the clean chunk at t = 0 and that
pass's K/V are written to the cache: the first `sink_frames` frames stay for ever, then only the
`window_frames` most recent frames (0: all). The cache and the noise are NumPy, so both backends see the
very same inputs and the eager loop is the reference and the baseline.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fastcar_compile.core.contract import (
    ANNSA_DENSE,
    ANNSA_INPUTS,
    ANNSA_NATIVE,
    CACHE_IN_PLACE,
    DIT_CACHE_FORM_KEY,
    DIT_CONFIG_KEY,
    DIT_MODES_KEY,
    DIT_TEXT_GRAPH_KEY,
    PAST_LENGTH,
    REPLAY_FIRST,
    TEMPCACHE_SLOTS,
    DiTConfig,
    DiTModes,
    annca_io,
    annsa_io,
    dit_config_of,
    dit_past_names,
    replay_io,
    step_io,
    tas_name,
    tempcache_io,
    tempcache_slots_name,
)
from fastcar_compile.core.errors import FastCarError
from fastcar_compile.dit import tempcache
from fastcar_compile.fastar.buckets import Buckets

STEPS = (1000.0, 750.0, 500.0, 250.0)  # flow-matching timesteps of a 4-step distilled sampler


def kept_frames(written: int, sinks: int, window: int) -> set[int] | None:
    """Frames a cache keeps once `written` frames were written: the first `sinks`, then the `window` most
    recent others (None: window 0, every frame)."""
    if not window:
        return None
    return set(range(min(sinks, written))) | set(range(max(sinks, written - window), written))


class FrameCache:
    """The K/V of resident frames, per layer: the first `sinks` frames ever written, then at most `window`
    of the most recent others (window 0: no eviction). Frames are kept one array per (frame, layer, K|V) so
    that eviction drops whole frames; `past()` concatenates the resident ones in frame order."""

    def __init__(self, layers: int, tokens_per_frame: int, sinks: int, window: int):
        self.layers, self.tokens, self.sinks, self.window = layers, tokens_per_frame, sinks, window
        self.frames: dict[int, list[np.ndarray]] = {}  # frame index -> 2*layers arrays [B, heads, T, d]
        self.written = 0

    @property
    def resident(self) -> list[int]:
        return sorted(self.frames)

    def write(self, first_frame: int, kv: list[np.ndarray]) -> None:
        """Store a chunk's K/V (2*layers arrays [B, heads, F*T, d]) as frames first_frame.., then evict."""
        frames = kv[0].shape[2] // self.tokens
        for j in range(frames):
            sl = slice(j * self.tokens, (j + 1) * self.tokens)
            self.frames[first_frame + j] = [np.ascontiguousarray(a[:, :, sl]) for a in kv]
        self.written = max(self.written, first_frame + frames)
        keep = kept_frames(self.written, self.sinks, self.window)
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


class RingCache:
    """The cache of a compiled step graph (passes/dit_cache.py): per layer and K|V one preallocated buffer
    [B, heads, slots * T, d] that ONNX Runtime reads in place. Sink frames own the first slots, the window's
    frames a ring of the next `window` slots (window 0: a slot per frame, the buffers growing by a quarter when
    full: a copy of the cache every few chunks, and at most a quarter of the slots masked out in attention).
    Slots fill in order, so the first `length` tokens always hold K/V; a write copies the chunk's own K/V
    only. Same residency as FrameCache."""

    def __init__(self, layers: int, tokens_per_frame: int, sinks: int, window: int, grow_from: int = 8,
                 tempcache: float | None = None, match: Buckets | None = None):
        self.layers, self.tokens, self.sinks, self.window = layers, tokens_per_frame, sinks, window
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

    def write(self, first_frame: int, kv: list[np.ndarray]) -> None:
        """Copy a chunk's K/V (2*layers arrays [B, heads, F*T, d], then with TempCache the pre-RoPE keys per
        layer) into the slots of frames first_frame..; with TempCache a token whose pre-RoPE key's cosine with
        the same (h, w) one frame back exceeds SIM merges into that slot, which moves to the new frame's slot
        (newest key, running mean value, count + 1) leaving a dead one (count 0); sink frames never merge."""
        t, n = self.tokens, self.layers
        pre, kv = kv[2 * n:], kv[:2 * n]
        self._allocate(kv[0].shape[0], kv[0].shape[1], kv[0].shape[3])
        for j in range(kv[0].shape[2] // t):
            f = first_frame + j
            slot = self.slot(f)
            if slot >= self.slots:  # window 0: the cache grows with the video
                size = max(-(-5 * self.slots // 4), slot + 1) * t
                self.buffers = [self._grown(b, size) for b in self.buffers]
                self.counts = [self._grown(c, size) for c in self.counts]
                self.bias = [self._grown(b, size, -np.inf) for b in self.bias]
            src = self.slot(f - 1)
            merging = (self.tempcache is not None and f - 1 >= self.sinks and self.slot_frame.get(src) == f - 1)
            new = slice(slot * t, (slot + 1) * t)
            for i in range(n):
                key, value = kv[2 * i][:, :, j * t:(j + 1) * t], kv[2 * i + 1][:, :, j * t:(j + 1) * t]
                if self.tempcache is not None:
                    value, count = self._merge(i, pre[i][:, :, j * t:(j + 1) * t], value, src if merging else None)
                    self.counts[i][:, :, new] = count
                    with np.errstate(divide="ignore"):  # a position a merge left: count 0, logit -inf
                        self.bias[i][:, :, new] = np.log(count)
                self.buffers[2 * i][:, :, new] = key
                self.buffers[2 * i + 1][:, :, new] = value
            self.slot_frame[slot] = f
            self.length = max(self.length, (slot + 1) * t)

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
            old = slice(src * self.tokens, (src + 1) * self.tokens)
            c = self.counts[i][:, :, old].copy()
            target = tempcache.targets(k_pre, self.last_pre[i], c > 0, self.tempcache, codes, self.last_codes[i])
            value, count, left = tempcache.merge(target, self.buffers[2 * i + 1][:, :, old], c, value)
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


class OrtDiT:
    """The exported (or compiled) step graph and the prompt graph in ONNX Runtime. A compiled step graph
    reads the cache in place: its buffers (RingCache) are bound once through ORT's IO binding, as are the
    outputs, so a denoising step copies no cache bytes."""

    def __init__(self, step_path: str | os.PathLike, text_path: str | os.PathLike | None = None,
                 threads: int = 0):
        import onnx
        import onnxruntime as ort

        step_path = Path(step_path)
        proto = onnx.load(str(step_path), load_external_data=False)
        meta = {p.key: p.value for p in proto.metadata_props}
        if DIT_CONFIG_KEY not in meta or DIT_TEXT_GRAPH_KEY not in meta:  # the prompt graph has the config only
            raise FastCarError(f"{step_path} is not a DiT step graph (no {DIT_TEXT_GRAPH_KEY} metadata); give the "
                               "step graph written by `fastcar-compile export --dit tiny -o dit.onnx`")

        self.cfg: DiTConfig = dit_config_of(meta, str(step_path))
        text_path = Path(text_path) if text_path else step_path.with_name(meta[DIT_TEXT_GRAPH_KEY])
        if not text_path.is_file():
            raise FastCarError(f"{step_path}: its prompt graph {text_path} is missing; export both again")
        self.text_path = text_path
        so = ort.SessionOptions()
        so.log_severity_level = 3
        if threads:
            so.intra_op_num_threads = threads
        self.modes = DiTModes.from_json(meta.get(DIT_MODES_KEY), f"{step_path}'s {DIT_MODES_KEY}")  # compiled in
        self.slot_form = self.modes.tempcache_kernel == TEMPCACHE_SLOTS  # TempCache over the listed resident slots
        if (self.modes.annsa is not None and self.modes.annsa.annsa_kernel == ANNSA_NATIVE) or self.slot_form:
            from fastcar_compile.runtime.native import library_path

            lib = library_path()  # None: the op's function body runs (same result, slower)
            if lib is not None:
                so.register_custom_ops_library(str(lib))
        self.sess = ort.InferenceSession(str(step_path), so, providers=["CPUExecutionProvider"])
        self.text_sess = ort.InferenceSession(str(text_path), so, providers=["CPUExecutionProvider"])
        ins, outs = step_io(self.cfg.layers)
        self.in_place = meta.get(DIT_CACHE_FORM_KEY) == CACHE_IN_PLACE
        self.tau = self.modes.threshold
        self.sim = self.modes.tempcache
        self.annca = self.modes.annca  # its buckets (contract.BucketRecord) or None
        self.cross_pairs = [0, 0]  # query x prompt-token pairs the cross-attention executed, dense pairs (AnnCA)
        self.match = self.modes.tempcache_match or "aligned"  # the correspondence (dit/tempcache.py)
        self.hasher = tempcache.hasher(self.modes, self.cfg.head_dim) if self.sim is not None else None
        self.annsa = self.modes.annsa  # its buckets, local frames and form, or None (passes/dit_annsa.py)
        self.self_pairs: list[int] | None = None  # a list: [executed, dense] q.k pairs over the cache (AnnSA)
        self.replayed = [0, 0]  # FFN rows replayed, rows decided (FastCar compiled in), over the session
        self.tas_log: list[np.ndarray] | None = None  # a list: the eligible rows' TAS of every step (calibration)
        if self.in_place:
            ins = [*ins, PAST_LENGTH]
            if self.annsa is not None:
                form = ANNSA_INPUTS[self.annsa.annsa_kernel]
                ins += [ANNSA_DENSE, *(annsa_io(i)[k] for i in range(self.cfg.layers) for k in form)]
            if self.sim is not None:
                ins += [n for i in range(self.cfg.layers)
                        for n in (tempcache_io(i)[0], *([tempcache_slots_name(i)] if self.slot_form else []))]
            if self.tau is not None:
                ins += [REPLAY_FIRST, *(n for i in range(self.cfg.layers) for n in replay_io(i)[0])]
            if self.annca is not None:
                ins += [annca_io(i)[0] for i in range(self.cfg.layers)]
            from fastcar_compile.runtime.binding import StepBinding

            self.binding = StepBinding(self.sess)
        got = [i.name for i in self.sess.get_inputs()]
        if got != ins:
            raise FastCarError(f"{step_path}: inputs {got[:4]}... are not the DiT step's {ins[:4]}...")
        self.outs = outs
        self.text_outputs = [o.name for o in self.text_sess.get_outputs()]  # what text_kv returns, in order
        want = ins[3 + 2 * self.cfg.layers:3 + 4 * self.cfg.layers]
        if self.annca is not None:
            want += [annca_io(i)[0] for i in range(self.cfg.layers)]
        if self.text_outputs != want:
            raise FastCarError(f"{text_path}: its outputs {self.text_outputs[:3]}... are not what {step_path.name} "
                               f"reads ({want[:3]}...); give the prompt graph written beside it")

    def new_cache(self, layers: int, tokens_per_frame: int, sinks: int, window: int) -> FrameCache | RingCache:
        if self.in_place:
            self.cache = RingCache(layers, tokens_per_frame, sinks, window, tempcache=self.sim, match=self.hasher)
            if self.annsa is not None:  # the keys' bucket ids and the chunk's blocks, beside the ring
                from fastcar_compile.dit.annsa_index import AnnIndex

                self.ann = AnnIndex(self.annsa, layers, tokens_per_frame, sinks, self.cfg.head_dim)
            return self.cache  # kept: its merge counts are the stream's
        return FrameCache(layers, tokens_per_frame, sinks, window)

    def text_kv(self, text_embeds: np.ndarray) -> list[np.ndarray]:
        return self.text_sess.run(None, {"text_embeds": text_embeds.astype(np.float32)})

    def step(self, latent, timestep, frame_start: int, past, cross) -> list[np.ndarray]:
        n = self.cfg.layers
        if self.in_place:
            return self._step_bound(latent, timestep, frame_start, past, cross)
        feed = {"latent": latent, "timestep": timestep, "frame_start": np.array([frame_start], np.int64)}
        feed.update(zip(dit_past_names(n), past, strict=True))
        feed.update(zip(step_io(n)[0][3 + 2 * n:], cross, strict=True))
        return self.sess.run(None, feed)


    def _step_bound(self, latent, timestep, frame_start: int, cache: RingCache, cross) -> list[np.ndarray]:
        """One step on the bound buffers; the outputs are buffers reused by the next step (read them first)."""
        io, n = self.binding, self.cfg.layers
        io.bind_input("latent", np.ascontiguousarray(latent, np.float32))
        io.bind_input("timestep", np.ascontiguousarray(timestep, np.float32))
        io.bind_input("frame_start", np.array([frame_start], np.int64))
        io.bind_input(PAST_LENGTH, np.array([cache.length], np.int64))
        for name, buf in zip(dit_past_names(n), cache.buffers, strict=True):
            io.bind_input(name, buf)  # rebound only when the buffers grew
        for name, a in zip(self.text_outputs, cross, strict=True):  # the prompt's K/V (and AnnCA's key codes)
            io.bind_input(name, a)
        rows, f = latent.shape[0], latent.shape[2]
        cfg = self.cfg
        kv_shape = (rows, cfg.heads, f * cfg.tokens_per_frame, cfg.head_dim)
        out = [io.output_buffer(self.outs[0], latent.shape, np.float32)]
        out += [io.output_buffer(name, kv_shape, np.float32) for name in self.outs[1:]]
        if self.sim is not None:  # log(count) per slot in; the pre-RoPE keys out, after the K/V (RingCache.write)
            for i, bias in enumerate(cache.bias):
                io.bind_input(tempcache_io(i)[0], bias)
                if self.slot_form:  # the resident slots SlotAttention reads (listed once per cache state)
                    io.bind_input(tempcache_slots_name(i), self._resident(cache, i))
            out += [io.output_buffer(tempcache_io(i)[1], kv_shape, np.float32) for i in range(n)]
        kept = [io.output_buffer(annca_io(i)[1], (rows, cfg.heads, f, cross[0].shape[2]), np.bool_)
                for i in range(n)] if self.annca is not None else []
        codes = []
        if self.annsa is not None:  # what the chunk's queries attend to in; their bucket ids out (not returned)
            for name, a in self.ann.inputs(cache, frame_start).items():
                io.bind_input(name, a)
            codes = [io.output_buffer(annsa_io(i)["codes"], (*kv_shape[:3], self.annsa.ann_tables), np.int64)
                     for i in range(n)]
        if self.tau is None:
            io.run()
            self._count_cross(kept)
            self._count_self(codes, cache)
            return out
        key = tuple(np.asarray(timestep)[0].tolist())
        prev = cache.replay.get(key)
        shapes = ((rows, cfg.tokens_per_frame, cfg.hidden), (rows, cfg.heads, cfg.tokens_per_frame, cfg.head_dim))
        io.copy_input(REPLAY_FIRST, np.array([prev is not None and frame_start >= 1]))
        state, masks = [], []
        for i in range(n):
            (in_ffn, in_key), outs, mask = replay_io(i)
            for name, shape, j in ((in_ffn, shapes[0], 0), (in_key, shapes[1], 1)):
                io.copy_input(name, prev[2 * i + j] if prev is not None else np.zeros(shape, np.float32))
            state += [io.output_buffer(name, shape, np.float32) for name, shape in zip(outs, shapes, strict=True)]
            masks.append(io.output_buffer(mask, (rows, f * cfg.tokens_per_frame), np.bool_))
        scores = [io.output_buffer(tas_name(i), (rows, f * cfg.tokens_per_frame), np.float32) for i in range(n)]
        io.run()
        self._count_cross(kept)
        self._count_self(codes, cache)
        if self.tas_log is not None:  # eligible: past the chunk's first frame, or that frame's predecessor held
            first = cfg.tokens_per_frame * (0 if prev is not None and frame_start >= 1 else 1)
            self.tas_log += [t[:, first:].astype(np.float64).ravel() for t in scores]
        cache.replay[key] = [a.copy() for a in state]
        self.replayed[0] += sum(int(m.sum()) for m in masks)
        self.replayed[1] += sum(m.size for m in masks)
        return out


    def _resident(self, cache: RingCache, layer: int) -> np.ndarray:
        """Layer `layer`'s resident slots [B, heads, N] (resident_slots), recomputed only when the cache changed."""
        state = (id(cache), cache.length, cache.merges[1], layer)
        held = getattr(self, "_listed", {})
        if held.get(layer, (None,))[0] != state:
            held[layer] = (state, resident_slots(cache.counts[layer][:, :, :cache.length]))
            self._listed = held
        return held[layer][1]

    def _count_cross(self, kept: list[np.ndarray]) -> None:
        """AnnCA's executed pairs: each frame's queries times the prompt tokens it kept (`annca.N` [B, H, F, L]);
        dense: times every prompt token."""
        if kept:
            self.cross_pairs[0] += sum(int(k.sum()) for k in kept) * self.cfg.tokens_per_frame
            self.cross_pairs[1] += sum(k.size for k in kept) * self.cfg.tokens_per_frame

    def _count_self(self, codes: list[np.ndarray], cache: RingCache) -> None:
        """With `self_pairs` on (a list; it compares every query's ids with every cached key's, so benchmarks
        and tests only): AnnSA's executed q.k pairs (AnnIndex.executed_pairs) and the dense attention's."""
        if codes and self.self_pairs is not None:
            q = int(np.prod(codes[0].shape[:3]))
            self.self_pairs[0] += sum(self.ann.executed_pairs(i, c) for i, c in enumerate(codes))
            self.self_pairs[1] += len(codes) * q * (cache.length + codes[0].shape[2])


class TorchDiT:
    """The eager model behind the same interface (NumPy in and out; torch.from_numpy shares memory)."""

    def __init__(self, model, threads: int = 0):
        import torch

        self.model, self.cfg, self.torch = model, model.cfg, torch
        if threads:
            torch.set_num_threads(threads)

    def text_kv(self, text_embeds: np.ndarray) -> list[np.ndarray]:
        with self.torch.no_grad():
            return [t.numpy() for t in self.model.text_kv(self.torch.from_numpy(text_embeds.astype(np.float32)))]

    def step(self, latent, timestep, frame_start: int, past, cross) -> list[np.ndarray]:
        torch = self.torch
        with torch.no_grad():
            out = self.model(torch.from_numpy(latent), torch.from_numpy(timestep),
                             torch.tensor([frame_start], dtype=torch.int64),
                             *(torch.from_numpy(a) for a in past), *(torch.from_numpy(a) for a in cross))
        return [t.numpy() for t in out]


@dataclass
class StreamSettings:
    frames: int
    seed: int = 0
    cfg_scale: float = 3.0  # 1: no guidance, one row
    steps: tuple[float, ...] = STEPS
    sink_frames: int | None = None  # None: the model config's
    window_frames: int | None = None


@dataclass
class ChunkResult:
    first_frame: int
    frames: np.ndarray  # [C, F, H, W] clean latent frames
    seconds: float
    resident: list[int] = field(default_factory=list)
    cache_bytes: int = 0  # the K/V held after this chunk's write


def prompt_rows(cfg: DiTConfig, text: np.ndarray | None, guided: bool, seed: int) -> np.ndarray:
    """Text embedding rows [B, L, text_dim]: the prompt (seeded random when none given) and, with CFG, an
    all-zero unconditional row."""
    if text is None:
        text = np.random.default_rng(seed + 7919).standard_normal((cfg.text_len, cfg.text_dim)).astype(np.float32)
    text = np.asarray(text, np.float32)[None]
    return np.concatenate([text, np.zeros_like(text)]) if guided else text


def rollout(model, settings: StreamSettings, text: np.ndarray | None = None,
            ) -> Iterator[ChunkResult]:
    """Generate `settings.frames` latent frames chunk by chunk with `model` (OrtDiT or TorchDiT)."""
    cfg = model.cfg
    guided = settings.cfg_scale != 1.0
    cross = model.text_kv(prompt_rows(cfg, text, guided, settings.seed))
    # a backend with its own cache (a compiled graph's ring, the FAST-AR runtime of dit/fastar.py) makes it
    new_cache = getattr(model, "new_cache", FrameCache)
    cache = new_cache(cfg.layers, cfg.tokens_per_frame,
                      cfg.sink_frames if settings.sink_frames is None else settings.sink_frames,
                      cfg.window_frames if settings.window_frames is None else settings.window_frames)
    rng = np.random.default_rng(settings.seed)
    for start in range(0, settings.frames, cfg.chunk_frames):
        yield generate_chunk(model, settings, start, cache, cross, rng)


def generate_chunk(model, settings: StreamSettings, start: int, cache, cross: list[np.ndarray],
                   rng: np.random.Generator) -> ChunkResult:
    """One chunk of the rollout at frame `start` over `cache` (which then holds its K/V): the denoising steps
    from the rng's noise, then the clean pass whose K/V are written. `cross`: the prompt rows' K/V (text_kv)."""
    cfg = model.cfg
    rows = cross[0].shape[0]
    guided = settings.cfg_scale != 1.0
    f = cfg.chunk_frames
    shape = (1, cfg.in_channels, f, cfg.latent_h, cfg.latent_w)
    t0 = time.perf_counter()
    past = cache.past(rows, cfg.heads, cfg.head_dim)
    x = rng.standard_normal(shape).astype(np.float32)
    x0 = x
    for i, t in enumerate(settings.steps):
        v = model.step(np.repeat(x, rows, 0), np.full((rows, f), t, np.float32), start, past, cross)[0]
        v = v[:1] + settings.cfg_scale * (v[:1] - v[1:]) if guided else v
        sigma = t / 1000.0
        x0 = x - sigma * v
        if i + 1 < len(settings.steps):
            nxt = settings.steps[i + 1] / 1000.0
            x = ((1 - nxt) * x0 + nxt * rng.standard_normal(shape)).astype(np.float32)
    x0 = x0.astype(np.float32)
    out = model.step(np.repeat(x0, rows, 0), np.zeros((rows, f), np.float32), start, past, cross)
    cache.write(start, out[1:])
    return ChunkResult(start, x0[0], time.perf_counter() - t0, cache.resident, cache.nbytes)


def rss_mib() -> float:
    """This process's resident memory (Linux VmRSS), MiB."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def preview(frames: np.ndarray, scale: int = 8) -> list[np.ndarray]:
    """RGB uint8 pictures of latent frames [C, N, H, W] (no VAE here: the first three channels, each
    normalised over the whole video, upsampled `scale` x as the VAE's 8x8 spatial compression would)."""
    c = frames[:3] if frames.shape[0] >= 3 else np.repeat(frames[:1], 3, 0)
    lo = c.min(axis=(1, 2, 3), keepdims=True)
    hi = c.max(axis=(1, 2, 3), keepdims=True)
    img = ((c - lo) / np.maximum(hi - lo, 1e-8) * 255).astype(np.uint8)  # [3, N, H, W]
    img = img.transpose(1, 2, 3, 0).repeat(scale, 1).repeat(scale, 2)
    return list(img)
