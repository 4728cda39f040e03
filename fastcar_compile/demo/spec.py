"""What the demo / eval pipeline needs of one video model (the models themselves: `demo.bundled`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastcar_compile.demo.decoding import Decoding


@dataclass(frozen=True)
class VideoSpec:
    """What the demo pipeline needs of one video model."""

    name: str
    onnx: Callable[[], Path]  # the dense decoder ONNX (exported on first use where not bundled)
    tokenizer: Callable[[], Any]  # encode [..., H, W, 3] -> [..., L]; decode back; tokens_per_frame; frame
    clips: Callable[[int, int, int], list]  # (count, frames, seed) -> held-out clips (.frames, .source)
    prompt: Callable[[Any], list[int]]  # clip -> the tokens before frame 0
    motion: Callable[[Any], str]  # clip -> its motion, as tables name it
    uncond: list[int] | None  # the unconditional prompt (CFG), None where the model was not trained with one
    video_start: int  # KV index of frame 0
    codes: int  # image codes are token ids [0, codes)
    decoding: Decoding  # recommended decoding
    default_tau: float  # TAS threshold of the demo (~80% replay along its dense videos)
    default_clips: int
    default_frames: int  # incl. the given frame 0
    timing_rounds: int = 2  # bare-ORT re-timings per model and clip in `demo` (the fastest per step counts)
