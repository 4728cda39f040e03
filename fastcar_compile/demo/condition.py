"""Token layout of the conditioned video model: VQ codes, then BOS, the unconditional token, VIDEO_START and
one token per conditioning label (derived from `scenes.LABELS`, declared there once).

Sequence = [BOS, camera, speed, objects, occluder, cut, scene, VIDEO_START, frame 0, frame 1, ...].
The unconditional prompt replaces every label with UNCOND (same length, so `video_start` never moves);
training drops the labels to it with some probability, which is what makes classifier-free guidance real:
logits = uncond + g * (cond - uncond) needs a model that has learnt both.
"""

from __future__ import annotations

import numpy as np

from fastcar_compile.core.errors import FastCarError
from fastcar_compile.demo.model import BOS, CODES
from fastcar_compile.demo.scenes import LABELS

UNCOND = CODES + 1
VIDEO_START_TOKEN = CODES + 2
LABEL0 = CODES + 3
FIELDS: tuple[str, ...] = tuple(LABELS)
_IDS: dict[tuple[str, str], int] = {}
for _field, _values in LABELS.items():
    for _value in _values:
        _IDS[(_field, _value)] = LABEL0 + len(_IDS)
VOCAB = LABEL0 + len(_IDS)
PROMPT_LEN = len(FIELDS) + 2  # BOS, labels, VIDEO_START
VIDEO_START = PROMPT_LEN  # KV index of the first frame token


def label_token(field: str, value: str) -> int:
    if (field, value) not in _IDS:
        raise FastCarError(f"unknown label {field}={value!r}; fields and values: {LABELS}")
    return _IDS[(field, value)]


def prompt(labels: dict[str, str] | None) -> list[int]:
    """The tokens before video_start; None gives the unconditional prompt."""
    if labels is None:
        return [BOS, *([UNCOND] * len(FIELDS)), VIDEO_START_TOKEN]
    missing = [f for f in FIELDS if f not in labels]
    if missing:
        raise FastCarError(f"labels miss the fields {missing}; every field of {FIELDS} is needed")
    return [BOS, *(label_token(f, labels[f]) for f in FIELDS), VIDEO_START_TOKEN]


def sequence(labels: dict[str, str] | None, frame_tokens: np.ndarray) -> np.ndarray:
    """Full sequence from per-frame tokens [T, L] (labels None: the unconditional prompt)."""
    return np.concatenate([np.asarray(prompt(labels), np.int64),
                           np.asarray(frame_tokens, np.int64).reshape(-1)])
