"""Worlds with actions and revisits: action-conditioned camera paths over large scenes, with ground truth and a
per-frame label of what the frame shows (new content, revisited content, or only what the previous frame showed).

Why this generator: a world model earns a long memory only where a place is left and seen again after more frames
than a short attention window holds. Here the camera moves by exactly one VQ patch (4 px) per move action, so a
move shifts the frame's tokens by one token column or row and the tokens of revisited content recur exactly: a
model can copy them from its past (as an induction head does), and the truth says which cells it had seen.

A scene is a photograph scikit-image ships (the train / held-out split of `data.py`: held-out photographs never
appear in training scenes), resized so its short side is 128-192 px, cropped to whole patches; training scenes are
also flipped / rotated by multiples of 90 degrees and grey ones tinted. A path is a plan of legs (out and back,
loops, wandering, pauses) that never leaves the scene. Everything is a pure function of (split, index, seed).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fastcar_compile.core.errors import FastCarError
from fastcar_compile.demo.data import EVAL_SOURCES, FRAME, TRAIN_SOURCES, _tint, source_image
from fastcar_compile.demo.tokenizer import PATCH

GRID = FRAME // PATCH  # cells (tokens) per frame side
# Per-frame actions; frame 0's action is always "start" (nothing moved yet). A move shifts the camera by one cell.
ACTIONS: tuple[str, ...] = ("start", "stay", "left", "right", "up", "down")
MOVES: dict[str, tuple[int, int]] = {"start": (0, 0), "stay": (0, 0), "left": (-1, 0), "right": (1, 0),
                                     "up": (0, -1), "down": (0, 1)}
# Cell labels, ordered so that a frame's label is the largest of its cells' labels.
PREVIOUS, REVISIT, NEW = 0, 1, 2
LABELS: tuple[str, ...] = ("previous", "revisit", "new")
SCENE_SHORT = (128, 160, 192)  # scene short side in pixels (32-48 cells)
MIN_FRAMES = 2


@dataclass(frozen=True)
class WorldScene:
    """A scene: uint8 pixels [H, W, 3] with H and W whole multiples of PATCH, and the photograph it came from."""

    image: np.ndarray
    source: str

    @property
    def cells(self) -> tuple[int, int]:
        """(cells across, cells down)."""
        return self.image.shape[1] // PATCH, self.image.shape[0] // PATCH


@dataclass(frozen=True)
class WorldPath:
    """One path through a scene.

    frames [T, 32, 32, 3] uint8: the truth; actions [T] int64 (ids into ACTIONS: actions[t] moved the camera from
    frame t-1 to t); cells [T, 2] int64: the (x, y) cell of each view's top-left corner; cell_labels [T, 8, 8] uint8
    (PREVIOUS / REVISIT / NEW per cell of the frame); gap [T, 8, 8] int64: frames since the cell's content was last
    in view (0 for NEW cells, 1 for PREVIOUS ones); frame_labels [T] uint8: the largest cell label of the frame.
    """

    frames: np.ndarray
    actions: np.ndarray
    cells: np.ndarray
    cell_labels: np.ndarray
    gap: np.ndarray
    frame_labels: np.ndarray
    scene: WorldScene

    def __len__(self) -> int:
        return len(self.frames)


def action_id(name: str) -> int:
    if name not in ACTIONS:
        raise FastCarError(f"unknown action {name!r}; expected one of {ACTIONS}")
    return ACTIONS.index(name)


def make_scene(split: str, index: int, seed: int = 0) -> WorldScene:
    """Scene `index` of `split` ('train' or 'eval'), deterministic."""
    if split not in ("train", "eval"):
        raise FastCarError(f"split must be 'train' or 'eval', got {split!r}")
    rng = np.random.default_rng([seed, 11 if split == "train" else 12, index])
    sources = TRAIN_SOURCES if split == "train" else EVAL_SOURCES
    name = sources[int(rng.integers(len(sources)))]
    img = _tint(source_image(name, int(rng.choice(SCENE_SHORT))), rng)
    if split == "train":  # the 8 symmetries of the square: more distinct scenes from 14 photographs
        img = np.rot90(img, int(rng.integers(4)))
        if rng.random() < 0.5:
            img = img[:, ::-1]
    h, w = (s // PATCH * PATCH for s in img.shape[:2])
    pixels = (np.clip(img[:h, :w], 0, 1) * 255 + 0.5).astype(np.uint8)
    return WorldScene(np.ascontiguousarray(pixels), name)


# ------------------------------------------------------------------------------------------------------- paths
def _fits(x: int, y: int, moves: list[tuple[int, int]], room: tuple[int, int]) -> bool:
    for dx, dy in moves:
        x, y = x + dx, y + dy
        if not (0 <= x <= room[0] and 0 <= y <= room[1]):
            return False
    return True


def _leg(rng: np.random.Generator, x: int, y: int, room: tuple[int, int]) -> list[str]:
    """One leg of a path from cell (x, y): a list of move names that stays inside the scene."""
    dirs = ("left", "right", "up", "down")
    back = {"left": "right", "right": "left", "up": "down", "down": "up"}
    for _ in range(50):
        kind = rng.choice(["out_back", "loop", "wander", "pause"], p=[0.4, 0.25, 0.25, 0.1])
        if kind == "pause":
            return ["stay"] * int(rng.integers(1, 4))
        if kind == "out_back":
            d, k = str(rng.choice(dirs)), int(rng.integers(3, 15))
            ret = int(rng.integers((k + 1) // 2, k + 1))  # come back part of the way or all of it
            leg = [d] * k + ["stay"] * int(rng.integers(0, 3)) + [back[d]] * ret
        elif kind == "loop":
            a, b = int(rng.integers(3, 11)), int(rng.integers(3, 11))
            h, v = str(rng.choice(["left", "right"])), str(rng.choice(["up", "down"]))
            sides = [(h, a), (v, b), (back[h], a), (back[v], b)]
            if rng.random() < 0.5:  # the other way round
                sides = [(v, b), (h, a), (back[v], b), (back[h], a)]
            leg = [d for d, n in sides for _ in range(n)]
        else:
            leg, d = [], str(rng.choice(dirs))
            for _ in range(int(rng.integers(2, 11))):
                if rng.random() < 0.3:
                    d = str(rng.choice(dirs))
                leg.append(d)
        if _fits(x, y, [MOVES[m] for m in leg], room):
            return leg
    return ["stay"]


def plan_path(rng: np.random.Generator, frames: int, cells: tuple[int, int],
              start: tuple[int, int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(actions [frames] ids, view cells [frames, 2]) of a path of legs inside a scene of `cells` (x, y) cells."""
    room = (cells[0] - GRID, cells[1] - GRID)
    if room[0] < 0 or room[1] < 0:
        raise FastCarError(f"a scene of {cells} cells is smaller than a {GRID}x{GRID}-cell view")
    x, y = start if start is not None else (int(rng.integers(room[0] + 1)), int(rng.integers(room[1] + 1)))
    names, pos = ["start"], [(x, y)]
    while len(names) < frames:
        for m in _leg(rng, x, y, room):
            dx, dy = MOVES[m]
            x, y = x + dx, y + dy
            names.append(m)
            pos.append((x, y))
    return (np.array([ACTIONS.index(m) for m in names[:frames]], np.int64),
            np.array(pos[:frames], np.int64))


def label_cells(cells: np.ndarray, scene_cells: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """(cell labels [T, 8, 8] uint8, gap [T, 8, 8] int64) of views whose top-left cells are `cells` [T, 2]."""
    seen = np.full((scene_cells[1], scene_cells[0]), -1, np.int64)  # frame the scene cell was last in view
    labels = np.empty((len(cells), GRID, GRID), np.uint8)
    gap = np.zeros((len(cells), GRID, GRID), np.int64)
    for t, (x, y) in enumerate(cells):
        last = seen[y:y + GRID, x:x + GRID]
        gap[t] = np.where(last >= 0, t - last, 0)
        labels[t] = np.where(last < 0, NEW, np.where(last == t - 1, PREVIOUS, REVISIT))
        seen[y:y + GRID, x:x + GRID] = t
    return labels, gap


def render(scene: WorldScene, cells: np.ndarray) -> np.ndarray:
    """Frames [T, 32, 32, 3] uint8: the scene's pixels under each view (exact crops, no resampling)."""
    return np.stack([scene.image[y * PATCH:y * PATCH + FRAME, x * PATCH:x * PATCH + FRAME] for x, y in cells])


def make_path(split: str, index: int, frames: int = 32, seed: int = 0) -> WorldPath:
    """Path `index` of `split` over scene `index` of that split: the same arguments always give the same pixels."""
    if frames < MIN_FRAMES:
        raise FastCarError(f"a world path needs at least {MIN_FRAMES} frames, got {frames}")
    scene = make_scene(split, index, seed)
    rng = np.random.default_rng([seed, 13 if split == "train" else 14, index])
    actions, cells = plan_path(rng, frames, scene.cells)
    labels, gap = label_cells(cells, scene.cells)
    return WorldPath(render(scene, cells), actions, cells, labels, gap, labels.reshape(len(cells), -1).max(1),
                     scene)


def make_paths(split: str, count: int, frames: int = 32, seed: int = 0, start: int = 0) -> list[WorldPath]:
    """`count` paths of `split` from index `start` (deterministic)."""
    return [make_path(split, start + i, frames, seed) for i in range(count)]


# ---------------------------------------------------------------------------------------------------- baseline
def shift_grid(grid: np.ndarray, action: int, unit: int = 1) -> np.ndarray:
    """Frame content moved as the camera moves under `action`: the content shifts the other way by `unit` array
    cells and the strip that enters repeats the edge (the trivial world model: "shift the last frame by the
    action"). `grid` is a token grid [..., 8, 8] (unit 1) or pixels [..., 32, 32, 3] (unit PATCH)."""
    dx, dy = MOVES[ACTIONS[int(action)]]
    rows, cols = (-3, -2) if grid.ndim >= 3 and grid.shape[-1] == 3 else (-2, -1)
    for axis, d in ((cols, dx), (rows, dy)):
        if d:
            n = grid.shape[axis]
            grid = np.take(grid, np.clip(np.arange(n) + d * unit, 0, n - 1), axis=axis)
    return grid


def shift_rollout(first: np.ndarray, actions: np.ndarray, unit: int = 1) -> np.ndarray:
    """The baseline's video from the given frame 0: each frame is the previous one shifted by its action."""
    out = [np.asarray(first)]
    for a in actions[1:]:
        out.append(shift_grid(out[-1], int(a), unit))
    return np.stack(out)
