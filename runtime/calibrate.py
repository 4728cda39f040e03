"""Pick the FastCar threshold tau for the user (the paper leaves it to hand tuning).

Baking the chosen tau into fast.onnx is the compiler's job (`fastcar_compile.api.bake_threshold`).

Two goals: a target replay ratio (`target_replay`), or the largest replay whose logits stay within a
divergence budget of the dense model (`quality_budget`, mean KL(dense || fast) per video token, teacher
forced on the tokens the fast model chose). Both search tau directly: each probe decodes the calibration
prompts greedily with that tau, so chained replays (a replayed value written back and replayed again) are
measured, not guessed from one TAS histogram. Replay falls as tau rises, so a bracket then bisection finds it.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fastcar_compile.api import bake_threshold  # noqa: F401 - baking is compiler-side; kept importable here
from fastcar_compile.errors import FastCarError
from fastcar_compile.runtime.decode import generate, left_pad
from fastcar_compile.runtime.session import FastCarSession


@dataclass
class CalibrationResult:
    """The chosen tau and what it achieves; `probes` lists every (tau, replay, divergence) tried."""

    tau: float
    mode: str  # "replay" or "quality"
    target: float
    replay_calib: float
    replay_heldout: float | None = None
    divergence_calib: float | None = None
    divergence_heldout: float | None = None
    ceiling: float = 0.0
    probes: list[tuple[float, float, float | None]] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    def summary(self) -> str:
        s = f"tau={self.tau:.6g} ({self.mode} target {self.target:g}): replay {100 * self.replay_calib:.1f}% " \
            "on calibration prompts"
        if self.replay_heldout is not None:
            s += f", {100 * self.replay_heldout:.1f}% held-out"
        if self.divergence_calib is not None:
            s += f"; KL {self.divergence_calib:.4g}"
            if self.divergence_heldout is not None:
                s += f" (held-out {self.divergence_heldout:.4g})"
        return s + f"; ceiling {100 * self.ceiling:.1f}%, {len(self.probes)} probes"


def replay_ceiling(num_frames: int, frame_tokens: int, given_video_tokens: int = 0) -> float:
    """Largest replay ratio a video can reach: decode steps whose aligned token (p - L) is video."""
    k = np.arange(num_frames * frame_tokens - 1)  # fed generated token k sits L*... after video_start
    return float(((given_video_tokens + k) >= frame_tokens).mean()) if k.size else 0.0


def _prompts(x: Any, what: str) -> list[list[int]]:
    if isinstance(x, (str, os.PathLike)):
        p = Path(x)
        if not p.is_file():
            raise FastCarError(f"{what}: {p} does not exist (expected a .npy of token ids [N, P])")
        x = np.load(p, allow_pickle=False)
    arr = x if isinstance(x, np.ndarray) else None
    if arr is not None:
        if arr.ndim == 1:
            arr = arr[None]
        if arr.ndim != 2 or arr.shape[0] == 0 or arr.shape[1] == 0:
            raise FastCarError(f"{what} must be token ids of shape [N, P] with N, P >= 1, got {list(arr.shape)}")
        if not np.issubdtype(arr.dtype, np.integer):
            raise FastCarError(f"{what} must hold integer token ids, got dtype {arr.dtype}")
        return [list(map(int, r)) for r in arr]
    rows = [list(map(int, r)) for r in x]
    if not rows or any(not r for r in rows):
        raise FastCarError(f"{what}: give at least one prompt with at least one token")
    return rows


class _Prober:
    """Runs the fast model (and the dense one for quality) over a prompt set at a given tau."""

    def __init__(self, fast: FastCarSession, dense: FastCarSession | None, prompts: list[list[int]],
                 num_frames: int, seed: int, batch_size: int, gen_kwargs: dict[str, Any]):
        self.fast, self.dense, self.prompts = fast, dense, prompts
        self.num_frames, self.seed, self.batch_size, self.gen_kwargs = num_frames, seed, batch_size, gen_kwargs
        self.ceiling = 0.0

    def __call__(self, tau: float) -> tuple[float, float | None]:
        replayed = total = 0.0
        kl_sum, kl_n = 0.0, 0
        for i in range(0, len(self.prompts), self.batch_size):
            chunk = self.prompts[i: i + self.batch_size]
            res = generate(self.fast, chunk, self.num_frames, threshold=tau, seed=self.seed + i,
                           keep_logits=self.dense is not None, progress=False, **self.gen_kwargs)
            r = res.stats.replay_array()
            replayed += float(r.sum())
            total += r.size
            self.ceiling = res.stats.eligible_ratio_ceiling
            if self.dense is not None:
                kl = _teacher_forced_kl(self.dense, chunk, res.tokens, res.logits,
                                        self.gen_kwargs.get("logits_processor"))
                kl_sum += float(kl.sum())
                kl_n += kl.size
        return replayed / max(total, 1.0), (kl_sum / kl_n if kl_n else None)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def _teacher_forced_kl(dense: FastCarSession, prompts: list[list[int]], tokens: np.ndarray,
                       fast_logits: np.ndarray, processor: Callable[[np.ndarray], np.ndarray] | None = None
                       ) -> np.ndarray:
    """KL(dense || fast) for each chosen video token [rows, n]: one dense prefill over prompt + video."""
    ids, mask = left_pad(prompts, 0)
    seq = np.concatenate([ids, tokens[:, :-1]], axis=1)
    full_mask = np.concatenate([mask, np.ones_like(tokens[:, :-1])], axis=1)
    out = dense.step(dense.new_state(len(prompts), video_start=ids.shape[1]), seq, attention_mask=full_mask)
    dl = out.logits[:, ids.shape[1] - 1:, :].astype(np.float64)
    if processor is not None:  # the same masking the fast logits went through
        dl = np.stack([processor(dl[:, j]) for j in range(dl.shape[1])], axis=1)
    lp, lq = _log_softmax(dl), _log_softmax(fast_logits)
    p = np.exp(lp)
    with np.errstate(invalid="ignore"):
        return np.where(p > 0, p * (lp - lq), 0.0).sum(axis=-1)


def _search(evaluate: Callable[[float], tuple[float, float | None]], good: Callable[[float, float | None], bool],
            score: Callable[[float, float | None], float], max_probes: int, progress: bool,
            replay_resolution: float = 0.0) -> tuple[float, list[tuple[float, float, float | None]]]:
    """Find where `good` starts to hold as tau rises (replay falls with tau): expand a bracket from 0 by
    doubling, then bisect until the score is 0, the replay ratios at both ends differ by at most
    `replay_resolution`, or the probes run out; return the best-scoring good tau."""
    probes: list[tuple[float, float, float | None]] = []
    from tqdm.auto import tqdm

    bar = tqdm(total=max_probes, desc="calibrating tau", unit="probe", disable=not progress, leave=False)

    def probe(t: float) -> bool:
        r, d = evaluate(t)
        probes.append((t, r, d))
        bar.update(1)
        bar.set_postfix(tau=f"{t:.4g}", replay=f"{r:.3f}")
        return good(r, d)

    try:
        lo, hi = None, None  # lo: not good (too much replay), hi: good
        t, step = 0.0, 1.0
        ok = probe(t)
        if ok:
            hi = t
            while len(probes) < max_probes // 2:
                t -= step
                step *= 2
                if probe(t):
                    hi = t
                else:
                    lo = t
                    break
        else:
            lo = t
            while len(probes) < max_probes // 2:
                t += step
                step *= 2
                if probe(t):
                    hi = t
                    break
                lo = t
        if hi is None:
            raise FastCarError(f"no tau up to {t:g} meets the goal (replay there {probes[-1][1]:.3f}); is the "
                               "model compiled with FastCar layers?")
        if lo is not None:
            at = {p[0]: p[1] for p in probes}
            while len(probes) < max_probes and hi - lo > 1e-12 * max(1.0, abs(hi)):
                if score(at[hi], next(p[2] for p in probes if p[0] == hi)) == 0.0:
                    break
                if at[lo] - at[hi] <= replay_resolution:
                    break
                mid = 0.5 * (lo + hi)
                if probe(mid):
                    hi = mid
                else:
                    lo = mid
                at[mid] = probes[-1][1]
    finally:
        bar.close()
    cands = [p for p in probes if good(p[1], p[2])]
    best = min(cands, key=lambda p: (score(p[1], p[2]), p[0]))
    return best[0], probes


def calibrate_threshold(fast_model_path: str | os.PathLike, calib_prompts: np.ndarray, *, num_frames: int,
                        target_replay: float | None = None, quality_budget: float | None = None,
                        dense_model_path: str | os.PathLike | None = None,
                        heldout_prompts: np.ndarray | None = None, seed: int = 0, max_probes: int = 24,
                        tolerance: float = 0.005, batch_size: int = 8, progress: bool | None = None,
                        **generate_kwargs: Any) -> CalibrationResult:
    """Find tau for a replay target (within `tolerance`) or for a quality budget.

    target_replay: fraction of MLPs replayed over all decode steps, rows and rewritten layers; at most the
    ceiling (num_frames-1)/num_frames (frame 0 never replays). quality_budget: the largest mean
    KL(dense || fast) per video token allowed; the dense model defaults to the fast one at tau=+inf (the
    same function, so pass dense_model_path only to compare with the original export).
    """
    if (target_replay is None) == (quality_budget is None):
        raise FastCarError("give exactly one of target_replay (e.g. 0.8) or quality_budget (e.g. 0.05)")
    if num_frames < 2:
        raise FastCarError("calibration needs num_frames >= 2 (frame 0 never replays)")
    fast = FastCarSession(fast_model_path)
    if not fast.is_fastcar:
        raise FastCarError(f"{fast_model_path} is not a FastCar model (no fastcar.* metadata); compile it first")
    calib = _prompts(calib_prompts, "calib_prompts")
    held = _prompts(heldout_prompts, "heldout_prompts") if heldout_prompts is not None else None
    ceiling = replay_ceiling(num_frames, fast.frame_tokens, int(generate_kwargs.get("given_video_tokens", 0)))
    show = bool(progress) if progress is not None else True
    dense = None
    if quality_budget is not None:
        if quality_budget < 0:
            raise FastCarError(f"quality_budget must be >= 0, got {quality_budget}")
        dense = FastCarSession(dense_model_path, frame_tokens=fast.frame_tokens) if dense_model_path else None
        if dense is None:
            dense = _InfSession(fast)
    prober = _Prober(fast, dense, calib, num_frames, seed, batch_size, generate_kwargs)
    if target_replay is not None:
        if not 0 <= target_replay <= ceiling:
            raise FastCarError(f"target_replay {target_replay} is outside [0, {ceiling:.4f}]: with {num_frames} "
                               f"frames frame 0 never replays; ask for less or use more frames")
        tau, probes = _search(prober, good=lambda r, d: r <= target_replay + tolerance,
                              score=lambda r, d: abs(r - target_replay) if abs(r - target_replay) > tolerance
                              else 0.0, max_probes=max_probes, progress=show)
        mode, target = "replay", float(target_replay)
    else:
        tau, probes = _search(prober, good=lambda r, d: d is not None and d <= quality_budget,
                              score=lambda r, d: -r, max_probes=max_probes, progress=show,
                              replay_resolution=0.002)
        mode, target = "quality", float(quality_budget)
    chosen = next(p for p in probes if p[0] == tau)
    res = CalibrationResult(tau=float(tau), mode=mode, target=target, replay_calib=chosen[1],
                            divergence_calib=chosen[2], ceiling=ceiling, probes=probes)
    if held is not None:
        hp = _Prober(fast, dense, held, num_frames, seed + 10_000, batch_size, generate_kwargs)
        res.replay_heldout, res.divergence_heldout = hp(tau)
    return res


class _InfSession:
    """The fast model at tau=+inf, used as the dense reference when no original model is given."""

    def __init__(self, fast: FastCarSession):
        self.fast = fast

    def new_state(self, batch: int, video_start: int = 0):
        return self.fast.new_state(batch, video_start)

    def step(self, state, ids, attention_mask=None):
        return self.fast.step(state, ids, attention_mask=attention_mask, threshold=math.inf)
