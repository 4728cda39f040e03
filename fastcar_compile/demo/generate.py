"""Greedy video generation: eager PyTorch reference (for training reports and tests).

Only codebook tokens may be emitted (special tokens are masked), so every generated frame decodes.
"""

from __future__ import annotations

import numpy as np

from fastcar_compile.demo.model import CODES, prompt


def torch_generate(model, motion: str, frame0: np.ndarray, new_frames: int) -> np.ndarray:
    """Frames [1 + new_frames, L] of token ids: frame0 given, the rest greedy with a KV cache."""
    import torch

    L = int(len(frame0))
    ids = torch.tensor([prompt(motion) + [int(t) for t in frame0]], dtype=torch.long)
    out = []
    with torch.no_grad():
        res = model(input_ids=ids, use_cache=True)
        past = res.past_key_values
        logits = res.logits[:, -1, :CODES]
        for _ in range(new_frames * L):
            nxt = logits.argmax(-1, keepdim=True)
            out.append(int(nxt))
            res = model(input_ids=nxt, past_key_values=past, use_cache=True)
            past = res.past_key_values
            logits = res.logits[:, -1, :CODES]
    return np.concatenate([np.asarray(frame0, np.int64), np.asarray(out, np.int64)]).reshape(1 + new_frames, L)
