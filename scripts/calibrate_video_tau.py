"""Calibrate the demo's default threshold VIDEO_TAU (fastcar_compile/demo/bundled.py) on the conditioned video model.

    python scripts/calibrate_video_tau.py [--clips 4] [--frames 16] [--model-dir training/video_model]

The TAS quantiles along the model's sampled dense generations (the demo's decoding, sample seed 0) of
TRAINING-split scene clips, so the held-out clips that `demo` and `eval` report on never choose the threshold:
an MLP replays where TAS > tau, so the 20% quantile replays 80% of the decode-step MLPs along them, the 50% quantile 50%. Prints both, with the
per-layer replay at the 80% threshold. Re-run after retraining and copy the 80% value into VIDEO_TAU.
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np

from fastcar_compile.demo import scenes
from fastcar_compile.demo.bundled import VIDEO_MODEL_DIR, spec, video_files
from fastcar_compile.demo.evaluate import dense_tas
from fastcar_compile.demo.longvideo import long_onnx
from fastcar_compile.demo.vqvae import load_frame_tokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clips", type=int, default=4, help="training-split clips (default 4)")
    ap.add_argument("--frames", type=int, default=16, help="frames per clip incl. the given frame 0 (default 16)")
    ap.add_argument("--model-dir", type=Path, default=VIDEO_MODEL_DIR, help="weights, config and tokenizer folder")
    a = ap.parse_args()
    weights, config, tok_path = video_files(a.model_dir)
    s = replace(spec("video"), onnx=lambda: long_onnx(weights, config, name="the conditioned video model"))
    tok = load_frame_tokenizer(tok_path)
    clips = scenes.make_scene_clips("train", a.clips, a.frames, 0)
    with tempfile.TemporaryDirectory() as tmp:
        tas = dense_tas(s, s.onnx(), clips, tok, s.decoding, Path(tmp) / "diag.onnx")  # [steps, layers]
    tau80, tau50 = (float(np.quantile(tas, q)) for q in (0.2, 0.5))
    per_layer = " / ".join(f"{100 * np.mean(tas[:, j] > tau80):.0f}" for j in range(tas.shape[1]))
    print(f"{a.clips} training-split clips x {a.frames} frames, {tas.shape[0]} decode steps x {tas.shape[1]} layers")
    print(f"tau for 80% replay: {tau80:.4g}   (per layer: {per_layer} %)")
    print(f"tau for 50% replay: {tau50:.4g}")


if __name__ == "__main__":
    main()
