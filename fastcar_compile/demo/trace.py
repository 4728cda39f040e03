"""Capture one decoder's attention traces (pre-RoPE q/k, v, and the model's own attention output per layer).

Greedy generation with the eager PyTorch model gives the token sequence; one causal forward over the whole
sequence then yields the same q/k/v that incremental decoding would (causal attention), in one pass. The
attention output (input of o_proj) is kept so tests can check the NumPy reference against transformers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class LayerTrace:
    q: np.ndarray  # [T, Hq, d] pre-RoPE
    k: np.ndarray  # [T, Hkv, d] pre-RoPE
    v: np.ndarray  # [T, Hkv, d]
    attn_out: np.ndarray  # [T, Hq, d] transformers' attention output (before o_proj)


@dataclass
class ModelTrace:
    tokens: np.ndarray  # [T]
    layers: list[LayerTrace]
    rope_theta: float
    frame_tokens: int
    video_start: int


def capture(model, ids: np.ndarray) -> list[LayerTrace]:
    """Per-layer q/k/v/attention output of a LLaMA-style transformers model on token ids [T] (batch 1)."""
    import torch

    cfg = model.config
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // hq
    store: dict[tuple[int, str], np.ndarray] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        at = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):
            hooks.append(getattr(at, name).register_forward_hook(
                lambda _m, _a, out, i=i, name=name: store.__setitem__((i, name), out[0].detach().numpy())))
        hooks.append(at.o_proj.register_forward_pre_hook(
            lambda _m, args, i=i: store.__setitem__((i, "o"), args[0][0].detach().numpy())))
    try:
        with torch.no_grad():
            model(input_ids=torch.as_tensor(np.asarray(ids, np.int64))[None], use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    T = len(ids)
    return [LayerTrace(q=store[(i, "q_proj")].reshape(T, hq, d), k=store[(i, "k_proj")].reshape(T, hkv, d),
                       v=store[(i, "v_proj")].reshape(T, hkv, d), attn_out=store[(i, "o")].reshape(T, hq, d))
            for i in range(len(model.model.layers))]


TRACE_SOURCES = ("generated", "clip")


def demo_trace(frames: int = 8, clip: int = 0, source: str = "generated", long: bool = False) -> ModelTrace:
    """The bundled demo model's attention (`long`: the 4-layer long-video model's) on `frames` frames of eval
    clip `clip`.

    source 'generated': the model continues greedily from the clip's first frame (what a user runs; the demo
    model's greedy videos are nearly static, so keys recur a lot). 'clip': teacher-forced on the clip's own
    tokens (real camera motion: fewer recurring keys).
    """
    from fastcar_compile.core.errors import FastCarError
    from fastcar_compile.demo import data
    from fastcar_compile.demo.evaluate import load_tokenizer
    from fastcar_compile.demo.export import load_model
    from fastcar_compile.demo.generate import torch_generate
    from fastcar_compile.demo.model import VIDEO_START, sequence

    if source not in TRACE_SOURCES:
        raise FastCarError(f"trace source must be one of {TRACE_SOURCES}, got {source!r}")
    if long:
        from fastcar_compile.demo.export import LONG_CONFIG, LONG_WEIGHTS

        model = load_model(LONG_WEIGHTS, LONG_CONFIG)
    else:
        model = load_model()
    tok = load_tokenizer()
    c = data.make_clip("eval", clip, frames=frames if source == "clip" else 2)
    toks = tok.encode(c.frames).reshape(len(c.frames), -1)
    frame_tokens = toks.shape[1]
    gen = torch_generate(model, c.motion, toks[0], frames - 1) if source == "generated" else toks
    ids = sequence(c.motion, gen)
    theta = float(model.config.rope_parameters["rope_theta"])
    return ModelTrace(ids, capture(model, ids), theta, frame_tokens, VIDEO_START)
