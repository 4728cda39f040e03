"""Rolling the token world model out: given frame 0 and an action per frame, generate every later frame greedily
through a `FastCarSession` (the compiled graphs: full context, a sink + window cache, the FAST-AR modes, FastCar),
timing each frame and recording the cache size, the replay and the attention diagnostics the graph reports.

Why step by step with the real session: what a user runs is the compiled graph, and a bounded cache changes what the
model sees, so fidelity, speed and memory all come from the same run. A frame is 64 single-token steps; the last
token of a frame and the next frame's action go in one 2-token step (its last logits predict the next frame's
first token).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Generator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fastcar_compile.core.errors import FastCarError
from fastcar_compile.demo import world
from fastcar_compile.demo.worldmodel import ACTION0, BOS, CODES, PATCHES, VIDEO_START
from fastcar_compile.dit.stream import rss_mib

REPO = Path(__file__).resolve().parents[2]
WORLD_MODEL_DIR = REPO / "training" / "world_model"
WORLD_WEIGHTS = WORLD_MODEL_DIR / "world.safetensors"
WORLD_CONFIG_FILE = WORLD_MODEL_DIR / "world.json"


def world_onnx(weights: Path = WORLD_WEIGHTS, config: Path = WORLD_CONFIG_FILE, progress: bool = True) -> Path:
    """The world model's decoder.onnx in the user cache, exported once from its fp16 weights."""
    from fastcar_compile.demo.longvideo import long_onnx

    if not Path(weights).exists():
        raise FastCarError(f"world model weights not found at {weights}; run from a clone of the repository "
                           "(training/world_model/) or train them: python scripts/train_world_model.py model")
    return long_onnx(weights, config, progress, name="the world model")


def live_cache_mib(session, state) -> float:
    """MiB of the state the video holds: a KV buffer allocated for the whole video (max_length) counts only the
    slots written so far, a bounded cache its slots in use, everything else in full."""
    total = 0.0
    for spec in session.specs:
        arr = state.arrays[spec.input]
        if spec.kind == "kv" and "past" in spec.shape and arr.size:
            axis = spec.shape.index("past")
            total += arr.nbytes / arr.shape[axis] * min(arr.shape[axis], state.past_len)
        else:
            total += arr.nbytes
    return total / 2**20


@dataclass
class Rollout:
    """One batch of generated paths.

    tokens [B, T, 64] (frame 0 given); frame_seconds [T] (wall time of each generated frame, the whole batch);
    cache_mib {frame: the state's live MiB after it (`live_cache_mib`)}; replay [T, layers] share of replayed MLPs per frame
    (None: no FastCar layers)."""

    tokens: np.ndarray
    frame_seconds: np.ndarray
    cache_mib: dict[int, float] = field(default_factory=dict)
    rss_mib: dict[int, float] = field(default_factory=dict)
    replay: np.ndarray | None = None
    tas: np.ndarray | None = None  # [decode steps, layers, B] (diagnostics graphs: their TAS, for calibration)


def rollout(session, first: np.ndarray, actions: np.ndarray, threshold=None, measure_at: tuple[int, ...] = (),
            ) -> Rollout:
    """Generate frames 1..T-1 of B paths from `first` [B, 64] (frame 0's tokens) and `actions` [B, T].
    The cache size and process RSS are recorded after the frames in `measure_at`."""
    frames = rollout_frames(session, first, actions, threshold, measure_at)
    while True:
        try:
            next(frames)
        except StopIteration as done:
            return done.value


def lockstep(runs: dict[str, Generator[int, None, Rollout]]) -> dict[str, Rollout]:
    """Advance several rollouts (`rollout_frames`) one frame each in turn, so all see the same machine load; their
    results by name."""
    out: dict[str, Rollout] = {}
    while len(out) < len(runs):
        for name, frames in runs.items():
            if name not in out:
                try:
                    next(frames)
                except StopIteration as done:
                    out[name] = done.value
    return {name: out[name] for name in runs}


def rollout_frames(session, first: np.ndarray, actions: np.ndarray, threshold=None,
                   measure_at: tuple[int, ...] = ()) -> Generator[int, None, Rollout]:
    """`rollout` one frame at a time: yields each generated frame's index, returns the Rollout."""
    first, actions = np.asarray(first, np.int64), np.asarray(actions, np.int64)
    b, frames = actions.shape
    if first.shape != (b, PATCHES):
        raise FastCarError(f"first frames must be [{b}, {PATCHES}] tokens, got {list(first.shape)}")
    tokens = np.zeros((b, frames, PATCHES), np.int64)
    tokens[:, 0] = first
    seconds = np.zeros(frames)
    state = session.new_state(b, VIDEO_START)
    layers = len(session.layers)
    replay = np.zeros((frames, layers)) if layers else None
    out_cache, out_rss = {}, {}
    tas: list[np.ndarray] = []

    def step(ids: np.ndarray) -> np.ndarray:
        nonlocal state
        out = session.step(state, ids, threshold=threshold, check=False)
        state = out.state
        if replay is not None and out.replay is not None:
            r = out.replay.reshape(layers, b, -1)[:, :, -1]
            replay[t] += r.mean(axis=1) / PATCHES
        if out.tas is not None and ids.shape[1] == 1:
            tas.append(out.tas[:, :, -1])
        return out.logits[:, -1, :CODES].argmax(-1)

    t = 0
    prefill = np.concatenate([np.full((b, 1), BOS), ACTION0 + actions[:, :1], first, ACTION0 + actions[:, 1:2]], 1)
    nxt = step(prefill) if frames > 1 else None
    for t in range(1, frames):
        t0 = time.perf_counter()
        tokens[:, t, 0] = nxt
        for j in range(1, PATCHES):
            tokens[:, t, j] = step(tokens[:, t, j - 1:j])
        if t + 1 < frames:
            nxt = step(np.stack([tokens[:, t, -1], ACTION0 + actions[:, t + 1]], 1))
        seconds[t] = time.perf_counter() - t0
        if t in measure_at:
            out_cache[t] = live_cache_mib(session, state)
            out_rss[t] = rss_mib()
        yield t
    return Rollout(tokens, seconds, out_cache, out_rss, replay, np.stack(tas) if tas else None)


def path_tokens(tok, paths: list[world.WorldPath]) -> tuple[np.ndarray, np.ndarray]:
    """(truth tokens [B, T, 64], actions [B, T]) of equally long paths."""
    return tok.encode(np.stack([p.frames for p in paths])), np.stack([p.actions for p in paths])


def shift_tokens(first: np.ndarray, actions: np.ndarray) -> np.ndarray:
    """The baseline "shift the last frame by the action" on tokens: [B, T, 64] from frame 0's tokens."""
    g = world.GRID
    return np.stack([world.shift_rollout(f.reshape(g, g), a).reshape(len(a), -1) for f, a in zip(first, actions,
                                                                                                   strict=True)])


def weights_id(weights: Path = WORLD_WEIGHTS) -> str:
    return hashlib.sha256(Path(weights).read_bytes()).hexdigest()[:12]


# ------------------------------------------------------------------------------------------------------ fidelity
ACCURACY_KEYS = ("previous", "revisit", "revisit_far", "new")


def label_accuracy(pred: np.ndarray, truth: np.ndarray, paths: list[world.WorldPath], window_frames: int
                   ) -> dict[str, np.ndarray]:
    """Per path, the share of generated cells (frames 1..) equal to the truth among those the truth labels
    previous / revisit / new; `revisit_far`: revisited cells last seen more than `window_frames` frames earlier
    (what a sink + window cache of that many frames cannot hold). NaN where a path has no such cell."""
    hit = (np.asarray(pred) == np.asarray(truth))[:, 1:]
    out = {k: np.full(len(paths), np.nan) for k in ACCURACY_KEYS}
    for i, p in enumerate(paths):
        lab, gap = p.cell_labels[1:].reshape(len(p) - 1, -1), p.gap[1:].reshape(len(p) - 1, -1)
        for k, sel in (("previous", lab == world.PREVIOUS), ("revisit", lab == world.REVISIT),
                       ("revisit_far", (lab == world.REVISIT) & (gap > window_frames)), ("new", lab == world.NEW)):
            if sel.any():
                out[k][i] = hit[i][sel].mean()
    return out


def mean_ci(values: np.ndarray, level: float = 0.95) -> tuple[float, float, int]:
    """(mean, half width of the Student-t interval at `level`, n) over the finite values."""
    from scipy import stats

    v = np.asarray(values, np.float64)
    v = v[np.isfinite(v)]
    if len(v) == 0:
        return float("nan"), float("nan"), 0
    if len(v) == 1:
        return float(v[0]), float("nan"), 1
    half = stats.t.ppf(0.5 + level / 2, len(v) - 1) * v.std(ddof=1) / np.sqrt(len(v))
    return float(v.mean()), float(half), len(v)
