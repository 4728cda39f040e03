"""TempCache and FastCar on the PyTorch DiT: `fast = fastcar_compile.torch.apply_dit(model, threshold=0.5,
tempcache=0.9)`.

The DiT step (dit/model.ChunkDiT) takes its cache as tensors; these modes change what the cache is (merged
slots with a count and a log(count) logit term) and add state across chunks (the replay cache), so the
returned `FastCarDiT` owns both as tensors on the model's device. Its cache keeps the last written frame
positional, as the compiled step graph's buffers do: per layer one key/value/count tensor whose last T tokens are
that frame's positions. With TempCache 'aligned' a written token merges into the slot at its own (h, w) one
frame back; that slot always sits at the previous frame's position (a merge moves it to the new frame's
position, leaving a dead slot of count 0 behind), so a merge is a masked update of the last frame's positions,
never a search; the same write compacts the dead slots out of the older frames, so they cost neither memory
nor attention work beyond the padding that evens out the heads (ModeCache).
FastCar's TAS and replay are dit/fastar.py's definitions (`temporal_scores`, `replay_ffn`: only the computed
rows go through the FFN), with the replay cache (per denoising step and layer, the last frame's FFN output
and key) held here. The eager stream runtime (dit/fastar.FastARDiT, slot lists) is the reference.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fastcar_compile.core.errors import FastCarError
from fastcar_compile.dit import modes, tempcache
from fastcar_compile.dit.cache import StreamCache
from fastcar_compile.dit.fastar import LayerStats, block_inputs, replay_ffn, temporal_scores, totals
from fastcar_compile.dit.model import ChunkDiT

SUPPORTED = ("tempcache", "tempcache_match", "threshold")  # of dit/modes.DIT_OPTIONS
TEMPCACHE = ("aligned",)  # the correspondents it takes (tempcache_match)


class ModeCache(StreamCache):
    """One video's state: per layer the resident slots (key post-RoPE, value, count; count 0 = a dead slot) and,
    with TempCache, the frame each slot sits at (its newest member's: what eviction reads); the last written
    frame's pre-RoPE keys (TempCache's comparison); the replay cache (timesteps -> layer -> (FFN output, key)).

    Layout [B, H, slots, ...]: the older frames' live slots in frame order, then the last frame's T positions
    (`tail`: merges target them in place). Heads merge different tokens, so each (row, head) keeps its own
    live slots and all are padded to the fullest one with dead slots (count 0, masked by the -inf logit): one
    dense tensor that SDPA and the mask read as before, never more keys than the eager runtime's slot lists
    hold (dit/fastar.SlotCache pads the same way). A ragged per-(row, head) layout would drop the padding too
    but needs a varlen attention kernel per device. `compact=False` keeps dead slots until their frame leaves
    (the uncompacted layout, kept for measurements)."""

    def __init__(self, tokens: int, sinks: int, window: int, tempcache: float | None = None, layers: int = 0,
                 compact: bool = True):
        super().__init__(layers, tokens, sinks, window)
        self.tempcache = tempcache  # SIM (None: TempCache off)
        self.compact = compact
        self.frames: list[int] = []
        self.tail: int | None = None  # the frame whose T positions end every layer's tensors
        self.key: list[torch.Tensor] = []  # [B, H, slots, d]
        self.value: list[torch.Tensor] = []
        self.count: list[torch.Tensor] = []  # [B, H, slots] int64
        self.slot_frame: list[torch.Tensor] = []  # [B, H, slots] int32, TempCache only (-1: padding)
        self.last_pre: list[torch.Tensor] = []  # [B, H, T, d]
        self.replay: dict = {}
        self.stats = [LayerStats() for _ in range(layers)]

    # the stream loop's cache interface (dit/stream.rollout): the module reads its own state
    def past(self, batch: int, heads: int, head_dim: int) -> ModeCache:
        return self

    @property
    def resident(self) -> list[int]:
        return list(self.frames)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (*self.key, *self.value, *self.slot_frame)) + \
            sum(c.nbytes for c in self.count) * (self.tempcache is not None)

    def bias(self, i: int) -> torch.Tensor:
        """log(count) per slot of layer i [B, H, slots], -inf for a dead one (the TempCache lemma's term)."""
        c = self.count[i].to(self.key[i].dtype)
        return torch.where(c > 0, torch.log(c.clamp(min=1)), torch.full_like(c, -math.inf))

    def per_layer(self, kv: list) -> list[tuple]:
        return [(k_post, v, k_pre) for k_post, k_pre, v in kv]

    def write_frame(self, frame: int, layers: list[tuple]) -> None:
        """Append a frame's slots: with TempCache a token whose pre-RoPE key's cosine with the aligned token one
        frame back exceeds SIM merges into that slot (dit/tempcache.merge_positional: newest key, running mean
        value, count + 1, the old position dead); the previous frame then joins the older ones, so its dead
        slots are compacted out. Sink frames never merge."""
        T = self.tokens
        merging = self.tempcache is not None and frame - 1 >= self.sinks and self.tail == frame - 1
        for i, (kp, vv, kr) in enumerate(layers):
            if len(self.key) <= i:  # a new video's layer
                B, H, _, d = kp.shape
                self.key.append(kp.new_zeros(B, H, 0, d))
                self.value.append(vv.new_zeros(B, H, 0, d))
                self.count.append(torch.zeros(B, H, 0, dtype=torch.int64, device=kp.device))
                if self.tempcache is not None:
                    self.slot_frame.append(torch.zeros(B, H, 0, dtype=torch.int32, device=kp.device))
                self.last_pre.append(kr.new_zeros(B, H, 0, d))
            cnt = torch.ones(kp.shape[:3], dtype=torch.int64, device=kp.device)
            st = self.stats[i]
            if merging:
                old_c = self.count[i][:, :, -T:]
                target = tempcache.targets(kr, self.last_pre[i], old_c > 0, self.tempcache)
                vv, cnt, self.count[i][:, :, -T:] = tempcache.merge_positional(target, self.value[i][:, :, -T:],
                                                                               old_c, vv)
                st.merges += int((target >= 0).sum())
                st.merges_aligned += int((target >= 0).sum())
            if merging and self.compact:
                self._select(i, self.count[i] > 0, 0)
            st.written += cnt.numel()
            self.key[i] = torch.cat([self.key[i], kp], 2)
            self.value[i] = torch.cat([self.value[i], vv], 2)
            self.count[i] = torch.cat([self.count[i], cnt], 2)
            if self.tempcache is not None:
                self.slot_frame[i] = torch.cat([self.slot_frame[i], torch.full_like(cnt, frame, dtype=torch.int32)], 2)
            self.last_pre[i] = kr
        self.frames.append(frame)
        self.tail = frame

    def _select(self, i: int, keep: torch.Tensor, tail: int) -> None:
        """Layer i keeps, of the slots before its last `tail` tokens, those where keep [B, H, slots - tail] holds
        (in order, each (row, head) padded to the fullest with dead slots); the tail stays as it is."""
        n_old = keep.shape[-1]
        n = int(keep.sum(-1).max()) if keep.numel() else 0
        if n == n_old:  # nothing to give back: the slots left are only marked dead
            order, ok = None, keep
        else:
            order = torch.argsort((~keep).to(torch.int8), dim=-1, stable=True)[..., :n]
            ok = keep.gather(-1, order)

        def take(a: torch.Tensor, fill: int | None = None) -> torch.Tensor:
            head = a[:, :, :n_old]
            if order is not None:
                head = head.gather(2, order if a.dim() == 3 else order[..., None].expand(-1, -1, -1, a.shape[-1]))
            if fill is not None:
                head = torch.where(ok, head, torch.full_like(head, fill))
            return torch.cat([head, a[:, :, n_old:]], 2)

        if order is not None:
            self.key[i], self.value[i] = take(self.key[i]), take(self.value[i])
        self.count[i], self.slot_frame[i] = take(self.count[i], 0), take(self.slot_frame[i], -1)

    def evict(self, keep: set[int] | None) -> None:
        """The frames outside the sinks and the window leave (with TempCache: the slots sitting at them, the
        dead ones too where they were kept); the resident counters."""
        T = self.tokens
        if keep is not None and any(f not in keep for f in self.frames):
            if self.tempcache is None:  # positional: whole frames
                pos = torch.tensor([p for n, f in enumerate(self.frames) if f in keep
                                    for p in range(n * T, (n + 1) * T)], dtype=torch.int64, device=self.key[0].device)
                for i in range(len(self.key)):
                    self.key[i] = self.key[i].index_select(2, pos)
                    self.value[i] = self.value[i].index_select(2, pos)
                    self.count[i] = self.count[i].index_select(2, pos)
            else:
                tail = T if self.tail in keep else 0
                frames = torch.tensor(sorted(keep), dtype=self.slot_frame[0].dtype, device=self.slot_frame[0].device)
                for i in range(len(self.key)):
                    fr = self.slot_frame[i][:, :, :self.count[i].shape[2] - tail]
                    kept = torch.isin(fr, frames)
                    self._select(i, kept & (self.count[i][:, :, :fr.shape[2]] > 0) if self.compact else kept, tail)
            self.frames = [f for f in self.frames if f in keep]
            self.tail = self.tail if self.tail in keep else None
        for i, st in enumerate(self.stats):
            st.resident_slots = int((self.count[i] > 0).sum())
            st.dense_slots = self.count[i].shape[0] * self.count[i].shape[1] * T * len(self.frames)


class FastCarDiT(nn.Module):
    """A ChunkDiT with TempCache and/or FastCar, owning its cache. Per chunk: `forward(latent, timestep,
    frame_start, *cross)` for each denoising step (the cache read, nothing written), then the clean pass's
    presents to `write(frame_start, presents)`. `reset()` starts a new video. The modes' settings are
    dit/modes.py's (`settings`); `sinks` / `window` the cache's residency (the model config's by default).
    `compact_cache = False` before a new video keeps TempCache's dead slots (ModeCache: measurements only)."""

    compact_cache = True

    def __init__(self, model: ChunkDiT, settings, sinks: int, window: int):
        super().__init__()
        self.model = model
        self.cfg = model.cfg
        self.settings = settings
        self.sinks, self.window = sinks, window
        self.cache = self.new_cache(self.cfg.layers, self.cfg.tokens_per_frame, sinks, window)

    def new_cache(self, layers: int, tokens: int, sinks: int, window: int) -> ModeCache:
        """A new video (also the stream loop's hook: dit/stream.rollout calls it)."""
        s = self.settings
        self.cache = ModeCache(tokens, sinks, window, tempcache=s.tempcache, layers=layers, compact=self.compact_cache)
        return self.cache

    def reset(self) -> None:
        self.new_cache(self.cfg.layers, self.cfg.tokens_per_frame, self.sinks, self.window)

    @property
    def stats(self) -> dict:
        """Replay and merge ratios, resident vs dense slots, summed over layers (dit/fastar.LayerStats)."""
        return totals(self.cache.stats)

    def write(self, frame_start: int, presents: list) -> None:
        self.cache.write(int(frame_start), presents)

    @torch.no_grad()
    def forward(self, latent: torch.Tensor, timestep: torch.Tensor, frame_start, *cross: torch.Tensor
                ) -> tuple[torch.Tensor, list]:
        """latent [B, C, F, H, W], timestep [B, F], frame_start (int: the chunk's first frame), cross =
        cross.N.key|value. Returns (velocity, presents: per layer (key post-RoPE, key pre-RoPE, value))."""
        m, c = self.model, self.cache
        frame_start = int(frame_start)
        x, t, e, cos, sin = m.embed(latent, timestep, torch.tensor([frame_start], device=latent.device))
        key = tuple(timestep[0].tolist())
        prev, now = c.replay.get(key, {}), {}
        presents = []
        for i, blk in enumerate(m.blocks):
            x, kv = self._block(i, blk, x, e, cos, sin, cross[2 * i], cross[2 * i + 1], frame_start, prev.get(i),
                                now)
            presents.append(kv)
        if self.settings.threshold is not None:
            c.replay[key] = now
        return m.final(x, t), presents

    def _block(self, i, blk, x, e, cos, sin, ck, cv, frame_start, prev, now):
        """model.Block.forward over the cache (+ log(count) with TempCache) and with FastCar's FFN. The self-
        attention counters are the eager runtime's: pairs with a live slot or the chunk vs the dense cache's."""
        c, cfg = self.cache, self.cfg
        b, s, d = x.shape
        fr, T, H = e.shape[1], cfg.tokens_per_frame, cfg.heads
        mod, modulate, gate, q, k, k_pre, v = block_inputs(blk, x, e, cos, sin)
        c.stats[i].sa_executed += b * H * s * s + s * (c.stats[i].resident_slots if i < len(c.key) else 0)
        c.stats[i].sa_dense += b * H * s * (T * len(c.frames) + s)
        if i < len(c.key):
            keys, vals = torch.cat([c.key[i], k], 2), torch.cat([c.value[i], v], 2)
            mask = None
            if c.tempcache is not None:
                mask = torch.cat([c.bias(i), k.new_zeros(b, H, s)], 2)[:, :, None]
            att = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask)
        else:
            att = F.scaled_dot_product_attention(q, k, v)
        x = x + gate(blk.o(att.transpose(1, 2).flatten(2)), mod[2])
        cq = blk.heads_first(blk.norm_cq(blk.cq(blk.norm3(x))))
        x = x + blk.co(F.scaled_dot_product_attention(cq, ck, cv).transpose(1, 2).flatten(2))
        xm = modulate(blk.norm2(x), mod[3], mod[4])
        tau = self.settings.threshold
        if tau is None:
            ffn = blk.ffn(xm)
        else:
            tas, eligible = temporal_scores(q, k, T, prev[1] if prev is not None else None, frame_start)
            out, replay = replay_ffn(blk.ffn, xm.view(b, fr, T, d), tas, eligible, tau,
                                     prev[0] if prev is not None else None)
            now[i] = (out[:, -1].clone(), k.view(b, H, fr, T, -1)[:, :, -1].clone())
            ffn = out.view(b, s, d)
            c.stats[i].ffn_rows += b * s
            c.stats[i].ffn_replayed += int(replay.sum())
        x = x + gate(ffn, mod[5])
        return x, (k, k_pre.transpose(1, 2), v)

    # the stream loop's backend interface (NumPy in and out, as dit/stream.TorchDiT)
    def text_kv(self, text_embeds: np.ndarray) -> list[np.ndarray]:
        dev = next(self.model.parameters()).device
        with torch.no_grad():
            return [a.cpu().numpy() for a in self.model.text_kv(torch.from_numpy(text_embeds.astype(np.float32))
                                                                .to(dev))]

    def step(self, latent, timestep, frame_start: int, past, cross) -> list:
        dev = next(self.model.parameters()).device
        vel, presents = self(torch.from_numpy(latent).to(dev), torch.from_numpy(timestep).to(dev), frame_start,
                             *(torch.from_numpy(a).to(dev) for a in cross))
        return [vel.cpu().numpy(), *presents]


def apply_dit(model, *, sinks: int | None = None, window: int | None = None, latent: tuple[int, int] | None = None,
              chunk_frames: int | None = None, **options) -> FastCarDiT:
    """TempCache and/or FastCar on a ChunkDiT or a diffusers `WanTransformer3DModel` (never modified; a diffusers
    transformer is mapped by dit/checkpoints' table onto a ChunkDiT sharing its tensors, for chunk-by-chunk
    rollout with a KV cache). Options: dit/modes.py's `tempcache` (SIM; None = no merging), `tempcache_match`
    ('aligned'), `threshold` (a TAS threshold; None = no replay); all off is the dense model. `sinks` / `window`: frames the cache keeps (the
    model config's by default); `latent` (H, W) and `chunk_frames`: the stream's geometry, which a diffusers
    transformer does not hold (Wan2.1-480p's 60x104 and 3 by default)."""
    if type(model).__name__ == "WanTransformer3DModel":
        from fastcar_compile.dit.checkpoints import from_module

        geometry = {k: v for k, v in (("chunk_frames", chunk_frames), ("sink_frames", sinks),
                                      ("window_frames", window)) if v is not None}
        if latent is not None:
            geometry.update(latent_h=int(latent[0]), latent_w=int(latent[1]))
        model = from_module(model, geometry)
    elif latent is not None or chunk_frames is not None:
        raise FastCarError("apply_dit: latent / chunk_frames are a diffusers transformer's stream geometry; a "
                           "ChunkDiT has them in its config")
    if not isinstance(model, ChunkDiT):
        raise FastCarError(f"apply_dit takes a fastcar_compile.dit.model.ChunkDiT or a diffusers "
                           f"WanTransformer3DModel, got {type(model).__name__}; for a transformers decoder use "
                           "fastcar_compile.torch.apply")
    bad = sorted(set(options) - set(SUPPORTED))
    if bad and modes.RENAMED.get(bad[0]) in SUPPORTED:
        raise FastCarError(f"apply_dit: {bad[0]!r}: renamed: use {modes.RENAMED[bad[0]]}")
    if bad:
        raise FastCarError(f"apply_dit: {bad[0]!r} is not supported on the PyTorch DiT (it takes "
                           f"{', '.join(SUPPORTED)}); the stream's eager runtime runs the other modes")
    s = modes.settings(**options)
    if s.tempcache_match not in TEMPCACHE:
        raise FastCarError(f"apply_dit: tempcache_match={s.tempcache_match!r} is not supported on the PyTorch DiT "
                           f"(only {', '.join(map(repr, TEMPCACHE))}); the stream's eager runtime runs the ANN match")
    cfg = model.cfg
    return FastCarDiT(model, s, cfg.sink_frames if sinks is None else sinks,
                      cfg.window_frames if window is None else window)


__all__ = ["FastCarDiT", "ModeCache", "apply_dit"]
