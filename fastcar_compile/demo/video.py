"""Generate demo videos in ONNX Runtime with the runtime's `FastCarSession` (dense and FastCar alike).

The runtime's `generate()` puts `video_start` after the whole prompt; here frame 0 is *video* given as
context (video_start = 3, after BOS, motion, VIDEO_START), so frame 1 may already replay frame 0's MLP
outputs. This thin loop therefore drives `FastCarSession.step` with that `video_start` itself.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from fastcar_compile.demo.model import CODES, VIDEO_START, prompt


@dataclass
class VideoRun:
    """Tokens [frames, L], per-step replay [steps, layers] (bool), per-step wall time in ms."""

    tokens: np.ndarray
    replay: np.ndarray
    step_ms: list[float] = field(default_factory=list)
    ort_ms: list[float] = field(default_factory=list)  # bare ORT run per token (ort_lockstep_ms)
    tas: np.ndarray | None = None  # [steps, layers] when the model has diagnostics outputs

    @property
    def replay_ratio(self) -> float:
        return float(self.replay.mean()) if self.replay.size else 0.0

    def replay_map(self, frame_tokens: int) -> np.ndarray:
        """[frames, L] share of rewritten layers that replayed each token (frame 0 given: zeros)."""
        per_tok = self.replay.mean(axis=1) if self.replay.size else np.zeros(len(self.step_ms))
        out = np.zeros(self.tokens.shape, dtype=np.float32)
        out.reshape(-1)[frame_tokens:frame_tokens + len(per_tok)] = per_tok
        return out


def open_session(path, threads: int = 1):
    """A runtime session with `threads` intra-op threads (1 gives the steadiest per-token timings)."""
    from fastcar_compile.runtime.session import FastCarSession

    return FastCarSession(path, threads=threads)


def generate_video(session, motion: str, frame0: np.ndarray, new_frames: int,
                   threshold: float | None = None) -> VideoRun:
    """Greedy: frame 0 tokens given, `new_frames` frames generated one token per step from fresh state."""
    L = int(len(frame0))
    ids = np.asarray([prompt(motion) + [int(t) for t in frame0]], dtype=np.int64)
    thr = None if threshold is None or not session.is_fastcar else session.threshold_array(threshold)
    state = session.new_state(1, video_start=VIDEO_START)
    out = session.step(state, ids, threshold=thr)
    state = out.state
    n = new_frames * L
    toks = np.empty(n, dtype=np.int64)
    # replay[k]: decision of each rewritten layer for the step that fed generated token k (its MLP);
    # the last token is never fed, so there are n - 1 decode steps.
    replay = np.zeros((n - 1, len(session.layers)), dtype=bool)
    times: list[float] = []
    tas = np.zeros((n - 1, len(session.layers)), np.float32) if session.has_diagnostics else None
    toks[0] = int(out.logits[0, -1, :CODES].argmax())
    for k in range(n - 1):
        t0 = time.perf_counter()
        out = session.step(state, toks[k:k + 1][None], threshold=thr, check=False)
        times.append(1e3 * (time.perf_counter() - t0))
        state = out.state
        if out.replay is not None:
            replay[k] = out.replay[:, 0]
        if tas is not None and out.tas is not None:
            tas[k] = out.tas[:, 0, 0]
        toks[k + 1] = int(out.logits[0, -1, :CODES].argmax())
    frames = np.concatenate([np.asarray(frame0, np.int64), toks]).reshape(1 + new_frames, L)
    return VideoRun(frames, replay, times, tas=tas)


def generate_pair(dense, fast, motion: str, frame0: np.ndarray, new_frames: int,
                  threshold: float | None = None) -> tuple[VideoRun, VideoRun]:
    """Dense and FastCar greedy videos in lockstep: one dense step, one FastCar step (order alternating),
    so both models' per-token times are taken under the same machine load (shared CPUs drift by 2x)."""
    L = int(len(frame0))
    ids = np.asarray([prompt(motion) + [int(t) for t in frame0]], dtype=np.int64)
    thr = None if threshold is None or not fast.is_fastcar else fast.threshold_array(threshold)
    sessions = (dense, fast)
    thrs = (None, thr)
    states, nxt = [], []
    for s, t in zip(sessions, thrs, strict=True):
        o = s.step(s.new_state(1, video_start=VIDEO_START), ids, threshold=t)
        states.append(o.state)
        nxt.append(int(o.logits[0, -1, :CODES].argmax()))
    n = new_frames * L
    toks = np.empty((2, n), dtype=np.int64)
    toks[:, 0] = nxt
    replay = np.zeros((n - 1, len(fast.layers)), dtype=bool)
    times: tuple[list[float], list[float]] = ([], [])
    for k in range(n - 1):
        for j in ((0, 1) if k % 2 == 0 else (1, 0)):
            s = sessions[j]
            t0 = time.perf_counter()
            o = s.step(states[j], toks[j, k:k + 1][None], threshold=thrs[j], check=False)
            times[j].append(1e3 * (time.perf_counter() - t0))
            states[j] = o.state
            toks[j, k + 1] = int(o.logits[0, -1, :CODES].argmax())
            if j == 1 and o.replay is not None:
                replay[k] = o.replay[:, 0]
    f0 = np.asarray(frame0, np.int64)
    frames = [np.concatenate([f0, toks[j]]).reshape(1 + new_frames, L) for j in (0, 1)]
    return (VideoRun(frames[0], np.zeros((n - 1, 0), bool), times[0]), VideoRun(frames[1], replay, times[1]))


def ort_lockstep_ms(dense, fast, seq_dense: np.ndarray, seq_fast: np.ndarray, prefill: int,
                    threshold: float | None) -> tuple[list[float], list[float]]:
    """Per-token time of the bare ORT `run` (no Python driver work), dense and FastCar in lockstep.

    Each model re-runs its own generated sequence (teacher forcing reproduces its greedy video, hence the
    same replay decisions); only `InferenceSession.run` is timed. This is the per-token cost a C/C++ driver
    would see; `FastCarSession.step` adds its Python bookkeeping on top of it.
    """
    sess = (dense, fast)
    seqs = (np.asarray(seq_dense, np.int64), np.asarray(seq_fast, np.int64))
    names = [list(s.output_names) for s in sess]
    pairs = [[(sp.input, sp.output) for sp in s.specs] for s in sess]
    arrays = [dict(s.new_state(1, video_start=VIDEO_START).arrays) for s in sess]
    extra = [dense.model_feeds(VIDEO_START), fast.model_feeds(VIDEO_START, threshold)]
    times: tuple[list[float], list[float]] = ([], [])
    n = len(seqs[0])
    for a, b in [(0, prefill)] + [(t, t + 1) for t in range(prefill, n - 1)]:
        for j in ((0, 1) if a % 2 == 0 else (1, 0)):
            feeds = {"input_ids": seqs[j][None, a:b], "attention_mask": np.ones((1, b), np.int64),
                     "position_ids": np.arange(a, b, dtype=np.int64)[None], **extra[j], **arrays[j]}
            t0 = time.perf_counter()
            outs = sess[j].run_feeds(feeds)
            dt = 1e3 * (time.perf_counter() - t0)
            if b - a == 1:
                times[j].append(dt)
            res = dict(zip(names[j], outs, strict=True))
            arrays[j] = {i: res[o] for i, o in pairs[j]}
    return times


def ort_alone_ms(session, seq: np.ndarray, prefill: int, threshold: float | None) -> list[float]:
    """Per-token time of the bare ORT `run` for one model on its own (teacher-forcing its own sequence).

    Why not lockstep with the other model: two models' weights (~2 x 12 MB fp32) then fight over the CPU
    cache, which slowed dense steps 1.6x and FastCar's computed steps 2.2x in a measurement (docs/demo.md).
    A deployed decoder runs one model; callers alternate whole sequences of the two models instead.
    """
    seq = np.asarray(seq, np.int64)
    names = list(session.output_names)
    pairs = [(sp.input, sp.output) for sp in session.specs]
    arrays = dict(session.new_state(1, video_start=VIDEO_START).arrays)
    extra = session.model_feeds(VIDEO_START, threshold)
    times: list[float] = []
    for a, b in [(0, prefill)] + [(t, t + 1) for t in range(prefill, len(seq) - 1)]:
        feeds = {"input_ids": seq[None, a:b], "attention_mask": np.ones((1, b), np.int64),
                 "position_ids": np.arange(a, b, dtype=np.int64)[None], **extra, **arrays}
        t0 = time.perf_counter()
        outs = session.run_feeds(feeds)
        dt = 1e3 * (time.perf_counter() - t0)
        if b - a == 1:
            times.append(dt)
        res = dict(zip(names, outs, strict=True))
        arrays = {i: res[o] for i, o in pairs}
    return times
