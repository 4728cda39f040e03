"""Sliding-window KV caches: give the temporal gate keys indexed by absolute position.

`ai.fastcar.TemporalGate` takes the position of the current tokens from the key tensor's length
(P = T - S) and reads the key at KV index p - L from it. A sliding-window layer (Mistral, Gemma2's local
layers) keeps only the last W - 1 positions, so its keys are shorter than the absolute position. The
attention_mask spans every position (past and current), so the keys attention reads are left-padded with
zeros up to its length: position p is then at index p, and the key at p - L is one attention really saw
as long as the window is longer than a frame (W - 1 >= L; discovery refuses shorter windows). The padding
is never read but costs T x kv_heads x head_dim zeros per layer and step.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from fastcar_compile.core.errors import FastCarError

ATTENTION_MASK = "attention_mask"


def mask_input(graph: ir.Graph) -> ir.Value | None:
    """The graph's attention_mask input ([batch, past + current]), whose length is the absolute position."""
    return next((v for v in graph.inputs if v.name == ATTENTION_MASK), None)


def gate_keys(graph: ir.Graph, b: Callable[..., ir.Value], att, frame_tokens: int) -> ir.Value:
    """The key tensor to hand TemporalGate: the present key, or the window's keys padded to absolute length."""
    if not att.sliding_window:
        return att.present_key
    if att.window is not None and att.window < frame_tokens:
        raise FastCarError(f"layer {att.present_key.name}: its sliding-window cache keeps {att.window} positions, "
                           f"fewer than --frame-tokens {frame_tokens}: the key one frame back is gone; "
                           "FastCar needs a window of at least one frame")
    mask = mask_input(graph)
    assert mask is not None, "discovery refuses a sliding-window layer without an attention_mask input"

    def const(array: np.ndarray) -> ir.Value:
        return b("Constant", [], {"value": ir.tensor(array)})

    keys = att.keys
    kshape = b("Shape", [keys])
    lead = b("Slice", [kshape, const(np.array([0], np.int64)), const(np.array([2], np.int64))])  # [B, Hkv]
    head_dim = b("Slice", [kshape, const(np.array([3], np.int64)), const(np.array([4], np.int64))])
    total = b("Shape", [mask], {"start": 1, "end": 2})
    kept = b("Shape", [keys], {"start": 2, "end": 3})
    pad = b("Concat", [lead, b("Sub", [total, kept]), head_dim], {"axis": 0})
    zeros = b("Expand", [b("CastLike", [const(np.array(0.0, np.float32)), keys]), pad])
    return b("Concat", [zeros, keys], {"axis": 2})
