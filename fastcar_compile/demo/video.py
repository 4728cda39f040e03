"""Generate demo videos in ONNX Runtime with the runtime's `FastCarSession` (dense and FastCar alike).

Frame 0 is *video* given as context (`given_video_tokens`: video_start sits after the text prompt, before
frame 0), so frame 1 may already replay frame 0's MLP outputs. Decoding (sampled or greedy, CFG) is
`demo.decoding`'s; the loop is the runtime's `generate`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from fastcar_compile.demo.decoding import GREEDY, Decoding, code_mask
from fastcar_compile.demo.model import CODES, VIDEO_START


@dataclass
class VideoRun:
    """Tokens [frames, L], per-step replay [steps, layers] (bool), per-step wall time in ms."""

    tokens: np.ndarray
    replay: np.ndarray
    step_ms: list[float] = field(default_factory=list)
    ort_ms: list[float] = field(default_factory=list)  # bare ORT run per token (ort_alone_ms)
    tas: np.ndarray | None = None  # [steps, layers] when the model has diagnostics outputs
    replay_rows: np.ndarray | None = None  # [steps, layers, rows] bool: each batch row's decision (CFG: 2 rows)
    positions: np.ndarray | None = None  # [steps] KV index each decode step wrote (its context is pos + 1)
    kv: dict | None = None  # per compressed layer {density, recall, ...} from --kv-diagnostics models

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


def generate_video(session, prompt_ids: list[int], frame0: np.ndarray, new_frames: int,
                   threshold: float | None = None, *, decoding: Decoding = GREEDY, seed: int = 0,
                   uncond_ids: list[int] | None = None, codes: int = CODES) -> VideoRun:
    """Frame 0's tokens given after `prompt_ids`, `new_frames` frames generated one token per step from fresh
    state by the runtime's `generate` (so sampling, CFG and replay are the runtime's own), choosing only image
    codes [0, codes). With `decoding.cfg_scale` and `uncond_ids` (the unconditional prompt) the batch holds both
    rows; replay is then the share of the two rows' decisions. Ctrl-C stops the whole run (KeyboardInterrupt)."""
    from fastcar_compile.runtime.decode import generate

    f0 = [int(t) for t in frame0]
    L = len(f0)
    cfg = decoding.cfg_scale is not None and uncond_ids is not None
    res = generate(session, [list(prompt_ids) + f0], new_frames, frame_tokens=L,
                   threshold=threshold if session.is_fastcar else None, do_sample=decoding.do_sample,
                   temperature=decoding.temperature, top_k=decoding.top_k, top_p=decoding.top_p, seed=seed,
                   cfg_scale=decoding.cfg_scale if cfg else None,
                   uncond_prompt_ids=[list(uncond_ids) + f0] if cfg else None, given_video_tokens=L,
                   progress=False, collect_tas=session.has_diagnostics, logits_processor=code_mask(codes)).complete()
    st = res.stats
    layers = len(session.layers)
    # replay[k]: decision of each rewritten layer for the step that fed generated token k (its MLP), the mean
    # over the batch rows; the last token is never fed, so there are n - 1 decode steps.
    rows = 2 if cfg else 1
    rep = np.array([s["replay"] for s in st.steps], np.float32).reshape(len(st.steps), layers, rows)
    replay = rep.mean(axis=2) if rows > 1 else rep[:, :, 0].astype(bool)
    tas = np.array(st.tas, np.float32)[:, :, 0] if st.tas is not None else None
    frames = np.concatenate([np.asarray(f0, np.int64), res.tokens[0]]).reshape(1 + new_frames, L)
    kv = st.kv_ratios() if st.kv_diagnostics else None
    return VideoRun(frames, replay, list(st.step_ms), tas=tas, replay_rows=rep.astype(bool),
                    positions=np.array([s["pos"] for s in st.steps], np.int64), kv=kv)


def ort_alone_ms(session, seq: np.ndarray, prefill: int, threshold: float | None,
                 video_start: int = VIDEO_START) -> list[float]:
    """Per-token time of the bare ORT `run` for one model on its own (teacher-forcing its own sequence:
    the same inputs, hence the same replay decisions as its generation). `seq` [n] or [rows, n]: with CFG
    the conditional and the unconditional row, as generation ran them.

    Why not lockstep with the other model: two models' weights (~2 x 12 MB fp32) then fight over the CPU
    cache, which slowed dense steps 1.6x and FastCar's computed steps 2.2x in a measurement (docs/demo.md).
    A deployed decoder runs one model; callers alternate whole sequences of the two models instead.
    """
    seq = np.atleast_2d(np.asarray(seq, np.int64))
    rows = len(seq)
    names = list(session.output_names)
    pairs = [(sp.input, sp.output) for sp in session.specs]
    arrays = dict(session.new_state(rows, video_start=video_start).arrays)
    extra = session.model_feeds(video_start, threshold)
    times: list[float] = []
    for a, b in [(0, prefill)] + [(t, t + 1) for t in range(prefill, seq.shape[1] - 1)]:
        feeds = {"input_ids": seq[:, a:b], "attention_mask": np.ones((rows, b), np.int64),
                 "position_ids": np.repeat(np.arange(a, b, dtype=np.int64)[None], rows, axis=0), **extra, **arrays}
        t0 = time.perf_counter()
        outs = session.run_feeds(feeds)
        dt = 1e3 * (time.perf_counter() - t0)
        if b - a == 1:
            times.append(dt)
        res = dict(zip(names, outs, strict=True))
        arrays = {i: res[o] for i, o in pairs}
    return times
