"""The demo's video models as `demo` / `eval` see them: where the decoder ONNX comes from, the tokenizer, the
held-out clips, each clip's prompt (and the unconditional prompt, when the model has one), and the
recommended decoding.

Three models: the 1-layer `small` model and the 4-layer `long` model (both bundled in the package, trained on
`data.make_clip`'s single-motion clips, conditioned on one motion token, no unconditional prompt), and the
conditioned 6-layer `video` model (`training/video_model/`: scene clips, six label tokens, an unconditional
prompt, so classifier-free guidance is real).

Why the `video` model is read from the repository's training/video_model/ and not from the package's assets:
its fp16 weights are 22.6 MB, over the package's 20 MiB asset budget on their own (tests/test_demo_export),
and its VQ-VAE tokenizer decodes in PyTorch. It is the default of `demo` in a clone of the repository;
`--demo-model small` runs the bundled models without it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from fastcar_compile.core.errors import FastCarError
from fastcar_compile.demo.decoding import SAMPLED, Decoding
from fastcar_compile.demo.spec import VideoSpec

SMALL_TAU = 33.0  # post-RoPE TAS giving ~80% replay on the 1-layer model (docs/demo.md, eval sweep)
# post-RoPE TAS: 80% replay along sampled dense videos of 4 training-split clips x 16 frames; re-measure with
# scripts/calibrate_video_tau.py after retraining
VIDEO_TAU = 1.62
VIDEO_MODEL_DIR = Path(__file__).resolve().parents[2] / "training" / "video_model"


def _small() -> VideoSpec:
    from fastcar_compile.demo import data, model
    from fastcar_compile.demo.export import ONNX, TOKENIZER
    from fastcar_compile.demo.tokenizer import PatchTokenizer

    # sampled without CFG (no unconditional prompt was trained), VILA-U's top-p
    return VideoSpec("small", lambda: ONNX, lambda: PatchTokenizer.load(TOKENIZER),
                     lambda n, f, s: data.make_clips("eval", n, f, seed=s),
                     lambda c: model.prompt(c.motion), lambda c: c.motion, None, model.VIDEO_START, model.CODES,
                     Decoding(do_sample=True, temperature=1.0, top_k=SAMPLED.top_k, top_p=SAMPLED.top_p),
                     SMALL_TAU, 16, 8)


def _long() -> VideoSpec:
    from fastcar_compile.demo.longvideo import DEFAULT_LONG_TAU, LONG_CLIPS, LONG_FRAMES, long_onnx

    return replace(_small(), name="long", onnx=long_onnx, default_tau=DEFAULT_LONG_TAU, default_clips=LONG_CLIPS,
                   default_frames=LONG_FRAMES)


def video_files(folder: Path = VIDEO_MODEL_DIR) -> tuple[Path, Path, Path]:
    """(weights, config, tokenizer) of the conditioned model; a one-line error naming the fix when absent."""
    files = (folder / "video.safetensors", folder / "video.json", folder / "video_tokenizer.npz")
    missing = [p.name for p in files if not p.is_file()]
    if missing:
        raise FastCarError(f"the conditioned video model's {', '.join(missing)} not found in {folder} (it ships "
                           "with the repository, not the package: run from a clone, or use --demo-model small)")
    return files


def _video() -> VideoSpec:
    from fastcar_compile.demo import condition
    from fastcar_compile.demo.longvideo import long_onnx
    from fastcar_compile.demo.model import CODES
    from fastcar_compile.demo.vqvae import load_frame_tokenizer

    weights, config, tok = video_files()
    return VideoSpec("video", lambda: long_onnx(weights, config, name="the conditioned video model"),
                     lambda: load_frame_tokenizer(tok),
                     lambda n, f, s: heldout_scene_clips(n, f, s),
                     lambda c: condition.prompt(c.labels), lambda c: c.labels["camera"],
                     condition.prompt(None), condition.VIDEO_START, CODES, SAMPLED, VIDEO_TAU, 4, 16,
                     timing_rounds=1)


def _video_long() -> VideoSpec:
    return replace(_video(), default_clips=2, default_frames=64)


def heldout_scene_clips(count: int, frames: int, seed: int) -> list:
    """Held-out scene clips with labels drawn, except every 4th: a clean pan (constant speed, no object,
    occluder or cut), whose known shift the evaluation recovers from the generated pixels."""
    from fastcar_compile.demo import scenes
    from fastcar_compile.demo.quality import PANS

    out = []
    for i in range(count):
        fixed = None
        if i % 4 == 3:
            k = i // 4
            fixed = {"camera": PANS[k % len(PANS)], "speed": ("slow", "fast")[k % 2], "objects": "objects_0",
                     "occluder": "no_occluder", "cut": "no_cut"}
        out.append(scenes.make_scene_clip("eval", i, frames, seed, labels=fixed))
    return out


# (model, --long) -> the spec: `small --long` is the bundled 4-layer model; `video --long` the same model, longer
SPECS: dict[tuple[str, bool], Callable[[], VideoSpec]] = {
    ("video", False): _video, ("video", True): _video_long, ("small", False): _small, ("small", True): _long}
DEMO_MODELS = ("video", "small")


def spec(name: str, long: bool = False) -> VideoSpec:
    if (name, bool(long)) not in SPECS:
        raise FastCarError(f"unknown demo model {name!r}; one of {list(DEMO_MODELS)}")
    return SPECS[name, bool(long)]()

