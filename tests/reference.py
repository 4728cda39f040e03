"""Eager PyTorch reference of FastCar, written against docs/semantics.md section 1 and docs/DESIGN.md "Semantics".

It wraps a transformers causal LM with hooks (own code, independent of `fastcar_compile.passes`):
- a forward pre-hook on each layer's attention records the normed hidden states and the RoPE (cos, sin);
  the query is recomputed from the projection weights (pre-RoPE = `raw`, rotated = `rope`);
- a forward hook on each rewritten layer's MLP (or on the norm after it, Gemma2/OLMo2) replaces the branch
  output with the cached one for replayed tokens (the decoder layer then adds it to the current residual) and
  updates the cache.
The key is read from the model's own KV cache at KV index p - L (post-RoPE, as attention uses it). The
recomputed keys are checked against that cache every step, so the reference's RoPE is the model's RoPE.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from ort_driver import left_pad_masks
from torch import nn


@dataclass
class RefRun:
    """A decode as the reference ran it: the token ids fed per step and what came out."""

    steps: list[np.ndarray] = field(default_factory=list)  # [B, S] ids fed at each step (step 0 = prompt)
    logits: list[np.ndarray] = field(default_factory=list)  # [B, S, V]
    replay: dict[int, list[np.ndarray]] = field(default_factory=dict)  # layer -> [B, S] bool
    tas: dict[int, list[np.ndarray]] = field(
        default_factory=dict
    )  # layer -> [B, S] float64, NaN if p - L < 0


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.shape[-1] dims of x [B, H, S, D] (partial rotary keeps the rest)."""
    rd = cos.shape[-1]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rot, rest = x[..., :rd], x[..., rd:]
    return torch.cat((rot * cos + _rotate_half(rot) * sin, rest), dim=-1)


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-J's rotary: pairs (x0, x1), (x2, x3), ... of the first 2 * cos.shape[-1] dims of x [B, H, S, D]."""
    rd = 2 * cos.shape[-1]
    cos = cos.repeat_interleave(2, dim=-1).unsqueeze(1)
    sin = sin.repeat_interleave(2, dim=-1).unsqueeze(1)
    rot, rest = x[..., :rd], x[..., rd:]
    pairs = torch.stack((-rot[..., 1::2], rot[..., ::2]), dim=-1).flatten(-2)
    return torch.cat((rot * cos + pairs * sin, rest), dim=-1)


def _gptj_sincos(attn: nn.Module, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(cos, sin, "interleaved") [B, S, rotary_dim / 2] from GPT-J's table (rows: sin | cos)."""
    table = attn.embed_positions[position_ids]
    sin, cos = table.split(table.shape[-1] // 2, dim=-1)
    return cos, sin, "interleaved"


class FastCarReference:
    """FastCar on an eager transformers model. Use `generate` (greedy) or `step` after `reset`.

    threshold: one tau, or one per rewritten layer (in increasing layer order).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        frame_tokens: int,
        threshold: float | Sequence[float],
        tas_query: str = "rope",
        max_replay: int = 0,
        layers: Sequence[int] | None = None,
        video_start: int = 0,
        check_rope: bool = True,
    ):
        if tas_query not in ("rope", "raw"):
            raise ValueError(f"tas_query must be 'rope' or 'raw', got {tas_query!r}")
        self.model = model.eval()
        cfg = model.config
        self.is_gpt2 = getattr(cfg, "model_type", "") == "gpt2"
        self.blocks = list(_decoder_layers(model))
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        if getattr(cfg, "multi_query", False) and not getattr(cfg, "new_decoder_architecture", True):
            self.num_kv_heads = 1  # Falcon multi-query
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.hidden = cfg.hidden_size
        self.L = int(frame_tokens)
        self.tas_query = tas_query
        self.max_replay = int(max_replay)
        self.video_start = int(video_start)
        self.check_rope = check_rope
        n = len(self.blocks)
        self.layers = sorted(set(range(n) if layers is None else layers))
        taus = (
            [float(threshold)] * len(self.layers) if np.isscalar(threshold) else [float(t) for t in threshold]
        )
        if len(taus) != len(self.layers):
            raise ValueError(f"{len(taus)} thresholds for {len(self.layers)} layers")
        self.tau = dict(zip(self.layers, taus, strict=True))
        self._seen: dict[int, tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]] = {}
        self._handles = []
        for i, blk in enumerate(self.blocks):
            attn = _attention_module(blk)
            self._handles.append(attn.register_forward_pre_hook(self._attn_hook(i), with_kwargs=True))
            if i in self.tau:
                # The replayed value is what is added to the stream: the MLP output, or its post-norm (Gemma2,
                # OLMo2), a per-token function of it.
                branch_end = getattr(blk, "post_feedforward_layernorm", None) or blk.mlp
                self._handles.append(branch_end.register_forward_hook(self._mlp_hook(i)))
        self.kv = None
        self._past = 0
        self._step_out: dict[str, dict[int, np.ndarray]] = {}

    # ----------------------------------------------------------------------------- hooks
    def _attn_hook(self, i: int):
        def hook(module, args, kwargs):
            h = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            pe = kwargs.get("position_embeddings")
            if pe is None and hasattr(module, "embed_positions"):  # GPT-J: sin/cos table indexed in attention
                pe = _gptj_sincos(module, kwargs["position_ids"])
            self._seen[i] = (h.detach(), pe)
            layer = self.kv.layers[i]  # the keys before this step's update (a sliding window keeps W - 1)
            self._past_keys[i] = layer.keys.detach().clone() if getattr(layer, "is_initialized", False) else None

        return hook

    def _projections(self, i: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-RoPE query [B,H,S,D] and key [B,Hkv,S,D] of layer i from its weights."""
        blk = self.blocks[i]
        B, S, _ = h.shape
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        attn = _attention_module(blk)
        if self.is_gpt2:
            qkv = blk.attn.c_attn(h)
            q, k = qkv[..., : H * D], qkv[..., H * D : 2 * H * D]
        elif hasattr(attn, "query_key_value") and getattr(attn, "multi_query", False):  # Falcon: [H q | k | v]
            qkv = attn.query_key_value(h).view(B, S, H + 2, D)
            q, k = qkv[:, :, :H].reshape(B, S, H * D), qkv[:, :, H : H + 1].reshape(B, S, D)
        elif hasattr(attn, "query_key_value"):  # GPT-NeoX: fused per head [q | k | v] x heads
            qkv = attn.query_key_value(h).view(B, S, H, 3 * D).transpose(1, 2)
            q, k, _ = qkv.chunk(3, dim=-1)
            return q, k
        elif hasattr(attn, "qkv_proj"):  # Phi-3: fused [q | k | v]
            qkv = attn.qkv_proj(h)
            q, k = qkv[..., : H * D], qkv[..., H * D : H * D + Hkv * D]
        else:
            q, k = attn.q_proj(h), attn.k_proj(h)
            if hasattr(attn, "q_norm") and getattr(self.model.config, "model_type", "") == "olmo2":
                q, k = attn.q_norm(q), attn.k_norm(k)  # OLMo2 normalises the whole projection, before RoPE
            elif hasattr(attn, "q_norm"):  # Qwen3, Gemma3: each head normalised, before RoPE
                q, k = attn.q_norm(q.view(B, S, H, D)), attn.k_norm(k.view(B, S, Hkv, D))
        return (q.view(B, S, H, D).transpose(1, 2), k.view(B, S, Hkv, D).transpose(1, 2))

    def _mlp_hook(self, i: int):
        def hook(module, args, fresh):
            if isinstance(fresh, tuple):  # MoE blocks may also return router logits: replay the hidden states
                return (self._fastcar(i, fresh[0]), *fresh[1:])
            return self._fastcar(i, fresh)

        return hook

    def _fastcar(self, i: int, fresh: torch.Tensor) -> torch.Tensor:
        h, pe = self._seen[i]
        B, S, _ = fresh.shape
        P, L, vs = self._past, self.L, self.video_start
        cached = self.kv.layers[i].keys  # post-RoPE, this step's keys included (a sliding window: the last W - 1)
        q, k_new = self._projections(i, h)
        if pe is not None:
            cos, sin = pe[:2]
            rope = apply_rope_interleaved if len(pe) == 3 else apply_rope
            k_new = rope(k_new, cos, sin)
            if self.tas_query == "rope":
                q = rope(q, cos, sin)
        n = min(S, cached.shape[2])
        if self.check_rope and not torch.allclose(k_new[:, :, S - n :], cached[:, :, -n:], atol=1e-5, rtol=1e-5):
            raise AssertionError(f"layer {i}: reference keys (RoPE) disagree with the model's KV cache")
        # The keys attention saw: the cache before this step (all of it, or a sliding window) + this step's.
        past = self._past_keys.get(i)
        keys = k_new if past is None else torch.cat([past, k_new], dim=2)
        first = P + S - keys.shape[2]  # absolute position of keys[:, :, 0]
        g = self.num_heads // self.num_kv_heads
        tas = torch.full((B, S), float("nan"), dtype=torch.float64)
        for j in range(S):
            a = P + j - L
            if a >= 0:
                if a < first:
                    raise AssertionError(f"layer {i}: key of position {a} is outside the cache window")
                k = keys[:, :, a - first, :].double().repeat_interleave(g, dim=1)  # [B, H, D]: head h reads h // g
                tas[:, j] = (q[:, :, j, :].double() * k).sum(-1).mean(1) / math.sqrt(self.head_dim)
        used = fresh.clone()
        replay = torch.zeros((B, S), dtype=torch.bool)
        cache, age = self.mlp_cache[i], self.mlp_age[i]
        # a decode step (after the prefill) of at most L tokens decides every token as single-token steps
        # would: the tokens' slots are distinct, so each reads its slot as the previous frame left it
        for j in range(S) if P > 0 and S <= L else ():
            if P + j - L < vs:
                continue
            slot = (P + j - vs) % L
            a_old = age[:, slot]
            eligible = (a_old >= 0) & ((self.max_replay == 0) | (a_old < self.max_replay))
            replay[:, j] = eligible & (tas[:, j] > self.tau[i])
            used[replay[:, j], j] = cache[replay[:, j], slot].to(used.dtype)
        writes = [j for j in range(S) if P + j >= vs][-L:]
        for j in writes:
            slot = (P + j - vs) % L
            age[:, slot] = torch.where(replay[:, j], age[:, slot] + 1, torch.zeros_like(age[:, slot]))
            cache[:, slot] = used[:, j].detach()
        self._step_out.setdefault("replay", {})[i] = replay.numpy().copy()
        self._step_out.setdefault("tas", {})[i] = tas.numpy().copy()
        return used

    # ----------------------------------------------------------------------------- driving
    def reset(self, batch: int) -> None:
        """Start a new video: empty KV cache, MLP caches zero, ages -1 (never written)."""
        from transformers import DynamicCache

        self.kv = DynamicCache(config=self.model.config)
        self._past = 0
        self._past_keys: dict[int, torch.Tensor | None] = {}
        self.mlp_cache = {i: torch.zeros(batch, self.L, self.hidden) for i in self.layers}
        self.mlp_age = {i: torch.full((batch, self.L), -1, dtype=torch.int64) for i in self.layers}

    @torch.no_grad()
    def step(self, ids: np.ndarray | None, mask: np.ndarray, pos: np.ndarray,
             embeds: np.ndarray | None = None) -> tuple[np.ndarray, dict, dict]:
        """One forward step on token ids or (`embeds`, [B,S,hidden]) input embeddings; returns logits [B,S,V],
        replay {layer: [B,S]}, tas {layer: [B,S]}."""
        self._step_out = {}
        first = {"input_ids": torch.as_tensor(ids)} if embeds is None else {"inputs_embeds": torch.as_tensor(embeds)}
        out = self.model(
            **first,
            attention_mask=torch.as_tensor(mask),
            position_ids=torch.as_tensor(pos),
            past_key_values=self.kv,
            use_cache=True,
        )
        self._past += (ids if embeds is None else embeds).shape[1]
        return out.logits.float().numpy(), self._step_out.get("replay", {}), self._step_out.get("tas", {})

    def run(self, steps: list[np.ndarray], pad: Sequence[int] | None = None, greedy: int = 0) -> RefRun:
        """Teacher-forced over `steps` (step 0 = prompt), then `greedy` more argmax tokens, one per step."""
        B = int(steps[0].shape[0])
        self.reset(B)
        mask, pos = left_pad_masks(list(pad) if pad is not None else [0] * B, int(steps[0].shape[1]))
        res = RefRun()
        feed = [np.asarray(s, dtype=np.int64) for s in steps]
        k = 0
        while k < len(feed):
            ids = feed[k]
            if k > 0:
                s = ids.shape[1]
                pos = pos[:, -1:] + 1 + np.arange(s, dtype=np.int64)[None, :]
                mask = np.concatenate([mask, np.ones((B, s), dtype=np.int64)], axis=1)
            logits, replay, tas = self.step(ids, mask, pos)
            res.steps.append(ids)
            res.logits.append(logits)
            for i in self.layers:
                res.replay.setdefault(i, []).append(replay[i])
                res.tas.setdefault(i, []).append(tas[i])
            if k == len(feed) - 1 and greedy > 0:
                feed.append(logits[:, -1].argmax(-1).astype(np.int64)[:, None])
                greedy -= 1
            k += 1
        return res

    def close(self) -> None:
        """Remove the hooks: the wrapped model is plain again."""
        for hd in self._handles:
            hd.remove()
        self._handles = []

    def __enter__(self) -> FastCarReference:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _decoder_layers(model: nn.Module):
    """The decoder blocks of a transformers causal LM (GPT-2: transformer.h, GPT-NeoX: gpt_neox.layers)."""
    if hasattr(model, "transformer"):
        return model.transformer.h
    if hasattr(model, "gpt_neox"):
        return model.gpt_neox.layers
    return model.model.layers


def _attention_module(block: nn.Module) -> nn.Module:
    for name in ("self_attn", "self_attention", "attention", "attn"):
        if hasattr(block, name):
            return getattr(block, name)
    raise AttributeError(f"{type(block).__name__} has no attention module")


@torch.no_grad()
def plain_logits(
    model: nn.Module, steps: list[np.ndarray], pad: Sequence[int] | None = None
) -> list[np.ndarray]:
    """The unmodified transformers model over the same steps (KV cache carried)."""
    from transformers import DynamicCache

    B = int(steps[0].shape[0])
    mask, pos = left_pad_masks(list(pad) if pad is not None else [0] * B, int(steps[0].shape[1]))
    cache = DynamicCache(config=model.config)
    out = []
    for k, ids in enumerate(steps):
        if k > 0:
            s = ids.shape[1]
            pos = pos[:, -1:] + 1 + np.arange(s, dtype=np.int64)[None, :]
            mask = np.concatenate([mask, np.ones((B, s), dtype=np.int64)], axis=1)
        o = model(
            input_ids=torch.as_tensor(ids),
            attention_mask=torch.as_tensor(mask),
            position_ids=torch.as_tensor(pos),
            past_key_values=cache,
            use_cache=True,
        )
        out.append(o.logits.float().numpy())
    return out
