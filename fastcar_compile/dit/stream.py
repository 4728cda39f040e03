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
    TEXT_INPUT,
    DiTConfig,
    DiTModes,
    annca_io,
    annsa_io,
    dit_config_of,
    dit_past_names,
    dit_text_graph_name,
    replay_io,
    step_io,
    tas_name,
    tempcache_io,
    tempcache_slots_name,
)
from fastcar_compile.core.errors import FastCarError
from fastcar_compile.dit.cache import FrameCache, RingCache
from fastcar_compile.fastar.config import hasher_of

STEPS = (1000.0, 750.0, 500.0, 250.0)  # flow-matching timesteps of a 4-step distilled sampler


class OrtDiT:
    """The exported (or compiled) step graph and the prompt graph in ONNX Runtime. A compiled step graph
    reads the cache in place: its buffers (RingCache) are bound once through ORT's IO binding, as are the
    outputs, so a denoising step copies no cache bytes."""

    def __init__(self, step_path: str | os.PathLike, text_path: str | os.PathLike | None = None,
                 threads: int = 0):
        meta = self._open(Path(step_path), text_path, threads)
        self.in_place = meta.get(DIT_CACHE_FORM_KEY) == CACHE_IN_PLACE
        self.tau = self.modes.threshold
        self.sim = self.modes.tempcache
        self.annca = self.modes.annca  # its buckets (contract.BucketRecord) or None
        self.cross_pairs = [0, 0]  # query x prompt-token pairs the cross-attention executed, dense pairs (AnnCA)
        self.match = self.modes.tempcache_match or "aligned"  # the correspondence (dit/tempcache.py)
        buckets = self.modes.tempcache_buckets  # the top-1 match's bucketing (None: aligned)
        self.hasher = hasher_of(buckets, self.cfg.head_dim) if self.sim is not None and buckets is not None else None
        self.annsa = self.modes.annsa  # its buckets, local frames and form, or None (passes/dit_annsa.py)
        self.self_pairs: list[int] | None = None  # a list: [executed, dense] q.k pairs over the cache (AnnSA)
        self.replayed = [0, 0]  # FFN rows replayed, rows decided (FastCar compiled in), over the session
        self.tas_log: list[np.ndarray] | None = None  # a list: the eligible rows' TAS of every step (calibration)
        self._check_io(Path(step_path))

    def _open(self, step_path: Path, text_path: str | os.PathLike | None, threads: int) -> dict[str, str]:
        """The step graph's config and modes (its metadata, returned) and the two sessions (runtime/loader.py:
        the native kernels registered where the graph has AnnSA's native op)."""
        import onnx

        from fastcar_compile.runtime import loader

        proto = onnx.load(str(step_path), load_external_data=False)
        meta = {p.key: p.value for p in proto.metadata_props}
        if DIT_CONFIG_KEY not in meta or DIT_TEXT_GRAPH_KEY not in meta:  # the prompt graph has the config only
            raise FastCarError(f"{step_path} is not a DiT step graph (no {DIT_TEXT_GRAPH_KEY} metadata); give the "
                               "step graph written by `fastcar-compile export --dit tiny -o dit.onnx`")
        self.cfg: DiTConfig = dit_config_of(meta, str(step_path))
        text_path = Path(text_path) if text_path else step_path.with_name(dit_text_graph_name(meta, str(step_path)))
        if not text_path.is_file():
            raise FastCarError(f"{step_path}: its prompt graph {text_path} is missing; export both again")
        self.text_path = text_path
        self.modes = DiTModes.from_json(meta.get(DIT_MODES_KEY), f"{step_path}'s {DIT_MODES_KEY}")  # compiled in
        # the native library only for AnnSA's op and TempCache's SlotAttention (None: when built; else the op's
        # function body runs: same result, slower)
        self.slot_form = self.modes.tempcache_kernel == TEMPCACHE_SLOTS  # TempCache over the listed resident slots
        native = None if (self.modes.annsa is not None and self.modes.annsa.annsa_kernel == ANNSA_NATIVE) or \
            self.slot_form else False
        self.sess, self.text_sess = (
            loader.open_session(path, loader.session_options(threads, mem_pattern=True), native=native,
                                plain_inputs=False)[0]
            for path in (step_path, text_path))
        return meta

    def _check_io(self, step_path: Path) -> None:
        """The inputs the runtime feeds (the compiled modes' included) and the prompt graph's outputs, refused in
        one line when the graphs do not have them; the IO binding of a step graph that reads its cache in place."""
        ins, outs = step_io(self.cfg.layers)
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
            raise FastCarError(f"{self.text_path}: its outputs {self.text_outputs[:3]}... are not what "
                               f"{step_path.name} reads ({want[:3]}...); give the prompt graph written beside it")
        if not self.in_place and not self.modes.dense:
            raise FastCarError(f"{step_path}: its metadata records compiled modes but the graph is not in the compiled "
                               "form (its cache is not read in place); compile the exported graph again")
        self._check_shapes(step_path, self.text_path)

    def _check_shapes(self, step_path: Path, text_path: Path) -> None:
        """The graphs' static input dims against the config their metadata records (a config edited apart from its
        graph would fail deep in ONNX Runtime, or allocate for shapes the graph never takes)."""
        c = self.cfg
        want = {"latent": [None, c.in_channels, c.chunk_frames, c.latent_h, c.latent_w],
                **{n: [None, c.heads, None, c.head_dim] for n in dit_past_names(c.layers)}}
        got = {i.name: i.shape for i in self.sess.get_inputs()}
        got.update({i.name: i.shape for i in self.text_sess.get_inputs()})
        want[TEXT_INPUT] = [None, None, c.text_dim]
        for name, dims in want.items():
            shape = got.get(name)
            if shape is None:
                continue
            bad = [(w, g) for w, g in zip(dims, shape, strict=False) if w is not None and isinstance(g, int) and g != w]
            if bad or len(shape) != len(dims):
                raise FastCarError(f"{step_path if name != TEXT_INPUT else text_path}: input {name} has shape {shape}, "
                                   f"not the {dims} its config ({DIT_CONFIG_KEY}) says; export the graph again")

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
                    io.bind_input(tempcache_slots_name(i), cache.resident_slots(i))
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
    from fastcar_compile.dit.config import check_stream_memory

    cfg = model.cfg
    guided = settings.cfg_scale != 1.0
    sinks = cfg.sink_frames if settings.sink_frames is None else settings.sink_frames
    window = cfg.window_frames if settings.window_frames is None else settings.window_frames
    check_stream_memory(cfg, min(settings.frames, sinks + window) if window else settings.frames,
                        2 if guided else 1, "the DiT")
    cross = model.text_kv(prompt_rows(cfg, text, guided, settings.seed))
    # a backend with its own cache (a compiled graph's ring, the FAST-AR runtime of dit/fastar.py) makes it
    new_cache = getattr(model, "new_cache", FrameCache)
    cache = new_cache(cfg.layers, cfg.tokens_per_frame,
                      cfg.sink_frames if settings.sink_frames is None else settings.sink_frames,
                      cfg.window_frames if settings.window_frames is None else settings.window_frames)
    rng = np.random.default_rng(settings.seed)
    for start in range(0, settings.frames, cfg.chunk_frames):
        chunk = generate_chunk(model, settings, start, cache, cross, rng)
        if not np.isfinite(chunk.frames).all():  # a blank video is not a result
            raise FastCarError(f"the stream's frames {start}-{start + chunk.frames.shape[1] - 1} hold NaN or infinity "
                               f"(CFG scale {settings.cfg_scale:g}, the prompt's values or the weights overflow "
                               "float32); lower --cfg or check the prompt and weights")
        yield chunk


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
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow is refused by rollout, in one line
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
