"""World paths: seeded, split-clean, exact crops of their scene moved one patch per action, and per-cell labels
(previous frame / revisited / new) equal to an independent computation from the scene pixels each view covered."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("skimage")

from fastcar_compile.core.errors import FastCarError  # noqa: E402
from fastcar_compile.demo import world  # noqa: E402
from fastcar_compile.demo.data import EVAL_SOURCES, FRAME, TRAIN_SOURCES  # noqa: E402
from fastcar_compile.demo.tokenizer import PATCH, PatchTokenizer  # noqa: E402


def test_seeded_and_split_clean() -> None:
    a = world.make_paths("train", 4, 20, seed=1)
    b = world.make_paths("train", 4, 20, seed=1)
    c = world.make_paths("train", 4, 20, seed=2)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x.frames, y.frames)
        np.testing.assert_array_equal(x.actions, y.actions)
        assert x.frames.shape == (20, FRAME, FRAME, 3) and x.frames.dtype == np.uint8
    assert any(not np.array_equal(x.frames, z.frames) for x, z in zip(a, c, strict=True))
    for split, allowed in (("train", TRAIN_SOURCES), ("eval", EVAL_SOURCES)):
        assert all(p.scene.source in allowed for p in world.make_paths(split, 10, 4))
    with pytest.raises(FastCarError, match="split"):
        world.make_path("test", 0)
    with pytest.raises(FastCarError, match="at least"):
        world.make_path("train", 0, frames=1)


def test_frames_are_scene_crops_moved_one_patch_per_action() -> None:
    for p in world.make_paths("eval", 3, 60, seed=5):
        img = p.scene.image
        assert p.actions[0] == world.action_id("start")
        for t in range(len(p)):
            x, y = p.cells[t]
            assert 0 <= x and 0 <= y and (x + 8) * PATCH <= img.shape[1] and (y + 8) * PATCH <= img.shape[0]
            np.testing.assert_array_equal(p.frames[t], img[y * PATCH:(y + 8) * PATCH, x * PATCH:(x + 8) * PATCH])
            if t:
                dx, dy = world.MOVES[world.ACTIONS[p.actions[t]]]
                assert tuple(p.cells[t] - p.cells[t - 1]) == (dx, dy)
                # the overlap of two consecutive views holds the same pixels, moved by PATCH against the camera
                a, b = p.frames[t - 1], p.frames[t]
                ov_a = a[max(dy, 0) * PATCH:FRAME + min(dy, 0) * PATCH, max(dx, 0) * PATCH:FRAME + min(dx, 0) * PATCH]
                ov_b = b[max(-dy, 0) * PATCH:FRAME + min(-dy, 0) * PATCH,
                         max(-dx, 0) * PATCH:FRAME + min(-dx, 0) * PATCH]
                np.testing.assert_array_equal(ov_a, ov_b)


def _labels_from_pixels(p: world.WorldPath) -> tuple[np.ndarray, np.ndarray]:
    """Per cell of each frame: was every pixel of it in the previous view, else in some earlier view; and how many
    frames ago a view last covered it, from boolean masks over the scene's pixels."""
    h, w = p.scene.image.shape[:2]
    masks = np.zeros((len(p), h, w), bool)
    for t in range(len(p)):
        x0, y0 = p.cells[t] * PATCH
        masks[t, y0:y0 + FRAME, x0:x0 + FRAME] = True
    labels = np.zeros((len(p), 8, 8), np.uint8)
    gap = np.zeros((len(p), 8, 8), np.int64)
    for t in range(len(p)):
        x0, y0 = p.cells[t] * PATCH
        for r in range(8):
            for c in range(8):
                ys, xs = slice(y0 + r * PATCH, y0 + (r + 1) * PATCH), slice(x0 + c * PATCH, x0 + (c + 1) * PATCH)
                covered = [s for s in range(t) if masks[s, ys, xs].all()]
                if t and masks[t - 1, ys, xs].all():
                    labels[t, r, c] = 0
                elif covered:
                    labels[t, r, c] = 1
                else:
                    labels[t, r, c] = 2
                gap[t, r, c] = t - covered[-1] if covered else 0
    return labels, gap


def test_labels_match_the_pixels_each_view_covered() -> None:
    for p in world.make_paths("train", 3, 40, seed=3):
        labels, gap = _labels_from_pixels(p)
        np.testing.assert_array_equal(p.cell_labels, labels)
        np.testing.assert_array_equal(p.gap, gap)
        np.testing.assert_array_equal(p.frame_labels, labels.reshape(len(p), -1).max(1))
        assert world.LABELS[p.frame_labels[0]] == "new"


def test_revisited_cells_recur_as_the_same_tokens() -> None:
    """Views sit on the patch grid, so a revisited cell tokenizes to the token it had when last in view."""
    tok = PatchTokenizer(np.random.default_rng(0).random((64, PATCH * PATCH * 3)).astype(np.float32))
    for p in world.make_paths("eval", 2, 80, seed=1):
        codes = tok.encode(p.frames).reshape(len(p), 8, 8)
        seen = 0
        for t, r, c in zip(*np.nonzero(p.cell_labels == world.REVISIT), strict=True):
            s = t - p.gap[t, r, c]
            dx, dy = p.cells[t] - p.cells[s]
            assert codes[t, r, c] == codes[s, r + dy, c + dx]
            seen += 1
        assert seen > 50


def test_paths_revisit_beyond_a_short_window() -> None:
    """The data is made for memory: a good share of 24-frame paths' cells come back after more than 4 frames."""
    paths = world.make_paths("train", 32, 24)
    far = np.mean([((p.cell_labels == world.REVISIT) & (p.gap > 4)).any() for p in paths])
    assert far >= 0.5
    long = world.make_path("eval", 0, 1000)
    assert (long.frame_labels == world.REVISIT).mean() > 0.2 and (long.gap[long.cell_labels == 1] > 100).any()


def test_shift_baseline_moves_content_against_the_camera() -> None:
    g = np.arange(64).reshape(8, 8)
    right = world.shift_grid(g, world.action_id("right"))
    np.testing.assert_array_equal(right[:, :7], g[:, 1:])
    np.testing.assert_array_equal(right[:, 7], g[:, 7])  # the entering strip repeats the edge
    up = world.shift_grid(g, world.action_id("up"))
    np.testing.assert_array_equal(up[1:], g[:-1])
    np.testing.assert_array_equal(up[0], g[0])
    np.testing.assert_array_equal(world.shift_grid(g, world.action_id("stay")), g)
    img = np.random.default_rng(0).integers(0, 255, (FRAME, FRAME, 3), dtype=np.uint8)
    left = world.shift_grid(img, world.action_id("left"), unit=PATCH)
    np.testing.assert_array_equal(left[:, PATCH:], img[:, :-PATCH])
    np.testing.assert_array_equal(left[:, :PATCH], np.repeat(img[:, :1], PATCH, 1))
    # on the truth, the shift is exact outside the entering strip
    p = world.make_path("eval", 1, 30)
    for t in range(1, 30):
        a = world.ACTIONS[p.actions[t]]
        sh = world.shift_grid(p.frames[t - 1], p.actions[t], unit=PATCH)
        dx, dy = world.MOVES[a]
        keep = np.ones((FRAME, FRAME), bool)
        if dx:
            keep[:, slice(-PATCH, None) if dx > 0 else slice(0, PATCH)] = False
        if dy:
            keep[slice(-PATCH, None) if dy > 0 else slice(0, PATCH)] = False
        np.testing.assert_array_equal(sh[keep], p.frames[t][keep])
    roll = world.shift_rollout(g, np.array([0, world.action_id("right"), world.action_id("right")]))
    np.testing.assert_array_equal(roll[1], right)
    np.testing.assert_array_equal(roll[2][:, :6], g[:, 2:])  # two moves right: content two cells left
    np.testing.assert_array_equal(roll[2][:, 6:], np.repeat(g[:, 7:8], 2, 1))  # the edge repeated
