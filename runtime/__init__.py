"""fastcar_compile.runtime: run FastCar-compiled (and dense) decoders in ONNX Runtime.

`FastCarSession(path).generate(prompt_ids, num_frames)` returns tokens plus `RunStats` (replay ratios,
timings, the replay trace). `calibrate_threshold` picks tau for a target replay ratio or a quality budget;
writing it into fast.onnx is the compiler's `fastcar_compile.api.bake_threshold` (the runtime never imports
the compiler).
"""

from __future__ import annotations

from typing import Any

from fastcar_compile.runtime.session import DecodeState, FastCarSession, StepOutput
from fastcar_compile.runtime.stats import RunStats

__all__ = ["DecodeState", "FastCarSession", "GenerationResult", "RunStats", "StepOutput",
           "calibrate_threshold", "CalibrationResult", "generate"]


def __getattr__(name: str) -> Any:  # lazy: generation/calibration pull in tqdm and onnx
    if name in ("generate", "GenerationResult"):
        from fastcar_compile.runtime import decode as g

        return getattr(g, name)
    if name in ("calibrate_threshold", "CalibrationResult"):
        from fastcar_compile.runtime import calibrate as c

        return getattr(c, name)
    raise AttributeError(name)
