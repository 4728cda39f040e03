"""Training batches of the video model drawn from a pool of clips that worker processes generate ahead.

Why: on an accelerator one training step of 64+ clips takes well under a second, while making one scene clip
(`scenes.make_scene_clip`, PIL warps) and tokenizing it costs ~80 ms of one CPU core, so clips cannot be made
per step as `videomodel.batch_for_step` does on the CPU. Worker processes generate clips in index order into a
growing array; step `k` samples its clips from a sliding window of it: the first `first + k * refresh` clips,
at most the last `window` of them. Which clips, which conditioning drops and which position gaps a step sees is
a pure function of (seed, step): the batches do not depend on how fast the workers run (a step waits for its
clips instead), so a run is reproducible up to the accelerator's own arithmetic.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from dataclasses import dataclass

import numpy as np

from fastcar_compile.core.errors import FastCarError
from fastcar_compile.demo import condition, scenes

_TOK = None  # each worker's frame tokenizer


def _worker_init(tokenizer_path: str) -> None:
    global _TOK
    import os

    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    from fastcar_compile.demo.vqvae import load_frame_tokenizer

    torch.set_num_threads(1)
    _TOK = load_frame_tokenizer(tokenizer_path)


def _make_chunk(job: tuple[int, int, int, int]) -> np.ndarray:
    """Labelled token sequences [count, prompt + frames x L] (int16) of train clips start .. start + count - 1."""
    start, count, frames, seed = job
    clips = scenes.make_scene_clips("train", count, frames, seed, start=start)
    codes = _TOK.encode(np.stack([c.frames for c in clips]))
    return np.stack([condition.sequence(c.labels, k) for c, k in zip(clips, codes, strict=True)]).astype(np.int16)


@dataclass
class PoolSettings:
    first: int = 4096  # clips generated before step 0 may start
    refresh: float = 16.0  # new clips per step (set near the workers' rate x the step time)
    window: int = 40000  # a step samples from the newest `window` clips available to it
    workers: int = 15
    chunk: int = 32  # clips per worker job
    clip_start: int = 0  # index of the pool's first train clip


class ClipPool:
    """`batch(step)` -> (sequences [batch, prompt + T*L] int64, position gaps [batch]) as `batch_for_step`,
    from clips made by `workers` processes (spawned: the parent may already hold a CUDA context)."""

    def __init__(self, tokenizer_path: str, frames: int, batch: int, seed: int, uncond_prob: float,
                 position_gap: int, tokens_per_frame: int, steps: int, p: PoolSettings) -> None:
        if p.first < batch or p.window < batch:
            raise FastCarError(f"clip pool: first ({p.first}) and window ({p.window}) must hold a batch ({batch})")
        self.frames, self.batch_size, self.seed, self.uncond, self.gap, self.p = (frames, batch, seed, uncond_prob,
                                                                              position_gap, p)
        self.total = int(p.first + p.refresh * steps) + 1
        self.data = np.zeros((self.total, condition.VIDEO_START + frames * tokens_per_frame), np.int16)
        self.ready = 0
        self.wait_s = 0.0
        self.error: BaseException | None = None
        self._cv = threading.Condition()
        self._pool = mp.get_context("spawn").Pool(p.workers, _worker_init, (tokenizer_path,))
        jobs = [(p.clip_start + i, min(p.chunk, self.total - i), frames, seed) for i in range(0, self.total, p.chunk)]
        self._thread = threading.Thread(target=self._fill, args=(jobs,), daemon=True)
        self._thread.start()

    def _fill(self, jobs: list[tuple[int, int, int, int]]) -> None:
        try:
            for (start, count, _, _), seqs in zip(jobs, self._pool.imap(_make_chunk, jobs), strict=True):
                i = start - self.p.clip_start
                self.data[i:i + count] = seqs
                with self._cv:
                    self.ready = i + count
                    self._cv.notify_all()
        except BaseException as e:  # surfaced to the training loop by wait_for
            with self._cv:
                self.error = e
                self._cv.notify_all()

    def wait_for(self, n: int) -> None:
        t = time.time()
        with self._cv:
            while self.ready < n and self.error is None:
                self._cv.wait(1.0)
        if self.error is not None:
            raise FastCarError(f"clip pool worker failed: {self.error!r}")
        self.wait_s += time.time() - t

    def available(self, step: int) -> int:
        return min(self.total, int(self.p.first + self.p.refresh * step))

    def batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        hi = self.available(step)
        self.wait_for(hi)
        rng = np.random.default_rng([self.seed, 11, step])
        idx = rng.integers(max(0, hi - self.p.window), hi, self.batch_size)
        seqs = self.data[idx].astype(np.int64)
        drop = rng.random(self.batch_size) < self.uncond
        seqs[drop, :condition.VIDEO_START] = condition.prompt(None)
        gaps = rng.integers(0, self.gap + 1, self.batch_size) if self.gap else np.zeros(self.batch_size, np.int64)
        return seqs, gaps

    def close(self) -> None:
        self._pool.terminate()
        self._pool.join()
