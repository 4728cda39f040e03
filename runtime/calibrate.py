"""Pick the FastCar threshold tau for the user (the paper leaves it to hand tuning).

Baking the chosen tau into fast.onnx is the compiler's job (`fastcar_compile.api.bake_threshold`).

Two goals: a target replay ratio (`target_replay`, over all decode steps, frame 0 included), or the largest
replay whose logits stay within a divergence budget of the dense model (`quality_budget`, mean
KL(dense || fast) per video token in nats, teacher forced on the tokens the fast model chose).

Replay target, model with TAS outputs (`--emit-diagnostics`; the CLI compiles such a probe): one pass at
tau=+inf records the TAS of every eligible token, layer and row; tau for the target is the matching quantile.
Replaying changes later hidden states (a replayed value is written back and may be replayed again), so a few
refinement passes at the current tau re-read the quantile from the TAS seen with replay on, correcting the
share by the remaining error, until the ratio is within `tolerance` (`method="quantile"`). Otherwise (no TAS
outputs, or a quality budget) tau is searched directly: a bracket from 0, then bisection, one greedy pass
per probe (`method="search"`). Both report the 95% confidence interval of the mean replay over prompts.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fastcar_compile.core.errors import FastCarError
from fastcar_compile.core.fileio import refuse_special_input
from fastcar_compile.runtime.calib_stats import ci95, tau_for_share
from fastcar_compile.runtime.decode import ThresholdWarning, generate, left_pad
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
    method: str = "search"
    n_calib: int = 0
    n_heldout: int = 0
    replay_calib_ci: float = float("nan")  # 95% CI half width of the mean replay over calibration prompts
    replay_heldout_ci: float | None = None
    seconds: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    def summary(self) -> str:
        s = f"tau={self.tau:.6g} ({self.mode} target {self.target:g}, {self.method}): replay " \
            f"{100 * self.replay_calib:.1f}% +- {100 * self.replay_calib_ci:.1f} (95% CI over {self.n_calib} " \
            "calibration prompts)"
        if self.replay_heldout is not None:
            s += f", held-out {100 * self.replay_heldout:.1f}% +- {100 * (self.replay_heldout_ci or 0):.1f} " \
                 f"({self.n_heldout} prompts)"
        if self.divergence_calib is not None:
            s += f"; KL {self.divergence_calib:.4g}"
            if self.divergence_heldout is not None:
                s += f" (held-out {self.divergence_heldout:.4g})"
        return s + f"; ratios count frame 0 (ceiling {100 * self.ceiling:.1f}%); {len(self.probes)} passes, " \
            f"{self.seconds:.1f} s"


def replay_ceiling(num_frames: int, frame_tokens: int, given_video_tokens: int = 0) -> float:
    """Largest replay ratio a video can reach: decode steps whose aligned token (p - L) is video."""
    k = np.arange(num_frames * frame_tokens - 1)  # fed generated token k sits L*... after video_start
    return float(((given_video_tokens + k) >= frame_tokens).mean()) if k.size else 0.0


def _prompts(x: Any, what: str) -> list[list[int]]:
    if isinstance(x, (str, os.PathLike)):
        p = Path(x)
        refuse_special_input(p, what)
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
        r, d = self.run(tau)
        return r, d

    def run(self, tau: float, collect_tas: bool = False) -> tuple[float, float | None]:
        """One greedy pass over the prompts at tau; sets per_prompt (replay per prompt) and tas (eligible TAS
        values, with collect_tas)."""
        replayed = total = 0.0
        kl_sum, kl_n = 0.0, 0
        per_prompt, tas = [], []
        for i in range(0, len(self.prompts), self.batch_size):
            chunk = self.prompts[i: i + self.batch_size]
            with warnings.catch_warnings():  # probes replay all or nothing on purpose
                warnings.simplefilter("ignore", ThresholdWarning)
                res = generate(self.fast, chunk, self.num_frames, threshold=tau, seed=self.seed + i,
                               keep_logits=self.dense is not None, progress=False, collect_tas=collect_tas,
                               **self.gen_kwargs).complete()
            r = res.stats.replay_array()
            replayed += float(r.sum())
            total += r.size
            per_prompt += list(r.mean(axis=(0, 1))[: len(chunk)])
            if collect_tas and res.stats.tas:
                elig = res.stats.eligible_steps()
                tas.append(np.asarray(res.stats.tas, dtype=np.float64)[elig].ravel())
            self.ceiling = res.stats.eligible_ratio_ceiling
            if self.dense is not None:
                kl = teacher_forced_kl(self.dense, chunk, res.tokens, res.logits,
                                        self.gen_kwargs.get("logits_processor"))
                kl_sum += float(kl.sum())
                kl_n += kl.size
        self.per_prompt = np.asarray(per_prompt)
        self.tas = np.concatenate(tas) if tas else np.zeros(0)
        return replayed / max(total, 1.0), (kl_sum / kl_n if kl_n else None)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def teacher_forced_kl(dense: FastCarSession, prompts: list[list[int]], tokens: np.ndarray,
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
    from fastcar_compile.core.progress import bar as progress_bar

    bar = progress_bar(total=max_probes, desc="calibrating tau", unit="probe", enabled=progress, leave=False)

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


def _quantile(prober: _Prober, target: float, ceiling: float, tolerance: float, refine: int, progress: bool
              ) -> tuple[float, list[tuple[float, float, float | None]]]:
    """tau for `target` replay: the TAS quantile of one never-replay pass, then up to `refine` passes at the
    current tau that re-read the quantile with replay on and correct the share by the remaining error."""
    from fastcar_compile.core.progress import bar as progress_bar

    probes: list[tuple[float, float, float | None]] = []
    bar = progress_bar(total=1 + refine, desc="calibrating tau", unit="pass", enabled=progress, leave=False)
    try:
        probes.append((math.inf, *prober.run(math.inf, collect_tas=True)))
        bar.update(1)
        if prober.tas.size == 0:
            raise FastCarError("no eligible TAS recorded: use more frames (frame 0 never replays)")
        share = target / ceiling if ceiling else 0.0  # among eligible decisions
        tau = tau_for_share(prober.tas, share)
        for _ in range(refine):
            r, d = prober.run(tau, collect_tas=True)
            probes.append((tau, r, d))
            bar.update(1)
            bar.set_postfix(tau=f"{tau:.4g}", replay=f"{r:.3f}")
            if abs(r - target) <= tolerance:
                break
            share = min(max(share + (target - r) / ceiling, 0.0), 1.0)
            tau = tau_for_share(prober.tas, share)
    finally:
        bar.close()
    best = min(probes[1:], key=lambda p: abs(p[1] - target))
    return best[0], probes


def calibrate_threshold(fast_model_path: str | os.PathLike, calib_prompts: np.ndarray, *, num_frames: int,
                        target_replay: float | None = None, quality_budget: float | None = None,
                        dense_model_path: str | os.PathLike | None = None,
                        heldout_prompts: np.ndarray | None = None, seed: int = 0, max_probes: int = 24,
                        tolerance: float = 0.005, batch_size: int = 8, progress: bool | None = None,
                        method: str = "auto", refine: int = 3, **generate_kwargs: Any) -> CalibrationResult:
    """Find tau for a replay target (within `tolerance`) or for a quality budget.

    target_replay: fraction of MLPs replayed over all decode steps, rows and rewritten layers; at most the
    ceiling (num_frames-1)/num_frames (frame 0 never replays). quality_budget: the largest mean
    KL(dense || fast) per video token allowed; the dense model defaults to the fast one at tau=+inf (the
    same function, so pass dense_model_path only to compare with the original export).
    method: "quantile" (one TAS pass + `refine` passes; needs a model with tas.N outputs), "search"
    (bisection, up to `max_probes` passes) or "auto" (quantile for a replay target when the model has TAS
    outputs).
    """
    import time

    t_start = time.perf_counter()
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
            dense = NeverReplay(fast)
    prober = _Prober(fast, dense, calib, num_frames, seed, batch_size, generate_kwargs)
    if target_replay is not None:
        if not 0 <= target_replay <= ceiling:
            raise FastCarError(f"target_replay {target_replay} is outside [0, {ceiling:.4f}]: with {num_frames} "
                               f"frames frame 0 never replays; ask for less or use more frames")
        if method not in ("auto", "quantile", "search"):
            raise FastCarError(f"method must be auto, quantile or search, got {method!r}")
        if method == "quantile" and not fast.has_diagnostics:
            raise FastCarError(f"{fast_model_path} has no tas.N outputs; compile it with --emit-diagnostics for "
                               "the quantile method, or use method='search'")
        method = "quantile" if method == "quantile" or (method == "auto" and fast.has_diagnostics) else "search"
        if method == "quantile":
            tau, probes = _quantile(prober, target_replay, ceiling, tolerance, refine, show)
        else:
            tau, probes = _search(prober, good=lambda r, d: r <= target_replay + tolerance,
                                  score=lambda r, d: abs(r - target_replay) if abs(r - target_replay) > tolerance
                                  else 0.0, max_probes=max_probes, progress=show)
        mode, target = "replay", float(target_replay)
    else:
        tau, probes = _search(prober, good=lambda r, d: d is not None and d <= quality_budget,
                              score=lambda r, d: -r, max_probes=max_probes, progress=show,
                              replay_resolution=0.002)
        mode, target = "quality", float(quality_budget)
        method = "search"
    chosen = next(p for p in probes if p[0] == tau)
    if not math.isclose(probes[-1][0], tau):  # per-prompt ratios at the chosen tau
        prober.run(tau)
    res = CalibrationResult(tau=float(tau), mode=mode, target=target, replay_calib=chosen[1],
                            divergence_calib=chosen[2], ceiling=ceiling, probes=probes, method=method,
                            n_calib=len(calib), replay_calib_ci=ci95(prober.per_prompt))
    if held is not None:
        hp = _Prober(fast, dense, held, num_frames, seed + 10_000, batch_size, generate_kwargs)
        res.replay_heldout, res.divergence_heldout = hp(tau)
        res.n_heldout, res.replay_heldout_ci = len(held), ci95(hp.per_prompt)
    res.seconds = time.perf_counter() - t_start
    return res


class NeverReplay:
    """The fast model at tau=+inf, used as the dense reference when no original model is given."""

    def __init__(self, fast: FastCarSession):
        self.fast = fast

    def new_state(self, batch: int, video_start: int = 0):
        return self.fast.new_state(batch, video_start)

    def step(self, state, ids, attention_mask=None):
        return self.fast.step(state, ids, attention_mask=attention_mask, threshold=math.inf)
