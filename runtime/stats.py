"""Run statistics returned with the tokens; their JSON is also the replay trace the FPGA simulator reads.

Replay ratio counts replayed MLPs over decode steps x rows x rewritten layers (docs/semantics.md section 1), frame 0
included, so with 8 frames of 256 tokens its ceiling is 1791/2047: frame 0 can never replay.
`replay_ratio_eligible` is the same count over the steps where replay was possible (frame 0 excluded).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fastcar_compile.core import contract
from fastcar_compile.core.atomic import write_text
from fastcar_compile.core.errors import FastCarError
from fastcar_compile.core.fileio import read_json


@dataclass
class RunStats:
    """What one `generate` call did. `steps` is the DESIGN.md replay trace: one entry per decode step,
    `pos` = KV index of the fed token, `replay` = [[0/1 per row] per rewritten layer]."""

    model: str
    fastcar: bool
    frame_tokens: int
    layers: list[int]
    batch: int
    video_start: int
    num_frames: int
    given_video_tokens: int = 0  # prompt tail that was already video (frame 0 given): frames count after it
    threshold: Any = None
    cfg_scale: float | None = None
    frames_done: int = 0
    interrupted: bool = False
    prefill_ms: float = 0.0
    step_ms: list[float] = field(default_factory=list)
    frame_ms: list[float] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)
    replay_ratio: float = 0.0
    replay_per_layer: list[float] = field(default_factory=list)
    replay_per_frame: list[float] = field(default_factory=list)
    replay_per_row: list[float] = field(default_factory=list)
    replay_layer_frame: list[list[float]] = field(default_factory=list)
    eligible_ratio_ceiling: float = 0.0
    replay_ratio_eligible: float = 0.0  # replayed / decisions where replay was possible (frame 0 excluded)
    tas: list[list[list[float]]] | None = None  # [step][layer][row], only when collected
    state_bytes: int = 0
    kv_bytes_per_token: int = 0
    native_ops: bool = False
    videos: int = 1  # generate calls merged into this trace (merge_runs)
    # speculative decoding (generate(draft=...)): the draft, verify steps, draft tokens proposed and accepted
    # (batch level: a step keeps the shortest accepted prefix of its rows)
    draft: str | None = None
    verify_steps: int = 0
    draft_proposed: int = 0
    draft_accepted: int = 0
    # --kv-diagnostics models: per compressed layer {density, recall, kv_bytes, dense_kv_bytes} against dense
    # attention run on the side, over every video of the run: the sums of the kv_stats.N outputs (executed pairs,
    # dense pairs, recall, queries) pooled, so density and recall are ratios over all of them; kv_bytes and
    # dense_kv_bytes are the resident KV of one video at its end (mean over the videos)
    kv_diagnostics: dict[str, dict[str, float]] | None = None
    # the same per video (one entry per batch row of each generate call, in order)
    kv_diagnostics_per_video: list[dict[str, dict[str, float]]] | None = None

    def add_kv_stats(self, extra: dict[str, np.ndarray]) -> None:
        """Accumulate one step's kv_stats.N outputs ([batch, kv_heads, 4]) per layer, pooled and per batch row:
        running sums only; density and recall are ratios of these sums, taken once in `finalize`."""
        for name, arr in extra.items():
            if not name.startswith(contract.KV_STATS_PREFIX):
                continue
            layer = name.split(".", 1)[1]
            rows = np.asarray(arr, dtype=np.float64).sum(axis=1)  # [batch, fields]
            if self.kv_diagnostics is None:
                self.kv_diagnostics = {}
            if self.kv_diagnostics_per_video is None:
                self.kv_diagnostics_per_video = [{} for _ in range(len(rows))]
            _add_sums(self.kv_diagnostics.setdefault(layer, {}), rows.sum(axis=0))
            for video, row in zip(self.kv_diagnostics_per_video, rows, strict=True):
                _add_sums(video.setdefault(layer, {}), row)

    def kv_ratios(self) -> dict[str, dict[str, float]]:
        """Per compressed layer {density, recall} from the running sums so far: density = executed / dense q.k
        pairs, recall = kept dense softmax mass / queries. Public so step-by-step callers (which never call
        `finalize`) read the ratios without relying on finalize having stored them; layers of a loaded
        run.json without numeric sums keep the ratios they say."""
        return _ratios(self.kv_diagnostics)

    def _kv_ratios(self) -> None:
        """Store `kv_ratios` in kv_diagnostics and in each video's entry (finalize: run.json carries them)."""
        videos = self.kv_diagnostics_per_video if isinstance(self.kv_diagnostics_per_video, list) else []
        for diag in [self.kv_diagnostics, *videos]:
            for layer, ratios in _ratios(diag).items():
                diag[layer].update(ratios)

    def add_kv_bytes(self, arrays: dict[str, np.ndarray], tokens: int) -> None:
        """Resident KV bytes per compressed layer and video (live slots x slot state) next to a dense cache of
        `tokens`; the pooled entry holds their mean over the videos."""
        videos = self.kv_diagnostics_per_video or []
        for layer, acc in (self.kv_diagnostics or {}).items():
            slots = arrays.get(contract.kv_slots_input(int(layer)))
            key = arrays.get(contract.kv_input(int(layer), "key"))
            if slots is None or key is None:
                continue
            per_slot = 2 * key.shape[-1] * key.itemsize + slots.shape[-1] * slots.itemsize
            dense = float(tokens * key.shape[1] * 2 * key.shape[-1] * key.itemsize)
            live = (slots[..., 0] > 0).reshape(len(slots), -1).sum(axis=1)
            for video, n in zip(videos, live, strict=False):
                video.setdefault(layer, {}).update(kv_bytes=float(n * per_slot), dense_kv_bytes=dense)
            acc["kv_bytes"] = float(live.mean() * per_slot)
            acc["dense_kv_bytes"] = dense

    # ------------------------------------------------------------------ derived numbers
    def replay_array(self) -> np.ndarray:
        """[steps, layers, batch] bool from the trace."""
        if not self.steps or not self.layers:
            return np.zeros((len(self.steps), len(self.layers), self.batch), dtype=bool)
        return np.array([s["replay"] for s in self.steps], dtype=bool).reshape(
            len(self.steps), len(self.layers), self.batch)

    def finalize(self) -> RunStats:
        """Recompute every ratio from the trace (called by generate; safe to call again)."""
        r = self.replay_array()
        frames = max(self.frames_done, 1)
        pos = np.array([s["pos"] for s in self.steps], dtype=np.int64)
        fr = (pos - self.video_start - self.given_video_tokens) // max(self.frame_tokens, 1)
        if r.size:
            self.replay_ratio = float(r.mean())
            self.replay_per_layer = [float(x) for x in r.mean(axis=(0, 2))]
            self.replay_per_row = [float(x) for x in r.mean(axis=(0, 1))]
        else:
            self.replay_ratio = 0.0
            self.replay_per_layer = [0.0] * len(self.layers)
            self.replay_per_row = [0.0] * self.batch
        per_frame, lf = [], []
        for f in range(frames):
            sel = r[fr == f]
            per_frame.append(float(sel.mean()) if sel.size else 0.0)
            lf.append([float(x) for x in sel.mean(axis=(0, 2))] if sel.size else [0.0] * len(self.layers))
        self.replay_per_frame = per_frame
        self.replay_layer_frame = [list(col) for col in zip(*lf, strict=True)] if lf and self.layers else []
        n = len(self.steps)
        elig = self.eligible_steps()
        self.eligible_ratio_ceiling = float(elig.sum() / n) if n else 0.0
        self.replay_ratio_eligible = float(r[elig].mean()) if r.size and elig.any() else 0.0
        self._kv_ratios()
        return self

    def eligible_steps(self) -> np.ndarray:
        """[steps] bool: decode steps whose aligned token (p - L) is video, i.e. not frame 0, so replay can
        happen there (docs/semantics.md section 1)."""
        pos = np.array([s["pos"] for s in self.steps], dtype=np.int64)
        return contract.aligned_is_video(pos, self.frame_tokens, self.video_start)

    @property
    def tau_text(self) -> str:
        """tau as people read it: 4 significant digits, one per layer with --per-layer-threshold."""
        return format_tau(self.threshold)

    def frame_axis_label(self) -> str:
        """What the frame axis of a run's pictures counts, and whether generated frame 0 can replay: its
        aligned tokens (one frame back) are video only where the prompt ends with given video tokens."""
        given, L = self.given_video_tokens, max(self.frame_tokens, 1)
        if not given:
            return "generated frame (frame 0 never replays: nothing one frame back)"
        if given >= L:
            return f"generated frame (after {given} given video tokens: frame 0 replays against the given frame)"
        return (f"generated frame (after {given} given video tokens: the first {L - given} tokens of frame 0 "
                "never replay)")

    def threshold_warning(self) -> str | None:
        """A warning when tau replays every eligible MLP or none of them so far (after at least one full
        frame of eligible steps): such a tau says nothing about the model and is almost always a TAS scale
        mismatch (e.g. the paper's raw-TAS -4 with the default post-RoPE TAS)."""
        r, elig = self.replay_array(), self.eligible_steps()
        if not self.fastcar or not self.layers or elig.sum() < max(1, self.frame_tokens // 2):
            return None
        share = float(r[elig].mean())
        if 0.0 < share < 1.0 or not np.all(np.isfinite(np.asarray(self.threshold, dtype=float))):
            return None  # +-inf: all or nothing on purpose
        what = "every eligible MLP" if share == 1.0 else "no MLP"
        tas = ""
        if self.tas:
            t = np.asarray(self.tas, dtype=float)[elig[: len(self.tas)]]
            if t.size:
                tas = f"; TAS on these steps spans {np.quantile(t, 0.05):.3g} .. {np.quantile(t, 0.95):.3g} (5-95%)"
        return (f"tau={self.tau_text} replays {what} on the first {int(elig.sum())} eligible decode steps{tas}: "
                "the threshold is off the model's TAS scale. Calibrate it (fastcar-compile ... --calibrate-replay "
                "0.5 --calib-data prompts.npy) or, for the paper's raw-TAS values (-1/-4/-8), compile with "
                "--tas-query raw")

    def per_token_replay(self) -> np.ndarray:
        """[frames, L] share of layers x rows (x videos) that replayed the MLP of each token position of
        each generated frame (frame numbering as replay_per_frame: after any given video tokens)."""
        L = max(self.frame_tokens, 1)
        frames = max(self.frames_done, 1)
        out, cnt = np.zeros((frames, L)), np.zeros((frames, L))
        r = self.replay_array()
        for i, st in enumerate(self.steps):
            f, t = divmod(st["pos"] - self.video_start - self.given_video_tokens, L)
            if 0 <= f < frames and r.size:
                out[f, t] += r[i].mean()
                cnt[f, t] += 1
        return np.divide(out, cnt, out=np.zeros_like(out), where=cnt > 0)

    @property
    def ms_per_token(self) -> float:
        """Mean decode step time, robust to machine noise: steps grouped by how many (layer, row) MLPs
        replayed, each group's median weighted by its share (a plain median reports the replayed-step time
        once more than half the steps replay; a plain mean is dominated by descheduled steps)."""
        return self._mixture(np.ones(len(self.step_ms), dtype=bool))

    def ms_per_token_by_frame(self) -> list[float]:
        """`ms_per_token` of each frame's decode steps (frame numbering as replay_per_frame)."""
        pos = np.array([s["pos"] for s in self.steps], dtype=np.int64)
        fr = (pos - self.video_start - self.given_video_tokens) // max(self.frame_tokens, 1)
        return [self._mixture(fr[: len(self.step_ms)] == f) for f in range(max(self.frames_done, 1))]

    def _mixture(self, sel: np.ndarray) -> float:
        t = np.asarray(self.step_ms, dtype=np.float64)[sel]
        if not t.size:
            return 0.0
        r = self.replay_array()[: len(self.step_ms)][sel]
        g = r.reshape(len(r), -1).sum(axis=1) if r.size else np.zeros(t.size)
        return float(sum((g == v).mean() * np.median(t[g == v]) for v in np.unique(g)))

    @property
    def acceptance(self) -> float:
        """Share of the draft tokens the model accepted (0 without drafts)."""
        return self.draft_accepted / self.draft_proposed if self.draft_proposed else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens kept per verify step (1 without drafts)."""
        return len(self.steps) / self.verify_steps if self.verify_steps else 1.0

    @property
    def ms_per_step(self) -> float:
        """Median decode step time (robust to the odd descheduled step on a shared machine)."""
        return float(np.median(self.step_ms)) if self.step_ms else 0.0

    def summary(self) -> str:
        """A few human-readable lines (what docs/runtime.md shows)."""
        lines = [f"{Path(self.model).name}: {self.frames_done}/{self.num_frames} frames x {self.frame_tokens} "
                 f"tokens, batch {self.batch}{' (interrupted)' if self.interrupted else ''}",
                 f"  prefill {self.prefill_ms:.1f} ms, decode {self.ms_per_token:.3f} ms/token (median per "
                 f"replay group), {self.videos} video(s)"]
        if self.draft:
            lines.append(f"  draft {self.draft}: {100 * self.acceptance:.1f}% of {self.draft_proposed} draft tokens "
                         f"accepted, {self.tokens_per_step:.2f} tokens per verify step ({self.verify_steps} steps)")
        if self.fastcar:
            lines.append(f"  replay {100 * self.replay_ratio:.1f}% of all decode steps, frame 0 included (ceiling "
                         f"{100 * self.eligible_ratio_ceiling:.1f}%); {100 * self.replay_ratio_eligible:.1f}% of "
                         f"eligible steps (frame 0 excluded), at tau={self.tau_text}")
            lines.append("  per layer: " + " ".join(f"L{n}={100 * v:.0f}%" for n, v in
                                                    zip(self.layers, self.replay_per_layer, strict=True)))
            lines.append("  per frame: " + " ".join(f"{100 * v:.0f}%" for v in self.replay_per_frame))
            lines.append("  per row:   " + " ".join(f"{100 * v:.0f}%" for v in self.replay_per_row))
        return "\n".join(lines)

    # ------------------------------------------------------------------ JSON
    @classmethod
    def merge(cls, runs: list[RunStats]) -> RunStats:
        """One trace of several generate calls of the same model, batch and prompt length (eval runs one
        video batch at a time): steps and step times concatenated, per-frame times and prefill averaged."""
        if not runs:
            raise FastCarError("no runs to merge")
        a = runs[0]
        for r in runs[1:]:
            if (r.batch, r.video_start, r.frame_tokens, r.layers) != (a.batch, a.video_start, a.frame_tokens,
                                                                       a.layers):
                raise FastCarError("runs differ in batch, prompt length, frame size or layers; cannot merge")
        d = a.to_dict()
        d["steps"] = [st for r in runs for st in r.steps]
        d["step_ms"] = [t for r in runs for t in r.step_ms]
        n = min(len(r.frame_ms) for r in runs)
        d["frame_ms"] = [float(np.mean([r.frame_ms[f] for r in runs])) for f in range(n)]
        d["frames_done"] = min(r.frames_done for r in runs)
        d["prefill_ms"] = float(np.mean([r.prefill_ms for r in runs]))
        d["interrupted"] = any(r.interrupted for r in runs)
        d["videos"] = sum(r.videos for r in runs)
        for k in ("verify_steps", "draft_proposed", "draft_accepted"):
            d[k] = sum(getattr(r, k) for r in runs)
        d["tas"] = None
        if any(r.kv_diagnostics for r in runs):
            d["kv_diagnostics"], d["kv_diagnostics_per_video"] = _merge_kv(runs)
        return cls(**d).finalize()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def save(self, path: str | os.PathLike) -> Path:
        """Write run.json atomically (temp file in the same folder, then rename)."""
        return write_text(path, self.to_json())

    @classmethod
    def from_json(cls, text: str) -> RunStats:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as exc:
            raise FastCarError(f"not a run.json (invalid JSON: {exc})") from exc
        except RecursionError:
            raise FastCarError("not a run.json: it nests too deeply") from None
        return cls.from_dict(d)

    @classmethod
    def from_dict(cls, d: Any) -> RunStats:
        """A parsed run.json, its types and bounds checked (_check_schema)."""
        if not isinstance(d, dict):
            raise FastCarError("not a run.json: expected a JSON object")
        missing = [k for k in ("frame_tokens", "layers", "batch", "steps") if k not in d]
        if missing:
            raise FastCarError(f"not a run.json from the runtime: missing {missing}")
        _check_schema(d)
        known = set(cls.__dataclass_fields__)
        d.setdefault("model", "?")
        d.setdefault("fastcar", bool(d["layers"]))
        d.setdefault("video_start", 0)
        d.setdefault("num_frames", 0)
        return cls(**{k: v for k, v in d.items() if k in known})

    @classmethod
    def load(cls, path: str | os.PathLike) -> RunStats:
        """A run.json written by generate(..., trace=PATH) or RunStats.save (fileio.read_json: bounded)."""
        return cls.from_dict(read_json(path, "run.json"))


def format_tau(tau: Any) -> str:
    """A threshold (a number, +-inf or one per layer) with 4 significant digits."""
    if isinstance(tau, list | tuple):
        return "[" + ", ".join(format_tau(t) for t in tau) + "]"
    try:
        return f"{float(tau):.4g}"
    except (TypeError, ValueError):
        return str(tau)


def _add_sums(acc: dict[str, float], values: np.ndarray) -> None:
    for key, v in zip(contract.KV_STATS_FIELDS, values, strict=True):
        acc[key] = acc.get(key, 0.0) + float(v)


def _ratios(diag: Any) -> dict[str, dict[str, float]]:
    """{layer: {density, recall}} of one kv_diagnostics dict (pooled or one video's); see RunStats.kv_ratios."""
    out = {}
    for layer, acc in (diag if isinstance(diag, dict) else {}).items():
        if not isinstance(acc, dict):
            continue
        if all(isinstance(acc.get(k), float | int) for k in contract.KV_STATS_FIELDS):
            out[layer] = {"density": acc["executed"] / max(acc["dense"], 1.0),
                          "recall": acc["recall_sum"] / max(acc["queries"], 1.0)}
        elif "density" in acc and "recall" in acc:
            out[layer] = {"density": acc["density"], "recall": acc["recall"]}
    return out


def _merge_kv(runs: list[RunStats]) -> tuple[dict[str, dict[str, float]], list[dict[str, dict[str, float]]]]:
    """KV diagnostics of several runs: the kv_stats sums pooled over every run, the videos listed in order and
    the resident bytes averaged over them (over the runs for a run.json that lists no videos)."""
    videos = [dict(v) for r in runs for v in (r.kv_diagnostics_per_video or [])]
    pooled: dict[str, dict[str, float]] = {}
    for r in runs:
        for layer, acc in (r.kv_diagnostics or {}).items():
            if all(isinstance(acc.get(k), float | int) for k in contract.KV_STATS_FIELDS):
                _add_sums(pooled.setdefault(layer, {}), np.array([acc[k] for k in contract.KV_STATS_FIELDS]))
    for layer, acc in pooled.items():
        for key in ("kv_bytes", "dense_kv_bytes"):
            vals = [v[layer][key] for v in videos if key in v.get(layer, {})] or \
                [r.kv_diagnostics[layer][key] for r in runs if key in (r.kv_diagnostics or {}).get(layer, {})]
            if vals:
                acc[key] = float(np.mean(vals))
    return pooled, videos


def _is_int(v: Any, lo: int, hi: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool)


def _is_thresholds(v: Any) -> bool:
    """tau as the runtime records it: none, one number, or one per layer (inf/nan are floats: json allows)."""
    return v is None or _is_number(v) or (isinstance(v, list) and all(_is_number(x) for x in v))


def _check_schema(d: dict[str, Any]) -> None:
    """Types and bounds of a run.json (a hand-edited or foreign file must not crash or hang the report)."""
    bad = [k for k, lo, hi in (("frame_tokens", 1, 2**31), ("batch", 1, 4096), ("video_start", 0, 2**40),
                               ("num_frames", 0, 2**31), ("frames_done", 0, 2**31),
                               ("given_video_tokens", 0, 2**40))
           if k in d and not _is_int(d[k], lo, hi)]
    layers, steps = d["layers"], d["steps"]
    if not isinstance(layers, list) or len(layers) > 4096 or not all(_is_int(x, 0, 2**16) for x in layers):
        bad.append("layers")
    if not isinstance(steps, list) or not all(isinstance(st, dict) and _is_int(st.get("pos"), 0, 2**40)
                                              for st in steps):
        bad.append("steps")
    for k in ("step_ms", "frame_ms"):
        if k in d and (not isinstance(d[k], list) or not all(isinstance(x, int | float) and not isinstance(x, bool)
                                                             for x in d[k])):
            bad.append(k)
    if "prefill_ms" in d and (not isinstance(d["prefill_ms"], int | float) or isinstance(d["prefill_ms"], bool)):
        bad.append("prefill_ms")
    if "model" in d and not isinstance(d["model"], str):
        bad.append("model")
    for k, ok in (("threshold", _is_thresholds), ("cfg_scale", lambda v: v is None or _is_number(v)),
                  ("fastcar", _is_bool), ("interrupted", _is_bool), ("native_ops", _is_bool),
                  ("videos", lambda v: _is_int(v, 1, 2**31)),
                  ("draft", lambda v: v is None or isinstance(v, str)),
                  *((k, lambda v: _is_int(v, 0, 2**62)) for k in ("verify_steps", "draft_proposed", "draft_accepted")), ("state_bytes", lambda v: _is_int(v, 0, 2**62)),
                  ("kv_bytes_per_token", lambda v: _is_int(v, 0, 2**62)),
                  ("tas", lambda v: v is None or isinstance(v, list)),
                  ("kv_diagnostics", lambda v: v is None or isinstance(v, dict)),
                  ("kv_diagnostics_per_video", lambda v: v is None or (isinstance(v, list) and
                                                                       all(isinstance(x, dict) for x in v)))):
        if k in d and not ok(d[k]):
            bad.append(k)
    if not bad and d.get("frames_done", 0) > len(steps) + 1:
        bad.append("frames_done")
    if not bad and layers:
        want = (len(layers), d["batch"])
        for st in steps:
            try:
                r = np.asarray(st.get("replay"), dtype=float)
            except (TypeError, ValueError):
                r = None
            if r is None or r.shape != want or not np.isin(r, (0, 1)).all():
                bad.append(f"steps[].replay (each must be [{want[0]} layers][{want[1]} rows] of 0/1)")
                break
    if bad:
        raise FastCarError(f"not a run.json from the runtime: bad or out-of-range {', '.join(bad)}")
