"""Scene clips of the conditioned video model: seeded, labelled, split-clean, and their motion is real (a pan's
shift is recovered from the pixels by scikit-image's phase correlation); the copy rate of tokenized clips."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("skimage")
pytest.importorskip("sklearn")

from fastcar_compile.core.errors import FastCarError  # noqa: E402
from fastcar_compile.demo import condition, scenes  # noqa: E402
from fastcar_compile.demo.data import EVAL_SOURCES, FRAME, TRAIN_SOURCES  # noqa: E402
from fastcar_compile.demo.metrics import copy_rate  # noqa: E402

STILL = {"objects": "objects_0", "occluder": "no_occluder", "cut": "no_cut"}


def test_deterministic_per_seed_and_labelled() -> None:
    a = scenes.make_scene_clips("train", 5, frames=16, seed=3)
    b = scenes.make_scene_clips("train", 5, frames=16, seed=3)
    c = scenes.make_scene_clips("train", 5, frames=16, seed=4)
    for x, y in zip(a, b, strict=True):
        assert x.frames.shape == (16, FRAME, FRAME, 3) and x.frames.dtype == np.uint8
        np.testing.assert_array_equal(x.frames, y.frames)
        assert x.labels == y.labels and set(x.labels) == set(scenes.LABELS)
        assert all(v in scenes.LABELS[k] for k, v in x.labels.items())
        assert len(condition.prompt(x.labels)) == condition.VIDEO_START
    assert any(not np.array_equal(x.frames, z.frames) for x, z in zip(a, c, strict=True))


def test_splits_use_their_own_photographs() -> None:
    for split, allowed in (("eval", EVAL_SOURCES), ("train", TRAIN_SOURCES)):
        for c in scenes.make_scene_clips(split, 12, frames=4):
            assert all(s in allowed for s in c.source.split("+"))
            assert c.labels["scene"] == scenes.SCENES[c.source.split("+")[0]]


@pytest.mark.parametrize("camera", ["pan_right", "pan_up_left", "pan_down", "pan_left"])
def test_pan_shift_recovered_by_phase_correlation(camera) -> None:
    """The camera path says how far the view moves (source px / scale = frame px); skimage recovers it."""
    from skimage.filters import window
    from skimage.registration import phase_cross_correlation

    for i in range(2):
        c = scenes.make_scene_clip("eval", i, 16, labels={"camera": camera, "speed": "slow", **STILL})
        grey = c.frames.astype(np.float64).mean(-1)
        w = window("hann", grey.shape[1:])
        for t in (0, 6, 12):
            shift, _, _ = phase_cross_correlation(grey[t] * w, grey[t + 2] * w, upsample_factor=10)
            true = (c.camera[t + 2, :2] - c.camera[t, :2]) / c.camera[t, 2]
            assert np.hypot(*true) > 1.0  # the pan really moves
            np.testing.assert_allclose(shift[::-1], true, atol=0.5)


def test_labels_describe_the_clip() -> None:
    """Static camera: the background never moves; a cut: the frames before and after it differ most there;
    an occluder: some frame holds a full row or column of one colour."""
    c = scenes.make_scene_clip("train", 0, 8, labels={"camera": "static", **STILL})
    assert c.labels["speed"] == "none"
    assert np.array_equal(c.frames[0], c.frames[-1])
    c = scenes.make_scene_clip("train", 1, 16, labels={"camera": "pan_left", "speed": "slow",
                                                       "objects": "objects_0", "cut": "cut"})
    diffs = np.abs(np.diff(c.frames.astype(int), axis=0)).mean((1, 2, 3))
    assert 0 < c.cut_at < 16 and int(diffs.argmax()) == c.cut_at - 1
    c = scenes.make_scene_clip("train", 2, 16, labels={"occluder": "occluder", "camera": "static"})
    flat = [(f == f[:, :1]).all(axis=(1, 2)).any() or (f == f[:1]).all(axis=(0, 2)).any() for f in c.frames]
    assert any(flat)


def test_speed_changes_show_in_the_camera_path() -> None:
    for speed, sign in (("speed_up", 1), ("slow_down", -1)):
        c = scenes.make_scene_clip("train", 3, 16, labels={"camera": "pan_right", "speed": speed, **STILL})
        step = np.diff(c.camera[:, 0])
        assert sign * (step[-1] - step[0]) > 0
    c = scenes.make_scene_clip("train", 4, 16, labels={"camera": "rotate_cw", "speed": "fast", **STILL})
    assert np.all(np.diff(c.camera[:, 3]) < 0)


def test_bad_arguments() -> None:
    with pytest.raises(FastCarError, match="split"):
        scenes.make_scene_clip("test", 0)
    with pytest.raises(FastCarError, match="at least"):
        scenes.make_scene_clip("train", 0, frames=2)
    with pytest.raises(FastCarError, match="unknown label"):
        scenes.make_scene_clip("train", 0, labels={"camera": "dolly"})


def test_copy_rate_of_tokenized_clips() -> None:
    """copy_rate against a loop reference, and reported for the shipped video tokenizer on held-out clips:
    the richer motion must leave well under the 1-layer demo clips' hold-still share of tokens."""
    import importlib.util
    from pathlib import Path

    from fastcar_compile.demo.vqvae import load_frame_tokenizer

    script = Path(__file__).parents[1] / "scripts" / "train_video_model.py"
    spec = importlib.util.spec_from_file_location("train_video_model", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    codes = np.random.default_rng(0).integers(0, 3, size=(2, 5, 7))
    ref = np.mean([codes[c, t, i] == codes[c, t - 1, i] for c in range(2) for t in range(1, 5) for i in range(7)])
    assert copy_rate(codes) == pytest.approx(ref)
    tok = load_frame_tokenizer(mod.VIDEO_TOKENIZER)
    clips = scenes.make_scene_clips("eval", 8, frames=16)
    rate = copy_rate(tok.encode(np.stack([c.frames for c in clips])))
    print(f"copy rate of tokenized held-out scene clips: {rate:.3f}")
    assert 0.05 < rate < 0.9
