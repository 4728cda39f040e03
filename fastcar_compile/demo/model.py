"""The demo's video decoder: a small transformers LlamaForCausalLM over VQ tokens, and its sequence layout.

Sequence = [BOS, motion token, VIDEO_START, frame 0 (L tokens), frame 1, ...]; `video_start` = 3 is the
KV index of the first video token (docs/DESIGN.md). Frames follow each other with no separator, so the
token at p - L is the same spatial position one frame earlier: FastCar's aligned token.

The config is MLP-heavy on purpose: FastCar only skips MLPs, so the per-token speedup at replay ratio r is
bounded by 1 / (1 - f r) with f the MLP share of a decode step. Measured in ORT CPU (1 thread, batch 1):
a second layer costs ~60 small nodes (~40 us) of non-MLP work, so within the 20 MB budget 2 layers gave
f = 0.57 and 1 layer with a 24x-wide MLP f = 0.62-0.64; the 1-layer model is the default.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from fastcar_compile.core.errors import FastCarError
from fastcar_compile.demo.data import MOTIONS

CODES = 512  # tokenizer codebook size: token ids [0, CODES)
BOS = CODES
MOTION0 = CODES + 1  # motion tokens MOTION0 + MOTIONS.index(name)
VIDEO_START_TOKEN = MOTION0 + len(MOTIONS)
VOCAB = VIDEO_START_TOKEN + 1
PROMPT_LEN = 3  # BOS, motion, VIDEO_START
VIDEO_START = PROMPT_LEN  # KV index of the first frame token


@dataclass(frozen=True)
class DemoConfig:
    """Model sizes (saved next to the weights so a loader never guesses)."""

    hidden_size: int = 192
    intermediate_size: int = 4608
    num_hidden_layers: int = 1
    num_attention_heads: int = 6
    num_key_value_heads: int = 6
    vocab_size: int = VOCAB
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0
    attention_bias: bool = True
    # Heads initialised to look a fixed distance back (L - 1 = the token to predict, one frame earlier, and
    # its neighbours one patch left/right/up/down); the remaining heads start free. See `_init_copy_heads`.
    copy_offsets: tuple[int, ...] = (63, 62, 64, 55, 71)
    copy_scale: float = 4.5
    # Layers whose first heads get the copy init; None = every layer (the 1-layer model's setting).
    copy_layers: tuple[int, ...] | None = None
    # RoPE frequency of each rotary pair (radians per position) instead of rope_theta's geometric ladder: a
    # per-pair choice as LongRoPE's rescaling makes (the world model's; None = the ladder)
    rope_frequencies: tuple[float, ...] | None = None

    def to_dict(self) -> dict:
        return asdict(self)


# The long-video demo model (`fastcar-compile demo --long`): 4 layers so per-layer replay patterns show, trained
# on 16-frame clips with random position gaps so it holds to 64 frames (4099 positions). Sized to fit the
# package's 20 MiB asset budget next to the 1-layer model as fp16 safetensors only (1.2 M parameters,
# 2.4 MB); its ONNX is exported on first use. Copy heads only in layer 0: later layers learn their own.
LONG_CONFIG = DemoConfig(hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=4, max_position_embeddings=4160, copy_offsets=(63, 62, 64, 55),
                         copy_layers=(0,))


def llama_config(cfg: DemoConfig):
    import transformers as tf

    c = tf.LlamaConfig(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                       num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
                       num_key_value_heads=cfg.num_key_value_heads, vocab_size=cfg.vocab_size,
                       max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=1e-5,
                       tie_word_embeddings=False, bos_token_id=BOS, eos_token_id=None, pad_token_id=None,
                       rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
                       attention_bias=cfg.attention_bias)
    c._attn_implementation = "eager"
    return c


def build_model(cfg: DemoConfig, seed: int = 0):
    """A seeded, freshly initialised LlamaForCausalLM in float32 (copy heads initialised, see below)."""
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.LlamaForCausalLM(llama_config(cfg)).float()
    if cfg.rope_frequencies is not None:
        set_rope_frequencies(model, cfg.rope_frequencies)
    if cfg.attention_bias and cfg.copy_offsets:
        _init_copy_heads(model, cfg)
    return model


def set_rope_frequencies(model, frequencies) -> None:
    """Use these rotary frequencies (one per pair of head dimensions): the export bakes them into its cos/sin."""
    import torch

    rot = model.model.rotary_emb
    f = torch.as_tensor(np.asarray(frequencies, np.float64), dtype=torch.float32)
    if f.shape != rot.inv_freq.shape:
        raise FastCarError(f"rope_frequencies has {f.numel()} values; the model's heads need {rot.inv_freq.numel()}")
    rot.inv_freq = f.clone()
    rot.original_inv_freq = f.clone()


def _init_copy_heads(model, cfg: DemoConfig) -> None:
    """Bias-only queries/keys whose RoPE score peaks at a fixed offset: q = a, k = a * e^{i offset theta}
    per rotary pair, so q_m . k_n = a^2 sum_i cos((m - n - offset) theta_i), largest at m - n = offset.

    Why: a 1-layer model trained for minutes on CPU did not discover "look one frame back" by itself
    (diffuse attention, teacher-forced accuracy below plain copying). With these heads the copy path only
    needs its value/output maps learnt; the biases stay trainable.
    """
    import torch

    hd = cfg.hidden_size // cfg.num_attention_heads
    half = hd // 2
    theta = cfg.rope_theta ** (-torch.arange(half, dtype=torch.float64) * 2 / hd)
    a = cfg.copy_scale
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            if cfg.copy_layers is not None and i not in cfg.copy_layers:
                continue
            attn = layer.self_attn
            for h, off in enumerate(cfg.copy_offsets[: cfg.num_key_value_heads]):
                q = torch.full((hd,), 0.0, dtype=torch.float64)
                q[:half] = a
                k = torch.cat([a * torch.cos(off * theta), a * torch.sin(off * theta)])
                attn.q_proj.bias[h * hd:(h + 1) * hd] = q.float()
                attn.k_proj.bias[h * hd:(h + 1) * hd] = k.float()


def motion_token(motion: str) -> int:
    if motion not in MOTIONS:
        raise FastCarError(f"unknown motion {motion!r}; expected one of {MOTIONS}")
    return MOTION0 + MOTIONS.index(motion)


def prompt(motion: str) -> list[int]:
    """The tokens before video_start."""
    return [BOS, motion_token(motion), VIDEO_START_TOKEN]


def sequence(motion: str, frame_tokens: np.ndarray) -> np.ndarray:
    """Full training sequence from per-frame tokens [T, L]."""
    return np.concatenate([np.asarray(prompt(motion), np.int64), np.asarray(frame_tokens, np.int64).reshape(-1)])
