"""How well can a world model recall revisited content by its neighbours' tokens? Majority votes over the truth.

For every revisited cell of held-out world paths (seen before, not in the previous frame), every earlier cell
(earlier frames) whose left neighbour's token equals this cell's left neighbour's token (or the upper one, or
both) votes for its own token; the most voted token is the recall's answer. This is what a content-keyed copy
head (an induction head on neighbour codes, as the world model's built-in recall) can do at best with the truth
in its context: many cells share neighbours (flat regions, textures), so it bounds the model's revisit accuracy
from content alone.

    python benchmarks/experiments/world_recall_bound.py [--paths 16] [--frames 24]
"""

from __future__ import annotations

import argparse
import json

import numpy as np


def vote_accuracy(tokens: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """tokens / labels [T, 8, 8] of one path -> per key ('left', 'up', 'both') the hits and the revisited cells."""
    from fastcar_compile.demo import world

    T, g, _ = tokens.shape
    left = np.full((T, g, g), -1)
    left[:, :, 1:] = tokens[:, :, :-1]
    up = np.full((T, g, g), -1)
    up[:, 1:, :] = tokens[:, :-1, :]
    out = {k: [0, 0] for k in ("left", "up", "both")}
    for t, r, c in zip(*np.nonzero(labels == world.REVISIT), strict=True):
        pl, pu = left[:t], up[:t]
        keys = {"left": (pl == left[t, r, c]) & (left[t, r, c] >= 0),
                "up": (pu == up[t, r, c]) & (up[t, r, c] >= 0)}
        keys["both"] = keys["left"] & keys["up"]
        for k, sel in keys.items():
            votes = np.bincount(tokens[:t][sel], minlength=1) if sel.any() else None
            out[k][0] += int(votes is not None and votes.argmax() == tokens[t, r, c])
            out[k][1] += 1
    return out


def main(argv: list[str] | None = None) -> int:
    from fastcar_compile.demo import world
    from fastcar_compile.demo.export import TOKENIZER
    from fastcar_compile.demo.tokenizer import PatchTokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--paths", type=int, default=16)
    ap.add_argument("--frames", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    tok = PatchTokenizer.load(TOKENIZER)
    paths = world.make_paths("eval", a.paths, a.frames, seed=a.seed)
    codes = tok.encode(np.stack([p.frames for p in paths])).reshape(a.paths, a.frames, world.GRID, world.GRID)
    total = {k: [0, 0] for k in ("left", "up", "both")}
    for p, c in zip(paths, codes, strict=True):
        for k, (h, n) in vote_accuracy(c, p.cell_labels).items():
            total[k][0] += h
            total[k][1] += n
    print(json.dumps({"paths": a.paths, "frames": a.frames, **{k: h / max(n, 1) for k, (h, n) in total.items()},
                      "revisited_cells": total["left"][1]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
