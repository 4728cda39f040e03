"""Generate with a transformers LLaMA whose attention runs on the FAST-AR NumPy reference (reference path).

Why: the compressed-attention ONNX op does not exist yet (docs/fastar.md); quality per mode (PSNR/SSIM of
whole videos) needs the modes *inside* generation, not replayed on a fixed trace. transformers lets a model
call a registered attention function; ours gets the post-RoPE query/keys and the values of each layer, feeds
every new token into per-KV-head `HeadCache`s (pre-RoPE key recovered by rotating back, exact up to float
rounding) and returns the compressed attention output. Dense attention over the same tokens runs on the side
for density and recall per layer (definitions: `attention.py`). Slow (NumPy per head and token): for
measurements, not for deployment. Numbers from here are labelled "reference path".
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from fastcar_compile.core.errors import FastCarError
from fastcar_compile.fastar.attention import dense_step, recall_and_kept, slot_bytes
from fastcar_compile.fastar.cache import HeadCache, hasher
from fastcar_compile.fastar.config import KVCompressConfig
from fastcar_compile.fastar.rope import apply_rope

IMPL = "fastar_reference"


@dataclass
class LayerStats:
    """Per layer, accumulated over measured steps (queries at positions >= measure_from)."""

    executed: int = 0
    dense: int = 0
    recall: list[float] = field(default_factory=list)
    kept: list[float] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)  # resident slots per KV head after each step (mean)
    prefix: list[float] = field(default_factory=list)  # dense softmax mass on the prompt prefix (anchors)

    def summary(self) -> dict:
        return {"density": self.executed / self.dense if self.dense else float("nan"),
                "recall": float(np.mean(self.recall)) if self.recall else float("nan"),
                "kept_mass": float(np.mean(self.kept)) if self.kept else float("nan"),
                "slots_last": float(self.slots[-1]) if self.slots else 0.0,
                "prefix_mass": float(np.mean(self.prefix)) if self.prefix else float("nan")}


class ReferenceAttention:
    """Per-layer compressed caches for one sequence (batch 1); `cfgs[layer]` None = dense (exact)."""

    def __init__(self, cfgs: list[KVCompressConfig | None], max_tokens: int, theta: float,
                 measure_from: int = 0, prefix_len: int = 0) -> None:
        self.cfgs, self.max_tokens, self.theta, self.measure_from = cfgs, max_tokens, theta, measure_from
        self.prefix_len = prefix_len  # prompt tokens before video_start: their dense mass is recorded
        self.caches: dict[int, list[HeadCache]] = {}
        self.stats = [LayerStats() for _ in cfgs]

    def _caches(self, layer: int, hkv: int, d: int) -> list[HeadCache]:
        if layer not in self.caches:
            cfg = self.cfgs[layer] or KVCompressConfig()
            self.caches[layer] = [HeadCache(cfg, d, self.max_tokens, self.theta, hasher(cfg, d))
                                  for _ in range(hkv)]
        return self.caches[layer]

    def attend(self, layer: int, query, key, value):
        """query [1, Hq, S, d] post-RoPE; key/value [1, Hkv, T, d] (keys post-RoPE), the last S new."""
        import torch

        q = query[0].detach().double().numpy()
        k = key[0].detach().double().numpy()
        v = value[0].detach().double().numpy()
        hq, S, d = q.shape
        hkv, T = k.shape[0], k.shape[1]
        if T > self.max_tokens:
            raise FastCarError(f"sequence of {T} tokens exceeds the reference caches' {self.max_tokens}")
        group = hq // hkv
        caches = self._caches(layer, hkv, d)
        st = self.stats[layer]
        out = np.zeros((S, hq, d))
        for i in range(S):
            p = T - S + i
            for j, c in enumerate(caches):
                if c.seen != p:
                    raise FastCarError(f"layer {layer}: reference cache holds {c.seen} tokens, the model sent "
                                       f"position {p}; generate one sequence from its start")
                c.append(apply_rope(k[j, p], -p, self.theta), v[j, p])
            for h in range(hq):
                c = caches[h // group]
                slots = c.select(q[h, i])
                out[i, h], w = c.attend(q[h, i], slots)
                if p >= self.measure_from:
                    _, w_dense = dense_step(q[h, i], k[h // group, : p + 1], v[h // group, : p + 1])
                    r, m = recall_and_kept(c, slots, w, w_dense)
                    st.executed += slots.size
                    st.dense += p + 1
                    st.recall.append(r)
                    st.kept.append(m)
                    st.prefix.append(float(w_dense[: self.prefix_len].sum()))
            if p >= self.measure_from:
                st.slots.append(int(np.mean([c.slots_used() for c in caches])))
        return torch.from_numpy(out[None]).to(query.dtype), None

    def kv_bytes(self, bytes_per: int = 2) -> tuple[int, int]:
        """(resident KV bytes, dense KV bytes) over all layers and KV heads now."""
        got = dense = 0
        for caches in self.caches.values():
            for c in caches:
                got += c.slots_used() * slot_bytes(c.cfg, c.k_post.shape[1], bytes_per)
                dense += c.seen * 2 * c.k_post.shape[1] * bytes_per
        return got, dense


_ACTIVE: list[ReferenceAttention] = []


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **_kw):
    if not _ACTIVE:
        raise FastCarError(f"attention implementation {IMPL!r} used outside fastar.generate.reference_attention")
    return _ACTIVE[-1].attend(module.layer_idx, query, key, value)


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(IMPL, _attention)


@contextmanager
def reference_attention(model, ref: ReferenceAttention):
    """Within the block, `model`'s attention runs through `ref` (restores the previous implementation)."""
    _register()
    prev = model.config._attn_implementation
    model.set_attn_implementation(IMPL)
    _ACTIVE.append(ref)
    try:
        yield ref
    finally:
        _ACTIVE.pop()
        model.set_attn_implementation(prev)


def generate(model, prompt_ids: list[int], new_tokens: int, cfgs: list[KVCompressConfig | None],
             vocab_limit: int, measure_from: int = 0, progress: bool = False, prefix_len: int = 0
             ) -> tuple[np.ndarray, ReferenceAttention]:
    """Greedy: the prompt ids, then `new_tokens` tokens (argmax over ids < vocab_limit), attention on the
    reference. Returns (generated ids [new_tokens], the reference state with per-layer stats)."""
    import torch

    from fastcar_compile.core.progress import bar

    if len(cfgs) != model.config.num_hidden_layers:
        raise FastCarError(f"give one KV config (or None) per layer: {model.config.num_hidden_layers}, got {len(cfgs)}")
    theta = float(model.config.rope_parameters["rope_theta"])
    ref = ReferenceAttention(cfgs, len(prompt_ids) + new_tokens, theta, measure_from, prefix_len)
    out = np.empty(new_tokens, np.int64)
    with reference_attention(model, ref), torch.no_grad():
        res = model(input_ids=torch.tensor([prompt_ids]), use_cache=True)
        past = res.past_key_values
        for t in bar(range(new_tokens), desc="reference path", enabled=progress, leave=False):
            out[t] = int(res.logits[0, -1, :vocab_limit].argmax())
            if t + 1 == new_tokens:
                break
            res = model(input_ids=torch.tensor([[out[t]]]), past_key_values=past, use_cache=True)
            past = res.past_key_values
    return out, ref
