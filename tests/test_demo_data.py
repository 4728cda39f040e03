"""Demo clips: deterministic, RGB, right shapes, and train/eval drawn from disjoint source images."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("skimage")
pytest.importorskip("sklearn")

from fastcar_compile.core.errors import FastCarError  # noqa: E402
from fastcar_compile.demo import data  # noqa: E402


def test_sources_disjoint() -> None:
    assert not set(data.TRAIN_SOURCES) & set(data.EVAL_SOURCES)
    # skimage's `cat` is the chelsea photograph: it must not sit on the other side of the split
    assert "cat" not in data.EVAL_SOURCES


def test_clips_deterministic_and_shaped() -> None:
    a = data.make_clips("eval", 6, frames=8, seed=3)
    b = data.make_clips("eval", 6, frames=8, seed=3)
    for x, y in zip(a, b, strict=True):
        assert x.frames.shape == (8, data.FRAME, data.FRAME, 3) and x.frames.dtype == np.uint8
        np.testing.assert_array_equal(x.frames, y.frames)
        assert x.motion == y.motion and x.motion in data.MOTIONS
    c = data.make_clips("eval", 6, frames=8, seed=4)
    assert any(not np.array_equal(x.frames, y.frames) for x, y in zip(a, c, strict=True))


def test_eval_clips_use_only_eval_sources() -> None:
    for c in data.make_clips("eval", 40, frames=3):
        for src in c.source.split("+"):
            assert src in data.EVAL_SOURCES
    for c in data.make_clips("train", 40, frames=3):
        for src in c.source.split("+"):
            assert src in data.TRAIN_SOURCES


def test_pan_moves_content() -> None:
    """A slow pan shifts content: frame t+1 matches frame t shifted by the motion better than unshifted."""
    for i in range(200):
        c = data.make_clip("train", i, frames=4)
        if c.motion == "fast_right":
            f0, f1 = c.frames[0].astype(float), c.frames[1].astype(float)
            still = np.abs(f1 - f0).mean()
            best = min(np.abs(f1[:, :-s] - f0[:, s:]).mean() for s in range(3, 9))
            assert best < still
            return
    pytest.fail("no fast_right clip among the first 200")


def test_bad_split() -> None:
    with pytest.raises(FastCarError, match="split"):
        data.make_clip("test", 0)


@pytest.mark.parametrize("motion", ["fast_right", "fast_down", "pan_up", "pan_left"])
def test_long_pans_stay_inside_the_image(motion) -> None:
    """A 64-frame pan over a too-small source must not leave it: on a white source every view stays white
    (a view outside the image would show the transform's black fill)."""
    white = np.ones((96, 128, 3), np.float32)
    frames = data._camera_clip(white, motion, 64, np.random.default_rng(0))
    assert frames.shape == (64, data.FRAME, data.FRAME, 3)
    assert frames.min() >= 250
