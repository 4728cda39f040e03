"""What the bundled models' training loops share (the video model, the DiT, the world model): AdamW with weight
decay on matrices only, resuming from a checkpoint, a JSON-lines log. Written once so that every loop resumes the
same way."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path


def adamw(model, lr: float, weight_decay: float, betas: tuple[float, float] = (0.9, 0.95)):
    """AdamW over `model`'s parameters in their order: matrices decayed, vectors (norm scales, biases) not."""
    import torch

    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=lr, betas=betas)


def resume(ckpt: Path, model, opt, check: Callable[[dict], None]) -> int | None:
    """Load the checkpoint `ckpt` into model and optimizer (and torch's RNG, when it recorded one) once `check`
    accepted the settings it records (it raises a one-line error otherwise); the step it reached, or None when
    there is no checkpoint."""
    import torch

    if not ckpt.exists():
        return None
    blob = torch.load(ckpt, weights_only=False)
    check(blob["settings"])
    model.load_state_dict(blob["model"])
    opt.load_state_dict(blob["optimizer"])  # moments follow the parameters' device
    if "torch_rng" in blob:
        torch.set_rng_state(blob["torch_rng"])
    return int(blob["step"])


def jsonl_log(path: Path) -> Callable[[dict], None]:
    """A function appending one JSON line per record to `path` (its folder made)."""
    path.parent.mkdir(parents=True, exist_ok=True)

    def log(rec: dict) -> None:
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    return log
