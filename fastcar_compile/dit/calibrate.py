"""`--calibrate-replay` on a DiT step graph: the tau giving a replay ratio, from the TAS the compiled graph outputs
on a short stream (the decoders' one-pass calibration, runtime/calibrate.py, for the DiT target)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np

from fastcar_compile import api
from fastcar_compile.dit.stream import OrtDiT, StreamSettings, rollout
from fastcar_compile.runtime.calib_stats import tau_for_share

PROBE_TAU = 3e38  # above any TAS: the probe computes and outputs TAS but replays nothing


def calibrate_threshold(path: str | os.PathLike, ratio: float, *, text: np.ndarray | None = None, frames: int = 3,
                        **options) -> float:
    """The tau giving FFN replay ratio `ratio` over the eligible rows: a probe compiled with FastCar on and a tau
    no TAS exceeds streams `frames` frames (at least two chunks; the prompt `text` [L, text_dim] or a seeded
    random one) and the quantile of the TAS it outputs is the tau. `options`: the compile's other options
    (TempCache, AnnSA and AnnCA change the rollout whose TAS sets tau: the probe has them)."""
    options = {k: v for k, v in options.items() if k not in ("threshold", "validate")}
    with tempfile.TemporaryDirectory() as tmp:
        probe = Path(tmp) / "probe.onnx"
        api.compile(path, probe, threshold=(PROBE_TAU,), validate=False, **options)
        runtime = OrtDiT(probe)
        runtime.tas_log = []
        for _ in rollout(runtime, StreamSettings(frames=max(frames, 2 * runtime.cfg.chunk_frames)), text):
            pass
    return tau_for_share(np.concatenate(runtime.tas_log), ratio)
