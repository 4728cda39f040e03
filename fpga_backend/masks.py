"""Replay masks for the simulator: synthetic (random / clustered) or read from a runtime trace (run.json).

A mask set is ``(replay, context)``: ``replay[step, layer, row]`` is True where the row replays that layer's
MLP, ``context[step]`` the KV length the step attends over (trace: pos + 1).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fastcar_compile.core.errors import FastCarError
from fastcar_compile.core.fileio import read_json

from .isa import MAX_CONTEXT, MAX_ROWS

MASK_KINDS = ("random", "clustered")


def synthetic(ratio: float, batch: int, layers: int, steps: int, *, kind: str = "random", seed: int = 0,
              replayable: frozenset[int] | None = None) -> np.ndarray:
    """Replay masks with the replay ratio met exactly (up to one row) over the replayable layers.

    Per step and layer k rows replay, the k's spread by cumulative rounding so the total is
    round(ratio * cells) and every (step, layer) gets floor or ceil of ratio * batch. ``random`` picks the k
    rows uniformly; ``clustered`` picks k neighbouring rows (wrapping), as correlated rows (CFG pairs,
    similar prompts) do, which is what unbalances a block row->core binding.
    """
    if not 0.0 <= ratio <= 1.0:
        raise FastCarError(f"replay ratio {ratio} must be in [0, 1]")
    if kind not in MASK_KINDS:
        raise FastCarError(f"mask kind {kind!r} unknown; choose one of {MASK_KINDS}")
    rng = np.random.default_rng(seed)
    out = np.zeros((steps, layers, batch), bool)
    layer_ids = sorted(replayable) if replayable is not None else list(range(layers))
    cells = [(s, layer) for s in range(steps) for layer in layer_ids]
    offset = rng.random()  # random phase of the rounding so small grids do not always round the same way
    for i, (s, layer) in enumerate(cells):
        k = int(np.floor((i + 1) * ratio * batch + offset)) - int(np.floor(i * ratio * batch + offset))
        if k == 0:
            continue
        if kind == "random":
            rows = rng.choice(batch, size=k, replace=False)
        else:
            start = int(rng.integers(batch))
            rows = (start + np.arange(k)) % batch
        out[s, layer, rows] = True
    return out


def nested(ratios: list[float], batch: int, layers: int, steps: int, seed: int = 0) -> list[np.ndarray]:
    """Masks where each higher ratio replays a superset of the rows of the lower one (monotonicity checks)."""
    rng = np.random.default_rng(seed)
    u = rng.random((steps, layers, batch))
    return [u < r for r in ratios]


def _trace_int(value: object, lo: int, hi: int, what: str, path: Path) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise FastCarError(f"replay trace {path}: {what} must be an integer in {lo}..{hi}, got {str(value)[:40]}")
    return value


def load_trace(path: str | Path, num_layers: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Read run.json (docs/DESIGN.md): returns (replay[step, layer, row], context[step], batch).

    Every value is checked (the file may come from anywhere): layers are indices of the program, batch fits
    the Index Register, positions fit the ISA's 32-bit context, replay entries are 0/1."""
    path = Path(path)
    data = read_json(path, "replay trace")
    if not isinstance(data, dict) or not all(k in data for k in ("layers", "batch", "steps")):
        raise FastCarError(f"replay trace {path} lacks 'layers', 'batch' or 'steps' (a run.json written with "
                           "trace=)")
    if not isinstance(data["layers"], list) or not isinstance(data["steps"], list):
        raise FastCarError(f"replay trace {path}: 'layers' and 'steps' must be lists")
    layers = [_trace_int(x, 0, num_layers - 1, f"layer (the program has {num_layers})", path)
              for x in data["layers"]]
    if len(set(layers)) != len(layers):
        raise FastCarError(f"replay trace {path} names a layer twice: {layers}")
    batch = _trace_int(data["batch"], 1, MAX_ROWS, "batch (rows of the Index Register)", path)
    steps = data["steps"]
    if not steps:
        raise FastCarError(f"replay trace {path} has no steps")
    replay = np.zeros((len(steps), num_layers, batch), bool)
    ctx = np.zeros(len(steps), np.int64)
    for i, st in enumerate(steps):
        if not isinstance(st, dict) or "pos" not in st or "replay" not in st:
            raise FastCarError(f"replay trace {path}: step {i} must be an object with 'pos' and 'replay'")
        ctx[i] = _trace_int(st["pos"], 0, MAX_CONTEXT - 1, f"step {i} pos", path) + 1
        rows = st["replay"]
        if not isinstance(rows, list) or len(rows) != len(layers) or any(
                not isinstance(r, list) or len(r) != batch for r in rows):
            raise FastCarError(f"replay trace {path}: step {i} replay must be [layers {len(layers)}][batch {batch}]")
        if any(v not in (0, 1) or isinstance(v, float) for r in rows for v in r):
            raise FastCarError(f"replay trace {path}: step {i} replay entries must be 0 or 1")
        replay[i, layers, :] = np.asarray(rows, dtype=bool).reshape(len(layers), batch)
    return replay, ctx, batch


def trace_video_start(path: str | Path) -> int | None:
    """The video_start a trace's run used (None when the trace does not say)."""
    data = read_json(path, "replay trace")
    value = data.get("video_start") if isinstance(data, dict) else None
    return None if value is None else _trace_int(value, 0, MAX_CONTEXT, "video_start", Path(path))
