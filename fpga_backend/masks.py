"""Replay masks for the simulator: synthetic (random / clustered) or read from a runtime trace (run.json).

A mask set is ``(replay, context)``: ``replay[step, layer, row]`` is True where the row replays that layer's
MLP, ``context[step]`` the KV length the step attends over (trace: pos + 1).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fastcar_compile.errors import FastCarError
from fastcar_compile.fileio import read_json

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


def load_trace(path: str | Path, num_layers: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Read run.json (docs/DESIGN.md): returns (replay[step, layer, row], context[step], batch)."""
    path = Path(path)
    data = read_json(path, "replay trace")
    try:
        layers = [int(x) for x in data["layers"]]
        batch = int(data["batch"])
        steps = data["steps"]
    except (KeyError, TypeError, ValueError) as exc:
        raise FastCarError(f"replay trace {path} lacks 'layers', 'batch' or 'steps' ({exc})") from None
    bad = [x for x in layers if not 0 <= x < num_layers]
    if bad:
        raise FastCarError(f"replay trace {path} names layers {bad} but the program has {num_layers} layers")
    if not steps:
        raise FastCarError(f"replay trace {path} has no steps")
    replay = np.zeros((len(steps), num_layers, batch), bool)
    ctx = np.zeros(len(steps), np.int64)
    for i, st in enumerate(steps):
        try:
            ctx[i] = int(st["pos"]) + 1
            rows = np.asarray(st["replay"], dtype=np.int64)
        except (KeyError, TypeError, ValueError) as exc:
            raise FastCarError(f"replay trace {path}: step {i} malformed ({exc})") from None
        if rows.shape != (len(layers), batch):
            raise FastCarError(
                f"replay trace {path}: step {i} replay has shape {rows.shape}, expected "
                f"(layers {len(layers)}, batch {batch})"
            )
        replay[i, layers, :] = rows.astype(bool)
    return replay, ctx, batch
