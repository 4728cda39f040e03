"""FAST-AR and FastCar in the DiT stream (eager PyTorch): TempCache at cache-write time, AnnSA over the cache,
AnnCA on the cross-attention, FFN replay by TAS, with density / recall / resident KV per layer.

`FastARDiT` is a stream backend (dit/stream.rollout runs it like TorchDiT); it keeps its own cache
(`FastARState`, made by `new_cache`): per layer a `SlotCache` whose slots may hold several merged tokens.
Semantics (docs/dit.md, "FAST-AR on the DiT"):
- TempCache: when a frame is written, each token's pre-RoPE key is compared with its correspondent among the
  previous frame's slots ('aligned': the slot of the same (h, w); 'lsh'/'int8': the best cosine among those
  sharing a bucket); above SIM it merges: the slot keeps the newest key (post-RoPE at its own position),
  the running mean of the values, count + 1, and attention adds log(count) to its logit. Sink frames never
  merge. Tokens of one frame are matched against the cache as it was before that frame (several may join one
  slot: the last in raster order gives the key), so a frame is one vectorised step; the NumPy reference
  (fastar/cache.py) appends token by token, which is the same wherever no two tokens pick one slot.
- AnnSA: the chunk's queries attend densely to the chunk, the sink frames and the `annsa_local` most recent
  cached frames; the other slots only where query and (post-RoPE) key share a bucket in a table, computed
  block-sparse: per table, each occupied bucket's keys and queries gathered into one block (dit/sparse.py).
- AnnCA: per frame of the chunk, a prompt token is attended only if a query of that frame shares a bucket.
- FastCar: TAS = mean over heads of q . k(one frame back, same (h, w)) / sqrt(d) (post-RoPE, as attention uses
  them; the previous chunk's last frame at the same timestep for a chunk's first frame); TAS > tau replays
  that frame's FFN output; only the other rows go through the FFN. Frame 0 never replays.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from fastcar_compile.dit import modes, sparse, tempcache
from fastcar_compile.dit.cache import FrameCache, StreamCache, kept_frames
from fastcar_compile.dit.model import apply_rope
from fastcar_compile.dit.stream import TorchDiT

DEAD = torch.iinfo(torch.int64).max  # slot id of an empty padding slot (sorts last)
COMPONENTS = ("self_attention", "cross_attention", "ffn", "cache_write")  # timed parts (component speed-ups)


@dataclass
class LayerStats:
    """Counts summed over a stream (pairs are per (row, head, query)); recall sums need --diagnostics."""

    sa_executed: int = 0
    sa_dense: int = 0
    sa_recall_sum: float = 0.0
    sa_queries: int = 0
    ca_executed: int = 0
    ca_dense: int = 0
    ca_kept_sum: float = 0.0
    ca_queries: int = 0
    ffn_rows: int = 0
    ffn_replayed: int = 0
    written: int = 0
    merges: int = 0
    merges_aligned: int = 0  # ANN-matched merges whose slot is the aligned one
    resident_slots: int = 0  # after the last write, all rows and heads
    dense_slots: int = 0  # what the uncompressed cache holds then
    resident_bytes: int = 0
    dense_bytes: int = 0

    def summary(self) -> dict:
        def ratio(a, b):
            return a / b if b else None

        return {"self_density": ratio(self.sa_executed, self.sa_dense),
                "self_recall": ratio(self.sa_recall_sum, self.sa_queries),
                "cross_density": ratio(self.ca_executed, self.ca_dense),
                "cross_recall": ratio(self.ca_kept_sum, self.ca_queries),
                "replay_ratio": ratio(self.ffn_replayed, self.ffn_rows),
                "merge_ratio": ratio(self.merges, self.written),
                "merges_aligned_share": ratio(self.merges_aligned, self.merges),
                "kv_density": ratio(self.resident_slots, self.dense_slots),
                "resident_kv_bytes": self.resident_bytes, "dense_kv_bytes": self.dense_bytes}


class SlotCache:
    """One layer's self-attention cache for G = rows x heads groups: live slots first in each group, in
    creation order, padded to a common capacity with dead slots (id DEAD, count 0). A slot's id is the index
    frame * T + s of the token that created it; `token_sid[f]` [G, T] maps each token of frame f to the id of
    the slot holding it."""

    def __init__(self, groups: int, tokens: int, head_dim: int, tables: int, tables_pre: int):
        self.G, self.T = groups, tokens
        z = torch.zeros(groups, 0, head_dim)
        self.k_post, self.k_pre, self.v = z, z.clone(), z.clone()
        self.count = torch.zeros(groups, 0, dtype=torch.int64)
        self.frame = torch.zeros(groups, 0, dtype=torch.int64)
        self.sid = torch.zeros(groups, 0, dtype=torch.int64)
        self.codes = torch.zeros(groups, 0, tables, dtype=torch.int64)  # post-RoPE keys: AnnSA
        self.codes_pre = torch.zeros(groups, 0, tables_pre, dtype=torch.int64)  # pre-RoPE keys: TempCache's match
        self.token_sid: dict[int, torch.Tensor] = {}
        self.merged = False  # TempCache on: slots carry a count

    @property
    def live(self) -> torch.Tensor:
        return self.count > 0

    def positions(self, sids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(position, found) of slot ids [G, n] in this layout (ids are sorted in each group)."""
        if self.sid.shape[1] == 0:
            z = torch.zeros_like(sids)
            return z, z.bool()
        pos = torch.searchsorted(self.sid, sids).clamp(max=self.sid.shape[1] - 1)
        return pos, self.sid.gather(1, pos) == sids

    # --- writing ----------------------------------------------------------------------------------------------
    def aligned_targets(self, f: int, k_pre: torch.Tensor, sim: float, sinks: int) -> torch.Tensor:
        """[G, T] position of the slot holding token (f-1, s) where TempCache merges key s into it, else -1."""
        prev = self.token_sid.get(f - 1)
        if prev is None or f - 1 < sinks:
            return torch.full((self.G, self.T), -1, dtype=torch.int64)
        pos, found = self.positions(prev)
        ok = found & (self.count.gather(1, pos) > 0)
        cand = self.k_pre.gather(1, pos[..., None].expand(-1, -1, k_pre.shape[-1]))
        return torch.where(tempcache.targets(k_pre, cand, ok, sim) >= 0, pos, torch.full_like(pos, -1))

    def ann_targets(self, f: int, k_pre: torch.Tensor, codes_pre: torch.Tensor, sim: float, sinks: int
                    ) -> torch.Tensor:
        """[G, T] position of the best-cosine slot of frame f-1 sharing a bucket with each key (> sim; ties: the
        later slot), else -1."""
        out = torch.full((self.G, self.T), -1, dtype=torch.int64)
        cand = self.live & (self.frame == f - 1)
        if f - 1 < sinks or not bool(cand.any()):
            return out
        idx = torch.argsort((~cand).to(torch.int8), dim=1, stable=True)[:, :int(cand.sum(1).max())]  # in slot order
        e = idx[..., None]
        pick = tempcache.targets(k_pre, self.k_pre.gather(1, e.expand(-1, -1, k_pre.shape[-1])), cand.gather(1, idx),
                                 sim, codes_pre, self.codes_pre.gather(1, e.expand(-1, -1, codes_pre.shape[-1])))
        return torch.where(pick >= 0, idx.gather(1, pick.clamp(min=0)), out)

    def write_frame(self, f: int, k_post, k_pre, v, codes, codes_pre, target: torch.Tensor) -> int:
        """Write frame f's tokens [G, T, ...]: those with target >= 0 merge into that slot (dit/tempcache.merge:
        count, running mean value, the newest member's keys and codes), the rest get new slots. Returns the
        number merged."""
        G, T = self.G, self.T
        sid_new = f * T + torch.arange(T).expand(G, T)
        merge = target >= 0
        n_merge = int(merge.sum())
        token_sid = sid_new.clone()
        if n_merge:
            m = tempcache.merge(target, self.v, self.count, v)
            hg, hp, hs = m.group, m.slot, m.last
            self.v[hg, hp], self.count[hg, hp] = m.value, m.count
            self.k_post[hg, hp], self.k_pre[hg, hp] = k_post[hg, hs], k_pre[hg, hs]
            self.codes[hg, hp], self.codes_pre[hg, hp] = codes[hg, hs], codes_pre[hg, hs]
            self.frame[hg, hp] = f
            g, s = torch.nonzero(merge, as_tuple=True)
            token_sid[g, s] = self.sid[g, target[g, s]]
        new = ~merge
        dead = torch.full((G, T), DEAD, dtype=torch.int64)
        self.k_post = torch.cat([self.k_post, k_post * new[..., None]], 1)
        self.k_pre = torch.cat([self.k_pre, k_pre * new[..., None]], 1)
        self.v = torch.cat([self.v, v * new[..., None]], 1)
        self.count = torch.cat([self.count, new.long()], 1)
        self.frame = torch.cat([self.frame, torch.where(new, f, -1)], 1)
        self.sid = torch.cat([self.sid, torch.where(new, sid_new, dead)], 1)
        self.codes = torch.cat([self.codes, codes * new[..., None]], 1)
        self.codes_pre = torch.cat([self.codes_pre, codes_pre * new[..., None]], 1)
        self.token_sid[f] = token_sid
        self.compact()
        return n_merge

    def evict(self, keep: set[int] | None, hold_tokens_of: set[int]) -> None:
        """Drop slots whose newest member's frame is not kept; forget token maps outside `hold_tokens_of`."""
        if keep is not None:
            gone = self.live & ~torch.isin(self.frame, torch.tensor(sorted(keep), dtype=torch.int64))
            if gone.any():
                self.count = torch.where(gone, 0, self.count)
                self.sid = torch.where(gone, DEAD, self.sid)
                self.frame = torch.where(gone, -1, self.frame)
                self.compact()
        for f in [f for f in self.token_sid if f not in hold_tokens_of]:
            del self.token_sid[f]

    def evict_budget(self, slots: int, sinks: int) -> None:
        """TempCache's budget: keep at most `slots` live slots per group besides the sink frames' own, those
        whose newest member is most recent (ties: the later created); the rest leave the cache."""
        other = self.live & (self.frame >= sinks)
        if self.count.shape[1] == 0 or int(other.sum(1).max()) <= slots:
            return
        key = torch.where(other, self.frame * (1 << 32) + self.sid, torch.full_like(self.sid, -1))
        rank = torch.argsort(torch.argsort(key, dim=1, descending=True, stable=True), dim=1)
        gone = other & (rank >= slots)
        self.count = torch.where(gone, 0, self.count)
        self.sid = torch.where(gone, DEAD, self.sid)
        self.frame = torch.where(gone, -1, self.frame)
        self.compact()

    def compact(self) -> None:
        """Live slots to the front, in id order; trim the padding to the fullest group."""
        if bool(self.live.all()):  # nothing merged or evicted: already in order (new slots are appended)
            return
        order = torch.argsort(self.sid, dim=1, stable=True)
        n = int(self.live.sum(1).max()) if self.count.numel() else 0
        order = order[:, :n]

        def take(a):
            idx = order if a.dim() == 2 else order[..., None].expand(-1, -1, a.shape[-1])
            return a.gather(1, idx)

        self.k_post, self.k_pre, self.v = take(self.k_post), take(self.k_pre), take(self.v)
        self.count, self.frame, self.sid = take(self.count), take(self.frame), take(self.sid)
        self.codes, self.codes_pre = take(self.codes), take(self.codes_pre)

    def bias(self) -> torch.Tensor:
        """log(count) per slot, -inf for padding (the TempCache lemma's logit term)."""
        c = self.count.to(torch.float32)
        return torch.where(c > 0, torch.log(torch.where(c > 0, c, torch.ones_like(c))), torch.full_like(c, -torch.inf))

    def slot_bytes(self) -> int:
        """Bytes of one resident slot: key + value (float32), an int32 count with TempCache, one int64 bucket id
        per AnnSA table and, for TempCache's ANN match, per table of the pre-RoPE key."""
        counted = self.codes_pre.shape[-1] > 0 or self.merged
        return 2 * 4 * self.k_post.shape[-1] + 4 * counted + 8 * (self.codes.shape[-1] + self.codes_pre.shape[-1])


def attend_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: SlotCache, keep: torch.Tensor | None,
                 hasher, diag: bool) -> tuple[torch.Tensor, dict]:
    """The chunk's queries q [G, Q, d] over the chunk's own k, v [G, Q, d] and the cache. keep [G, cap]: slots
    attended densely (AnnSA's sinks and local frames; None: every slot, no AnnSA). Returns (output [G, Q, d],
    info: executed pairs, and with diag the per-slot probabilities and the own part's)."""
    G, Q, d = q.shape
    bias = cache.bias()
    if keep is None and not diag:  # every slot: one fused softmax over [cache; chunk], log(count) as the mask
        mask = torch.cat([bias, torch.zeros(G, Q)], 1)[None, :, None, :]  # 4-D: the groups as heads (3-D
        # inputs take a far slower path on the CPU)
        out = F.scaled_dot_product_attention(q[None], torch.cat([cache.k_post, k], 1)[None],
                                             torch.cat([cache.v, v], 1)[None], attn_mask=mask)[0]
        return out, {"executed": G * Q * Q + Q * int(cache.live.sum())}
    qcodes = sparse.codes(hasher, q) if keep is not None and cache.count.shape[1] else None  # AnnSA's query ids
    if qcodes is not None and not diag:  # AnnSA in the native kernel, where it runs
        kept = keep & cache.live
        kcodes = torch.where((cache.live & ~kept)[..., None], cache.codes, torch.full_like(cache.codes, -1))
        native = sparse.native_annsa(q * d ** -0.5, k, v, cache.k_post, cache.v, bias, kept, qcodes, kcodes)
        if native is not None:  # the kernel counts the pairs it computes
            return native[0], {"executed": native[1]}
    parts = [sparse.dense_part(q, k, v)]
    executed = G * Q * Q
    if cache.count.shape[1] == 0:
        pass
    elif keep is None:
        parts.append(sparse.dense_part(q, cache.k_post, cache.v, bias))
        executed += Q * int(cache.live.sum())
    else:
        kept = keep & cache.live
        n = int(kept.sum(1).max())
        idx = torch.argsort((~kept).to(torch.int8), dim=1, stable=True)[:, :n]
        ok = kept.gather(1, idx)
        e = idx[..., None].expand(-1, -1, d)
        kb = torch.where(ok, bias.gather(1, idx), torch.full_like(ok, -torch.inf, dtype=bias.dtype))
        parts.append(sparse.dense_part(q, cache.k_post.gather(1, e), cache.v.gather(1, e), kb))
        executed += Q * int(kept.sum())
        cg, cp = torch.nonzero(cache.live & ~kept, as_tuple=True)
        if cg.numel():
            more, n_pairs = sparse.bucket_parts(q.flatten(0, 1), torch.arange(G).repeat_interleave(Q),
                                                qcodes.flatten(0, 1), cache.k_post[cg, cp], cache.v[cg, cp],
                                                bias[cg, cp], cg, cache.codes[cg, cp])
            parts += more
            executed += n_pairs
    out, lse, _ = sparse.combine(parts)
    info = {"executed": executed}
    if diag:  # the compressed softmax per slot and per own key, for recall (diagnostics only: dense products)
        lse = lse.view(G, Q)
        full = (q @ cache.k_post.transpose(1, 2) / d ** 0.5 + bias[:, None]) - lse[..., None]
        sel = cache.live[:, None, :].expand(G, Q, -1)
        if qcodes is not None:
            hit = (qcodes[:, :, None, :] == cache.codes[:, None, :, :]).any(-1)  # [G, Q, cap]
            sel = sel & (keep[:, None, :] | hit)
        info["p_slot"] = torch.where(sel, torch.exp(full), torch.zeros_like(full))
        info["p_own"] = torch.exp(q @ k.transpose(1, 2) / d ** 0.5 - lse[..., None])
    return out.view(G, Q, d), info


def cross_attend(cq: torch.Tensor, ck: torch.Tensor, cv: torch.Tensor, q_codes: torch.Tensor,
                 k_codes: torch.Tensor, frames: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """AnnCA: queries cq [G, Q, d] in `frames` equal frames over the prompt ck, cv [G, L, d]; a prompt token is
    kept for a frame when a query of that frame shares a bucket (q_codes [G, Q, T], k_codes [G, L, T]). Each
    frame's kept tokens are gathered (padded to the frame keeping most) and its queries attend to them only.
    Returns (output [G, Q, d] (0 for a frame that keeps nothing), kept [G, frames, L] bool, executed pairs)."""
    G, Q, d = cq.shape
    L = ck.shape[1]
    per = Q // frames
    gf = (torch.arange(G)[:, None] * frames + torch.arange(Q)[None, :] // per).flatten()  # [G*Q] (row-head, frame)
    kg = torch.arange(G).repeat_interleave(L)
    kept = torch.zeros(G * frames * L, dtype=torch.bool)
    for t in range(q_codes.shape[-1]):  # one lookup per distinct (group, frame, code), not per query
        u = torch.unique(gf * sparse.CODE_SPAN + q_codes[..., t].flatten())
        ugf, ucode = u // sparse.CODE_SPAN, u % sparse.CODE_SPAN
        ui, ki = sparse.bucket_join(ugf // frames, ucode[:, None], kg, k_codes[..., t].flatten()[:, None])
        kept[ugf[ui] * L + ki % L] = True
    kept = kept.view(G * frames, L)
    n = kept.sum(1)  # prompt tokens kept per (group, frame)
    idx = torch.argsort((~kept).to(torch.int8), dim=1, stable=True)[:, :int(n.max())]  # kept ones first
    ok = kept.gather(1, idx)
    g = torch.arange(G * frames) // frames
    bias = torch.where(ok, 0.0, -torch.inf)
    part = sparse.dense_part(cq.reshape(G * frames, per, d), ck[g[:, None], idx], cv[g[:, None], idx], bias)
    out, _, _ = sparse.combine([part])
    return out.view(G, Q, d), kept.view(G, frames, L), per * int(n.sum())


def temporal_scores(q: torch.Tensor, k: torch.Tensor, tokens: int, prev_k: torch.Tensor | None, frame_start: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """TAS [B, F, T] of the chunk's queries q [B, H, F*T, d]: mean over heads of q . k / sqrt(d), k the key of
    the same (h, w) one frame back (the chunk's own k [B, H, F*T, d], or `prev_k` [B, H, T, d]: the previous
    chunk's last frame at this timestep, for the chunk's first frame); and which tokens may replay (not video
    frame 0, not a first frame without `prev_k`)."""
    B, H, S, d = q.shape
    fr = S // tokens
    qf, kf = q.view(B, H, fr, tokens, d), k.view(B, H, fr, tokens, d)
    first = prev_k if prev_k is not None else torch.zeros_like(kf[:, :, 0])
    k_back = torch.cat([first[:, :, None], kf[:, :, :-1]], 2)
    tas = (qf * k_back).sum(-1).mean(1) / d ** 0.5
    eligible = torch.ones_like(tas, dtype=torch.bool)
    eligible[:, 0] = prev_k is not None and frame_start >= 1
    return tas, eligible


def replay_ffn(ffn, x: torch.Tensor, tas: torch.Tensor, eligible: torch.Tensor, tau: float,
               prev: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """FFN of x [B, F, T, D] where TAS [B, F, T] <= tau or not eligible; elsewhere the output of the same
    (h, w) one frame earlier (`prev` [B, T, D] for the chunk's first frame), chained frame by frame. Only the
    computed rows go through the FFN. Returns (output [B, F, T, D], replay mask [B, F, T])."""
    B, Fr, T, D = x.shape
    replay = eligible & (tas > tau)
    rows = torch.nonzero(~replay.flatten(), as_tuple=True)[0]
    out = torch.zeros(B * Fr * T, D, dtype=x.dtype, device=x.device)
    if rows.numel():
        out[rows] = ffn(x.reshape(-1, D)[rows])
    out = out.view(B, Fr, T, D)
    for j in range(Fr):
        if replay[:, j].any():
            src = out[:, j - 1] if j else prev
            out[:, j] = torch.where(replay[:, j, :, None], src, out[:, j])
    return out, replay


def block_inputs(blk, x: torch.Tensor, e: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple:
    """model.Block.forward up to the self-attention, for runtimes that replace its attention and FFN: the six
    modulation vectors, the per-frame modulate / gate functions, and q, k (post-RoPE) [B, H, S, d], the
    pre-RoPE key [B, S, H, d] (TempCache compares those) and v."""
    b, s, d = x.shape
    fr, H = e.shape[1], blk.heads
    mod = (blk.modulation[:, None] + e).unbind(2)

    def modulate(h, shift, scale):
        return (h.view(b, fr, -1, d) * (1 + scale[:, :, None]) + shift[:, :, None]).view(b, s, d)

    def gate(h, g):
        return (h.view(b, fr, -1, d) * g[:, :, None]).view(b, s, d)

    h = modulate(blk.norm1(x), mod[0], mod[1])
    k_pre = blk.norm_k(blk.k(h)).unflatten(-1, (H, -1))
    q = apply_rope(blk.norm_q(blk.q(h)).unflatten(-1, (H, -1)), cos, sin).transpose(1, 2)
    k = apply_rope(k_pre, cos, sin).transpose(1, 2)
    return mod, modulate, gate, q, k, k_pre, blk.heads_first(blk.v(h))


class FastARState(StreamCache):
    """The stream's cache and FAST-AR state for one video (made by FastARDiT.new_cache; rollout's `past`): per
    layer a SlotCache, written frame by frame with TempCache's merge (dit/tempcache.py) where it is on."""

    def __init__(self, runtime: FastARDiT, layers: int, tokens: int, sinks: int, window: int,
                 shadow: FrameCache | None = None):
        super().__init__(layers, tokens, sinks, window)
        self.runtime = runtime
        self.caches: list[SlotCache] = []
        self.shadow = shadow  # the uncompressed cache (diagnostics)
        self.replay_state: dict = {}  # timestep -> layer -> (FFN output, key) of the last frame
        self.cross_codes: dict = {}  # layer -> prompt key codes [G, L, T]
        self.tas_log: list = []  # eligible TAS values (calibration)

    def past(self, batch: int, heads: int, head_dim: int) -> FastARState:
        return self

    @property
    def resident(self) -> list[int]:
        keep = kept_frames(self.written, self.sinks, self.window)
        return sorted(keep) if keep is not None else list(range(self.written))

    @property
    def nbytes(self) -> int:
        return sum(int(c.live.sum()) * c.slot_bytes() for c in self.caches)

    def write(self, first_frame: int, kv: list) -> None:
        """Write the clean chunk's keys/values (per layer (k_post, k_pre, v) [B, H, F*T, d]), timed."""
        t0 = time.perf_counter()
        if self.shadow is not None:
            self.shadow.write(first_frame, [a.numpy() for k_post, _, v in kv for a in (k_post, v)])
        super().write(first_frame, kv)
        self.runtime.seconds["cache_write"] += time.perf_counter() - t0

    def per_layer(self, kv: list) -> list[tuple]:
        return [(k_post, v, k_pre) for k_post, k_pre, v in kv]

    def write_frame(self, frame: int, layers: list[tuple]) -> None:
        """Each layer's frame into its SlotCache: the keys' bucket codes (AnnSA's, and TempCache's match), the
        slots TempCache merges them into, the counters."""
        rt = self.runtime
        s = rt.fa
        for i, (k_post, value, k_pre) in enumerate(layers):
            B, H, T, d = k_post.shape
            if len(self.caches) <= i:
                self.caches.append(SlotCache(B * H, T, d, rt.tables, rt.tc_tables))
            c, st = self.caches[i], rt.stats[i]
            kp, kr, vv = (a.reshape(B * H, T, d) for a in (k_post, k_pre, value))
            codes = sparse.codes(rt.sa_hasher, kp) if rt.sa_hasher else torch.zeros(B * H, T, 0).long()
            codes_pre = sparse.codes(rt.tc_hasher, kr) if rt.tc_hasher else torch.zeros(B * H, T, 0).long()
            target = torch.full((B * H, T), -1, dtype=torch.int64)
            c.merged = s.tempcache is not None
            if s.tempcache is not None and s.tempcache_match == "aligned" and frame >= self.sinks:
                target = c.aligned_targets(frame, kr, s.tempcache, self.sinks)
                st.merges_aligned += int((target >= 0).sum())
            elif s.tempcache is not None and frame >= self.sinks:
                target = c.ann_targets(frame, kr, codes_pre, s.tempcache, self.sinks)
                al = c.aligned_targets(frame, kr, -2.0, self.sinks)  # the aligned slot, for the share
                st.merges_aligned += int(((target >= 0) & (target == al)).sum())
            st.merges += c.write_frame(frame, kp, kr, vv, codes, codes_pre, target)
            st.written += B * H * T

    def evict(self, keep: set[int] | None) -> None:
        """Slots whose newest member's frame is not kept leave, then TempCache's budget; the resident counters."""
        s, T = self.runtime.fa, self.tokens
        hold = set(self.shadow.resident) if self.shadow is not None else {self.written - 1}
        for i, c in enumerate(self.caches):
            c.evict(keep, hold)
            if s.tempcache_budget:
                c.evict_budget(s.tempcache_budget * T, self.sinks)
            st = self.runtime.stats[i]
            st.resident_slots = int(c.live.sum())
            st.dense_slots = c.G * T * len(self.resident)
            st.resident_bytes = st.resident_slots * c.slot_bytes()
            st.dense_bytes = st.dense_slots * 2 * 4 * c.k_post.shape[-1]


class FastARDiT(TorchDiT):
    """The eager DiT with FAST-AR / FastCar (settings: dit/modes.FastARSettings) behind the stream interface."""

    def __init__(self, model, fa, threads: int = 0):
        super().__init__(model, threads)
        cfg = model.cfg
        self.fa, self.verdicts = modes.effective(fa, cfg)  # AnnSA / AnnCA only where they pay (or --ann-always)
        fa = self.fa
        d = cfg.head_dim

        def hasher(kind):
            return sparse.make_hasher(kind, d, fa.lsh_bits, fa.int8_dirs, fa.ann_tables, fa.ann_seed)

        self.sa_hasher = hasher(fa.annsa) if fa.annsa else None
        self.tc_hasher = hasher(fa.tempcache_match) if fa.tempcache is not None and fa.tempcache_match != "aligned" \
            else None
        self.ca_hasher = hasher(fa.annsa or "lsh") if fa.annca else None
        self.tables = fa.ann_tables if fa.annsa else 0  # bucket ids stored per slot
        self.tc_tables = self.tc_hasher.tables if self.tc_hasher else 0
        self.tau = fa.threshold
        self.record_tas = False
        self.stats = [LayerStats() for _ in range(cfg.layers)]
        self.seconds = dict.fromkeys(COMPONENTS, 0.0)  # wall time per component over the stream

    def new_cache(self, layers: int, tokens: int, sinks: int, window: int) -> FastARState:
        self.stats = [LayerStats() for _ in range(layers)]
        self.seconds = dict.fromkeys(COMPONENTS, 0.0)
        shadow = FrameCache(layers, tokens, sinks, window) if self.fa.diagnostics else None
        self.state = FastARState(self, layers, tokens, sinks, window, shadow=shadow)
        return self.state

    def step(self, latent, timestep, frame_start: int, past: FastARState, cross) -> list:
        torch = self.torch
        m = self.model
        with torch.no_grad():
            x, t, e, cos, sin = m.embed(torch.from_numpy(latent), torch.from_numpy(timestep),
                                        torch.tensor([frame_start], dtype=torch.int64))
            key = tuple(np.asarray(timestep)[0].tolist())
            prev = past.replay_state.get(key, {})
            now: dict = {}
            written = []
            for i, blk in enumerate(m.blocks):
                x, kv = self.block(i, blk, x, e, cos, sin, past, torch.from_numpy(cross[2 * i]),
                                   torch.from_numpy(cross[2 * i + 1]), frame_start, prev.get(i), now)
                written.append(kv)
            if self.tau is not None or self.record_tas:
                past.replay_state[key] = now
            vel = m.final(x, t)
        return [vel.numpy(), *written]

    def block(self, i, blk, x, e, cos, sin, state: FastARState, ck, cv, frame_start, prev, now):
        """Block.forward with the FAST-AR attention and FastCar's FFN (model.Block for the dense form)."""
        cfg = self.model.cfg
        b, s, d = x.shape
        fr = e.shape[1]
        T, H, hd = cfg.tokens_per_frame, cfg.heads, cfg.head_dim
        mod, modulate, gate, q, k, k_pre, v = block_inputs(blk, x, e, cos, sin)
        t0 = time.perf_counter()
        att = self.self_attention(i, q, k, v, state, frame_start)
        t1 = time.perf_counter()
        self.seconds["self_attention"] += t1 - t0
        x = x + gate(blk.o(att.transpose(1, 2).flatten(2)), mod[2])
        cq = blk.heads_first(blk.norm_cq(blk.cq(blk.norm3(x))))
        t0 = time.perf_counter()
        ca = self.cross_attention(i, cq, ck, cv, fr, state)
        t1 = time.perf_counter()
        self.seconds["cross_attention"] += t1 - t0
        x = x + blk.co(ca.transpose(1, 2).flatten(2))
        xm = modulate(blk.norm2(x), mod[3], mod[4])
        t0 = time.perf_counter()
        st = self.stats[i]
        if self.tau is None and not self.record_tas:
            ffn = blk.ffn(xm)
            st.ffn_rows += b * s
        else:
            kf = k.view(b, H, fr, T, hd)
            tas, eligible = temporal_scores(q, k, T, prev[1] if prev is not None else None, frame_start)
            if self.record_tas:
                state.tas_log.append(tas[eligible].numpy().astype(np.float64))
            tau = float("inf") if self.tau is None else self.tau
            out, replay = replay_ffn(blk.ffn, xm.view(b, fr, T, d), tas, eligible, tau,
                                     prev[0] if prev is not None else None)
            now[i] = (out[:, -1].clone(), kf[:, :, -1].clone())
            ffn = out.view(b, s, d)
            st.ffn_rows += b * s
            st.ffn_replayed += int(replay.sum())
        self.seconds["ffn"] += time.perf_counter() - t0
        x = x + gate(ffn, mod[5])
        return x, (k, k_pre.transpose(1, 2), v)

    def self_attention(self, i, q, k, v, state: FastARState, frame_start: int) -> torch.Tensor:
        B, H, Q, d = q.shape
        G = B * H
        fa, st = self.fa, self.stats[i]
        cache = state.caches[i] if i < len(state.caches) else SlotCache(G, state.tokens, d, self.tables,
                                                                        self.tc_tables)
        keep = None
        if self.sa_hasher is not None:
            keep = (cache.frame < state.sinks) | (cache.frame >= frame_start - fa.annsa_local)
        diag = state.shadow is not None
        out, info = attend_cache(q.reshape(G, Q, d), k.reshape(G, Q, d), v.reshape(G, Q, d), cache, keep,
                                 self.sa_hasher, diag)
        st.sa_executed += info["executed"]
        dense_tokens = state.tokens * len(state.resident)
        st.sa_dense += G * Q * (dense_tokens + Q)
        if diag:
            st.sa_recall_sum += self.recall(i, q, k, cache, state, info)
            st.sa_queries += G * Q
        return out.view(B, H, Q, d)

    def recall(self, i, q, k, cache: SlotCache, state: FastARState, info) -> float:
        """Sum over queries of sum_t min(p_dense(t), p_slot(slot(t)) / count(slot(t))): the dense attention
        over the uncompressed cache (the shadow) and the chunk, against the compressed one mapped to tokens."""
        B, H, Q, d = q.shape
        G = B * H
        frames = state.shadow.resident
        qf, kf = q.reshape(G, Q, d), k.reshape(G, Q, d)
        if frames:
            past = torch.from_numpy(state.shadow.past(B, H, d)[2 * i]).reshape(G, -1, d)
            sids = torch.cat([cache.token_sid[f] for f in frames], 1)
            pos, found = cache.positions(sids)
            p_tok = info["p_slot"].gather(2, pos[:, None].expand(-1, Q, -1)) / \
                cache.count.gather(1, pos).clamp(min=1)[:, None].to(torch.float32)
            p_tok = torch.where(found[:, None], p_tok, torch.zeros_like(p_tok))
        else:
            past = kf[:, :0]
            p_tok = torch.zeros(G, Q, 0)
        dense = torch.softmax(torch.cat([qf @ past.transpose(1, 2), qf @ kf.transpose(1, 2)], -1) / d ** 0.5, -1)
        comp = torch.cat([p_tok, info["p_own"]], -1)
        return float(torch.minimum(dense, comp).double().sum())

    def cross_attention(self, i, cq, ck, cv, frames: int, state: FastARState) -> torch.Tensor:
        B, H, Q, d = cq.shape
        L = ck.shape[2]
        st = self.stats[i]
        st.ca_dense += B * H * Q * L
        if self.ca_hasher is None:
            st.ca_executed += B * H * Q * L
            return F.scaled_dot_product_attention(cq, ck, cv)
        G = B * H
        if i not in state.cross_codes:
            state.cross_codes[i] = sparse.codes(self.ca_hasher, ck.reshape(G, L, d))
        qg, kg, vg = cq.reshape(G, Q, d), ck.reshape(G, L, d), cv.reshape(G, L, d)
        out, kept, executed = cross_attend(qg, kg, vg, sparse.codes(self.ca_hasher, qg), state.cross_codes[i],
                                           frames)
        st.ca_executed += executed
        if state.shadow is not None:  # recall: dense softmax mass on the kept prompt tokens
            p = torch.softmax(qg @ kg.transpose(1, 2) / d ** 0.5, -1).view(G, frames, Q // frames, L)
            st.ca_kept_sum += float((p * kept[:, :, None]).double().sum())
            st.ca_queries += G * Q
        return out.view(B, H, Q, d)

    def layer_summary(self) -> list[dict]:
        return [st.summary() for st in self.stats]


def calibrate_tau(model, fa, settings, text=None, chunks: int = 2) -> float:
    """The tau giving replay ratio `fa.calibrate_replay` (over eligible rows) on the first `chunks` chunks of the
    same stream run with FastCar off and its TAS recorded (the quantile, as the decoders' one-pass calibration)."""
    from fastcar_compile.dit.stream import rollout
    from fastcar_compile.runtime.calib_stats import tau_for_share

    probe = FastARDiT(model, dataclasses.replace(fa, threshold=None, calibrate_replay=None, diagnostics=False))
    probe.record_tas = True
    short = dataclasses.replace(settings, frames=min(settings.frames, chunks * model.cfg.chunk_frames))
    for _ in rollout(probe, short, text):
        pass
    return tau_for_share(np.concatenate(probe.state.tas_log), fa.calibrate_replay)


def totals(stats: list[LayerStats]) -> dict:
    """The layers' counts summed, as one summary (what the command line prints and tables report)."""
    acc = LayerStats()
    for st in stats:
        for f in dataclasses.fields(LayerStats):
            setattr(acc, f.name, getattr(acc, f.name) + getattr(st, f.name))
    return acc.summary()
