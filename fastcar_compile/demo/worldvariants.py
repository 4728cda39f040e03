"""The world model's cache variants, compiled and rolled out over the same paths: what `demo --world` and the
world-memory benchmark both run, declared once.

Why one place: the question is what each cache keeps of the model's memory, so every variant must see the same
weights, paths, frame 0 and settings; only the compiler options (and FastCar's tau) differ.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fastcar_compile.demo import world
from fastcar_compile.demo.worldmodel import FRAME_TOKENS, VIDEO_START
from fastcar_compile.demo.worldrun import (
    Rollout,
    label_accuracy,
    lockstep,
    mean_ci,
    path_tokens,
    rollout,
    rollout_frames,
    shift_tokens,
)

SIM = 0.9  # TempCache's merge cosine
LSH = "lsh:8x4"
INT8 = "int8"
SHIFT = "shift"  # the trivial baseline: the last frame shifted by the action
FASTCAR = "fastcar"  # variants named so run with FastCar's tau; the others never replay (tau = +inf)


@dataclass(frozen=True)
class CacheSettings:
    sinks: int = 4  # tokens every bounded cache keeps
    window_frames: int = 4  # frames the sink + window cache (and the FAST-AR caches' window) keeps
    fastar_budget_frames: int = 8  # KV slots of the FAST-AR caches, in frames

    @property
    def budget(self) -> int:
        return self.sinks + self.fastar_budget_frames * FRAME_TOKENS


def variants(c: CacheSettings, every: bool) -> dict[str, dict | None]:
    """Variant name -> compiler options (None: the shift baseline). every=False: full, window, all FAST-AR modes
    together, FastCar and shift; True adds each FAST-AR mode alone and FastCar on the FAST-AR cache."""
    L = FRAME_TOKENS
    win = {"kv_sinks": c.sinks, "kv_window": c.window_frames * L}
    fastar = {"kv_budget": c.budget, **win}
    out: dict[str, dict | None] = {
        SHIFT: None, "full": {}, "window": {"kv_budget": c.sinks + c.window_frames * L + 1, **win, "kv_eviction": "oldest"}}
    if every:
        out["TempCache"] = {**fastar, "tempcache": SIM}
        out["AnnSA lsh"] = {**fastar, "sparse_attention": LSH}
        out["AnnSA int8"] = {**fastar, "sparse_attention": INT8}
    out["fastar"] = {**fastar, "tempcache": SIM, "sparse_attention": LSH}
    out[FASTCAR] = {}
    if every:
        out[f"{FASTCAR}+fastar"] = dict(out["fastar"])
    return out


def rotary_positions(frames: int) -> int:
    return 1 + frames * FRAME_TOKENS + 1


def calibrate_tau(onnx: Path, folder: Path, tok, replay: float, paths: int, frames: int, seed: int = 0,
                  threads: int = 1) -> tuple[float, float]:
    """(tau, the replay it gives) for `replay` of the MLPs: the TAS quantile over training-split paths' rollouts
    through a diagnostics graph at tau = +inf."""
    import fastcar_compile
    from fastcar_compile.runtime.session import FastCarSession

    path = folder / "calibrate.onnx"
    fastcar_compile.compile(str(onnx), str(path), frame_tokens=FRAME_TOKENS, video_start=VIDEO_START,
                            rotary_positions=rotary_positions(frames),
                            emit_diagnostics=True)
    ps = world.make_paths("train", paths, frames, seed=seed, start=10_000)
    truth, actions = path_tokens(tok, ps)
    tas = rollout(FastCarSession(path, threads=threads), truth[:, 0], actions, threshold=float("inf")).tas.reshape(-1)
    tau = float(np.quantile(tas, 1.0 - replay))
    return tau, float((tas > tau).mean())


def run_variants(onnx: Path, tok, paths: list[world.WorldPath], chosen: dict[str, dict | None], tau: float,
                 window_frames: int, threads: int = 1, report: Callable[[dict], None] | None = None,
                 in_lockstep: bool = False) -> tuple[list[dict], dict[str, np.ndarray]]:
    """Roll `paths` (batched) out through each variant: (a row per variant: accuracy per cell label with its 95%
    interval and per path, the paired difference to the window (revisits beyond it) and to the shift baseline
    (new cells), agreement with `full`, FPS early / late, cache MiB early / late,
    RSS, replay; tokens per variant). `in_lockstep`: the variants' rollouts advance one frame each in turn (their
    speeds then share the machine's load), else one variant after another."""
    truth, actions = path_tokens(tok, paths)
    T = actions.shape[1]
    early = frame_windows(T)[0]
    rows, tokens, per_path = [], {}, {}
    with tempfile.TemporaryDirectory(prefix="world-variants-") as tmp:
        def frames(name: str, opts: dict):
            session = _session(onnx, Path(tmp) / f"{list(chosen).index(name)}.onnx", opts, T, threads)
            return rollout_frames(session, truth[:, 0], actions,
                                  threshold=tau if name.startswith(FASTCAR) else float("inf"),
                                  measure_at=(early[1] - 1, T - 1))

        runs: dict = {}
        t0 = time.perf_counter()
        for name, opts in chosen.items():
            if opts is None:
                done: Rollout | np.ndarray = shift_tokens(truth[:, 0], actions)
            elif in_lockstep:
                runs[name] = frames(name, opts)
                continue
            else:
                done = lockstep({name: frames(name, opts)})[name]
            rows.append(_score(name, opts, done, truth, paths, window_frames, tokens, per_path, t0))
            t0 = time.perf_counter()
            if report is not None:
                report(rows[-1])
        for name, done in lockstep(runs).items():
            rows.append(_score(name, chosen[name], done, truth, paths, window_frames, tokens, per_path, t0))
            if report is not None:
                report(rows[-1])
    for row in rows:  # paired over the same paths
        for k, ref in (("revisit_far", "window"), ("new", SHIFT)):
            if ref in per_path and row["variant"] != ref:
                d = per_path[row["variant"]][k] - per_path[ref][k]
                row[f"{k}_minus_{ref}"], row[f"{k}_minus_{ref}_ci"], _ = mean_ci(d)
    return rows, tokens


def _session(onnx: Path, path: Path, opts: dict, frames: int, threads: int):
    """The variant's graph compiled to `path` and its session (a growing cache gets one buffer for the whole video,
    written in place)."""
    import fastcar_compile
    from fastcar_compile.runtime.session import FastCarSession

    fastcar_compile.compile(str(onnx), str(path), frame_tokens=FRAME_TOKENS, video_start=VIDEO_START,
                            rotary_positions=rotary_positions(frames), **opts)
    return FastCarSession(path, threads=threads,
                          max_length=None if opts.get("kv_budget") else rotary_positions(frames))


def _score(name: str, opts: dict | None, done, truth: np.ndarray, paths: list[world.WorldPath], window_frames: int,
           tokens: dict, per_path: dict, t0: float) -> dict:
    """One variant's row from its rollout (or the shift baseline's tokens)."""
    B, T = truth.shape[:2]
    early, late = frame_windows(T)
    fr = done if isinstance(done, Rollout) else None
    pred = fr.tokens if fr is not None else done
    tokens[name] = pred
    row: dict = {"variant": name, "options": opts}
    per_path[name] = label_accuracy(pred, truth, paths, window_frames)
    for k, v in per_path[name].items():
        row[k], row[f"{k}_ci"], row[f"{k}_n"] = mean_ci(v)
        row[f"{k}_paths"] = [None if x != x else float(x) for x in v]
    row["agree_full"] = float((pred == tokens["full"])[:, 1:].mean()) if "full" in tokens and name != "full" \
        else None
    if fr is not None:
        sec = fr.frame_seconds
        row["fps_early"] = B / float(np.median(sec[early[0]:early[1]]))
        row["fps_late"] = B / float(np.median(sec[late[0]:late[1]]))
        row["cache_mib_early"] = fr.cache_mib[early[1] - 1]
        row["cache_mib_late"] = fr.cache_mib[T - 1]
        row["rss_mib"] = fr.rss_mib[T - 1]
        row["replay"] = float(fr.replay[1:].mean()) if fr.replay is not None and name.startswith(FASTCAR) else None
    row["seconds"] = time.perf_counter() - t0
    return row


def frame_windows(frames: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(early, late) frame ranges [start, stop) the speeds are taken over: 5-15% of the video and the last 10%."""
    early = (max(1, int(0.05 * frames)), max(2, int(0.15 * frames)))
    return early, (max(early[1], int(0.9 * frames)), frames)
