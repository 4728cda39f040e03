"""A chunk-causal Wan2.1-style video DiT in PyTorch, written for export with a KV cache as graph I/O.

Our own module rather than diffusers' `WanTransformer3DModel`: diffusers' blocks take no past K/V (its rolling
cache for Wan is not released), and the step must take the cache and return the chunk's K/V as plain tensors.
The structure is Wan2.1's: patch embedding over (frame, h, w); per block AdaLN timestep modulation (6 vectors)
-> self-attention with q/k RMSNorm and 3D RoPE (real cos/sin form: ONNX has no complex numbers) -> cross-
attention to the prompt -> GELU-tanh FFN, with gated residuals; an AdaLN head. Timesteps are per frame, so a
chunk may hold frames at different noise levels (Rolling-Forcing). A chunk attends to itself and to the
cache (no mask inside a chunk); the caller decides what the cache holds (cache.FrameCache).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fastcar_compile.core.contract import DiTConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_split(head_dim: int) -> tuple[int, int, int]:
    """Wan's split of a head over (frame, h, w) rotary frequencies."""
    part = 2 * (head_dim // 6)
    return head_dim - 2 * part, part, part


def sinusoid(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Wan's timestep embedding: cat(cos, sin) of t times geometric frequencies (float32)."""
    half = dim // 2
    freqs = torch.pow(10000.0, -torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t.float()[..., None] * freqs
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs (x[2i], x[2i+1]) as Wan's view_as_complex does. x [B, S, H, d]; cos/sin [S, d/2]."""
    x = x.unflatten(-1, (-1, 2))
    x0, x1 = x[..., 0], x[..., 1]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1).flatten(-2)


class Block(nn.Module):
    def __init__(self, cfg: DiTConfig):
        super().__init__()
        d = cfg.hidden
        self.heads = cfg.heads
        self.norm1 = nn.LayerNorm(d, eps=cfg.eps, elementwise_affine=False)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.norm_q, self.norm_k = RMSNorm(d, cfg.eps), RMSNorm(d, cfg.eps)
        self.norm3 = nn.LayerNorm(d, eps=cfg.eps)
        self.cq, self.ck, self.cv, self.co = (nn.Linear(d, d) for _ in range(4))
        self.norm_cq, self.norm_ck = RMSNorm(d, cfg.eps), RMSNorm(d, cfg.eps)
        self.norm2 = nn.LayerNorm(d, eps=cfg.eps, elementwise_affine=False)
        self.ffn = nn.Sequential(nn.Linear(d, cfg.ffn), nn.GELU(approximate="tanh"), nn.Linear(cfg.ffn, d))
        self.modulation = nn.Parameter(torch.randn(1, 6, d) / d ** 0.5)

    def heads_first(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (self.heads, -1)).transpose(1, 2)

    def cross_kv(self, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt's K/V for this block [B, heads, L, d]: computed once per video."""
        return self.heads_first(self.norm_ck(self.ck(context))), self.heads_first(self.cv(context))

    def forward(self, x, e, cos, sin, past_k, past_v, cross_k, cross_v):
        """x [B, F*T, D]; e [B, F, 6, D] (time projection per frame). Returns (x, chunk K, chunk V)."""
        b, s, d = x.shape
        f = e.shape[1]
        mod = (self.modulation[:, None] + e).unbind(2)  # 6 x [B, F, D]

        def modulate(h, shift, scale):
            return (h.view(b, f, -1, d) * (1 + scale[:, :, None]) + shift[:, :, None]).view(b, s, d)

        def gate(h, g):
            return (h.view(b, f, -1, d) * g[:, :, None]).view(b, s, d)

        h = modulate(self.norm1(x), mod[0], mod[1])
        q = apply_rope(self.norm_q(self.q(h)).unflatten(-1, (self.heads, -1)), cos, sin).transpose(1, 2)
        k = apply_rope(self.norm_k(self.k(h)).unflatten(-1, (self.heads, -1)), cos, sin).transpose(1, 2)
        v = self.heads_first(self.v(h))
        att = F.scaled_dot_product_attention(q, torch.cat([past_k, k], 2), torch.cat([past_v, v], 2))
        x = x + gate(self.o(att.transpose(1, 2).flatten(2)), mod[2])
        cq = self.heads_first(self.norm_cq(self.cq(self.norm3(x))))
        x = x + self.co(F.scaled_dot_product_attention(cq, cross_k, cross_v).transpose(1, 2).flatten(2))
        x = x + gate(self.ffn(modulate(self.norm2(x), mod[3], mod[4])), mod[5])
        return x, k, v


class ChunkDiT(nn.Module):
    """The denoiser step: (noisy chunk, per-frame timesteps, first frame index, cache, prompt K/V) ->
    (flow velocity, the chunk's K/V per layer)."""

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden
        self.patch_embed = nn.Linear(cfg.patch_dim, d)
        self.text_embed = nn.Sequential(nn.Linear(cfg.text_dim, d), nn.GELU(approximate="tanh"), nn.Linear(d, d))
        self.time_embed = nn.Sequential(nn.Linear(cfg.freq_dim, d), nn.SiLU(), nn.Linear(d, d))
        self.time_proj = nn.Sequential(nn.SiLU(), nn.Linear(d, 6 * d))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm_out = nn.LayerNorm(d, eps=cfg.eps, elementwise_affine=False)
        self.head = nn.Linear(d, cfg.patch_dim)
        self.head_modulation = nn.Parameter(torch.randn(1, 2, d) / d ** 0.5)
        self.parts = tuple(n // 2 for n in rope_split(cfg.head_dim))

    def rope(self, frame_start: torch.Tensor, frames: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [F*h*w, d/2] at absolute frame positions frame_start + 0..F-1 (cached K keep theirs)."""
        gh, gw = self.cfg.grid
        dev = frame_start.device
        # Frequencies computed in the graph, not held as a buffer: a model on the meta device (a large config
        # exported without weights) then still has every constant it needs.
        fr, hr, wr = (1.0 / self.cfg.rope_theta ** (torch.arange(0, 2 * n, 2, dtype=torch.float32, device=dev)
                                                    / (2 * n)) for n in self.parts)
        pf = (frame_start.reshape(1).to(torch.float32) + torch.arange(frames, dtype=torch.float32, device=dev))
        ph = torch.arange(gh, dtype=torch.float32, device=dev)
        pw = torch.arange(gw, dtype=torch.float32, device=dev)
        af = (pf[:, None] * fr)[:, None, None, :].expand(frames, gh, gw, -1)
        ah = (ph[:, None] * hr)[None, :, None, :].expand(frames, gh, gw, -1)
        aw = (pw[:, None] * wr)[None, None, :, :].expand(frames, gh, gw, -1)
        ang = torch.cat([af, ah, aw], dim=-1).reshape(frames * gh * gw, -1)
        return torch.cos(ang), torch.sin(ang)

    def text_kv(self, text_embeds: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Flat cross-attention K/V (cross.0.key, cross.0.value, ...) of the prompt [B, L, text_dim]."""
        ctx = self.text_embed(text_embeds)
        return tuple(t for blk in self.blocks for t in blk.cross_kv(ctx))

    def patchify(self, latent: torch.Tensor) -> torch.Tensor:
        b, c, f, h, w = latent.shape
        _, ph, pw = self.cfg.patch
        x = latent.reshape(b, c, f, h // ph, ph, w // pw, pw).permute(0, 2, 3, 5, 1, 4, 6)
        return x.reshape(b, f * (h // ph) * (w // pw), c * ph * pw)

    def unpatchify(self, x: torch.Tensor, frames: int) -> torch.Tensor:
        cfg = self.cfg
        gh, gw = cfg.grid
        _, ph, pw = cfg.patch
        x = x.reshape(x.shape[0], frames, gh, gw, cfg.in_channels, ph, pw).permute(0, 4, 1, 2, 5, 3, 6)
        return x.reshape(x.shape[0], cfg.in_channels, frames, cfg.latent_h, cfg.latent_w)

    def forward(self, latent: torch.Tensor, timestep: torch.Tensor, frame_start: torch.Tensor,
                *kv: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """latent [B, C, F, H, W]; timestep [B, F] in 0..1000; frame_start int64 [1]; kv = past.N.key|value
        [B, heads, P, d] (P may be 0) then cross.N.key|value [B, heads, L, d]."""
        n = self.cfg.layers
        past, cross = kv[:2 * n], kv[2 * n:]
        x, t, e, cos, sin = self.embed(latent, timestep, frame_start)
        presents = []
        for i, blk in enumerate(self.blocks):
            x, k, v = blk(x, e, cos, sin, past[2 * i], past[2 * i + 1], cross[2 * i], cross[2 * i + 1])
            presents += [k, v]
        return (self.final(x, t), *presents)

    def embed(self, latent, timestep, frame_start):
        """Tokens x [B, F*T, D], time embedding t [B, F, D], block modulation e [B, F, 6, D], RoPE cos/sin."""
        x = self.patch_embed(self.patchify(latent))
        t = self.time_embed(sinusoid(timestep, self.cfg.freq_dim))
        e = self.time_proj(t).unflatten(-1, (6, -1))
        cos, sin = self.rope(frame_start, latent.shape[2])
        return x, t, e, cos, sin

    def final(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The AdaLN head: tokens -> flow velocity [B, C, F, H, W]."""
        b, s, d = x.shape
        frames = t.shape[1]
        shift, scale = (self.head_modulation[:, None] + t[:, :, None]).unbind(2)
        x = (self.norm_out(x).view(b, frames, -1, d) * (1 + scale[:, :, None]) + shift[:, :, None]).view(b, s, d)
        return self.unpatchify(self.head(x), frames)


class TextGraph(nn.Module):
    """The prompt graph: text embeddings -> cross-attention K/V of every layer."""

    def __init__(self, model: ChunkDiT):
        super().__init__()
        self.model = model

    def forward(self, text_embeds: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.model.text_kv(text_embeds)


def build(cfg: DiTConfig, weights=None, seed: int = 0, device: str | None = None) -> ChunkDiT:
    """The model in eval mode: weights from a safetensors file of ours, a checkpoint of another layout
    (dit/checkpoints.Checkpoint: diffusers', Wan's), random (seeded) ones, or on the meta device (device="meta":
    shapes only, nothing allocated, for exporting the graph of a large config)."""
    from fastcar_compile.core.errors import FastCarError

    if device == "meta":
        with torch.device("meta"):
            return ChunkDiT(cfg).eval()
    if hasattr(weights, "state_dict"):  # a Checkpoint: built without weights, then given the mapped tensors
        state = weights.state_dict(cfg)
        with torch.device("meta"):
            model = ChunkDiT(cfg).eval()
        model.load_state_dict(state, strict=True, assign=True)
        return model
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = ChunkDiT(cfg).eval()
    if weights is not None:
        from safetensors.torch import load_file

        try:
            state = load_file(str(weights))
        except Exception as exc:  # noqa: BLE001 - safetensors raises several types for a broken file
            raise FastCarError(f"{weights}: cannot read the weights ({type(exc).__name__}); "
                               "give a safetensors file saved from this model") from None
        try:
            missing, unexpected = model.load_state_dict(state, strict=False)
        except RuntimeError as exc:  # torch: "size mismatch for ..." per tensor whose shape differs
            first = next((ln.strip() for ln in str(exc).splitlines() if "size mismatch" in ln), str(exc)[:200])
            raise FastCarError(f"{weights}: the weights' shapes do not match config.json ({first[:240]}); give the "
                               "weights saved with this config") from None
        bad = [f"missing {missing[:3]}"] * bool(missing) + [f"unexpected {unexpected[:3]}"] * bool(unexpected)
        if bad:
            raise FastCarError(f"{weights}: the weights do not match config.json ({'; '.join(bad)})")
    return model
