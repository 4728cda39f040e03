"""The video decode loop: prefill, then one token per step for `num_frames x L` tokens, with statistics.

Every call starts from fresh state (the published FastCar code never resets its caches, so a second video
replays the first one's last frame). With classifier-free guidance the batch holds conditional rows then
unconditional rows; both get the same token and each row decides replay for itself.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from fastcar_compile.core import contract
from fastcar_compile.core.errors import FastCarError
from fastcar_compile.core.limits import check_finite, check_int
from fastcar_compile.runtime.sampling import Sampler, guide
from fastcar_compile.runtime.speculate import (
    DraftLength,
    DraftSpec,
    parse_draft,
    previous_frame_draws,
    propose,
    verify,
)
from fastcar_compile.runtime.stats import RunStats
from fastcar_compile.runtime.tokens import check_token_ids


class StepModel(Protocol):
    """What `generate` needs of a model: `FastCarSession` (runtime.session, which imports this module to
    offer `session.generate`; hence a protocol here, not an import back)."""

    path: Path
    frame_tokens: int | None
    is_fastcar: bool
    has_diagnostics: bool
    layers: list[int]
    default_threshold: Any
    native_library: str | None

    def new_state(self, batch: int, video_start: int = 0) -> Any: ...
    def step(self, state: Any, input_ids: np.ndarray, **kwargs: Any) -> Any: ...
    def state_nbytes(self, batch: int = 1) -> dict[str, int]: ...
    def describe_memory(self, batch: int = 1, tokens: int | None = None) -> str: ...
    def threshold_array(self, threshold: Any) -> np.ndarray: ...
    def speculation_refusal(self) -> str | None: ...
    def snapshot(self, state: Any, seq: int) -> Any: ...
    def rewind(self, state: Any, past_len: int, snapshot: Any = None) -> Any: ...
    def check_video_length(self, tokens: int, what: str = ...) -> None: ...
    def check_memory(self, batch: int, what: str, fix: str, tokens: int = 0) -> None: ...


FrameCallback = Callable[[int, np.ndarray], "bool | None"]
AUTO_PROGRESS_TOKENS = 1024


@dataclass
class GenerationResult:
    """Video tokens ([rows, n], n = frames_done x L unless interrupted mid-frame), statistics, and
    (when asked with `keep_logits`) the guided logits each token was chosen from."""

    tokens: np.ndarray
    stats: RunStats
    logits: np.ndarray | None = None  # [rows, n, vocab] float32

    def complete(self) -> GenerationResult:
        """This result, or KeyboardInterrupt again when Ctrl-C cut the run short: for callers whose figures a
        partial run would corrupt (eval, calibration), where Ctrl-C must stop the whole command."""
        if self.stats.interrupted:
            raise KeyboardInterrupt
        return self

    def frames(self) -> np.ndarray:
        """Complete frames as [rows, frames, L]."""
        L = self.stats.frame_tokens
        n = self.tokens.shape[1] // L
        return self.tokens[:, : n * L].reshape(self.tokens.shape[0], n, L)


def left_pad(rows: Sequence[Sequence[int]], pad_token_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Left-pad prompts of different lengths: ids and attention mask, both [rows, max_len] int64.

    Left padding keeps every row's video at the same KV index, which `video_start` and the slot rule need.
    """
    n = max(len(r) for r in rows)
    ids = np.full((len(rows), n), pad_token_id, dtype=np.int64)
    mask = np.zeros((len(rows), n), dtype=np.int64)
    for i, r in enumerate(rows):
        if len(r):
            ids[i, n - len(r):] = np.asarray(r, dtype=np.int64)
            mask[i, n - len(r):] = 1
    return ids, mask


def _as_rows(prompt_ids: Any, what: str, vocab: int | None = None) -> list[list[int]]:
    if isinstance(prompt_ids, np.ndarray):
        if prompt_ids.ndim == 1:
            prompt_ids = prompt_ids[None]
        if prompt_ids.ndim != 2:
            raise FastCarError(f"{what} must be 1-D or 2-D token ids, got shape {list(prompt_ids.shape)}")
        if prompt_ids.size == 0:
            raise FastCarError(f"{what} is empty (shape {list(prompt_ids.shape)}); give at least one token per row")
        check_token_ids(prompt_ids, vocab, what)
        return [list(map(int, r)) for r in prompt_ids]
    try:
        rows = list(prompt_ids)
    except TypeError:
        raise FastCarError(f"{what} must be token ids (a list of rows or an array), got "
                           f"{type(prompt_ids).__name__}") from None
    if rows and not isinstance(rows[0], (list, tuple, np.ndarray)):
        rows = [rows]
    for r in rows:
        if not isinstance(r, (list, tuple, np.ndarray)):
            raise FastCarError(f"{what}: every row must be a list of token ids, got {type(r).__name__}")
        if len(r):
            check_token_ids(np.asarray(r, dtype=object) if any(isinstance(x, float | bool) for x in r) else r,
                            vocab, what)
    rows = [list(map(int, r)) for r in rows]
    if not rows or all(len(r) == 0 for r in rows):
        raise FastCarError(f"{what} is empty; give at least one token per row")
    if any(len(r) == 0 for r in rows):
        raise FastCarError(f"{what}: every row needs at least one token")
    return rows


def _processed(logits_processor: Callable[[np.ndarray], np.ndarray], g: np.ndarray, n: int) -> np.ndarray:
    """The processor's logits, refused when they cannot choose a token: NaN, +inf, another shape, or a row with
    no finite value (greedy argmax would pick token 0 silently)."""
    try:
        out = np.asarray(logits_processor(g), dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise FastCarError(f"logits_processor returned no numeric array for token {n}: {exc}") from None
    if out.shape != g.shape:
        raise FastCarError(f"logits_processor returned shape {list(out.shape)} for token {n}; it must keep the "
                           f"shape of its input {list(g.shape)}")
    if np.isnan(out).any() or np.isposinf(out).any():
        raise FastCarError(f"logits_processor returned {'NaN' if np.isnan(out).any() else '+inf'} for token {n}; "
                           "mask tokens with -inf instead")
    if not np.isfinite(out).any(axis=-1).all():
        raise FastCarError(f"logits_processor masked every token of a row (all -inf) for token {n}")
    return out


def _warn_threshold(stats: RunStats) -> bool:
    """Warn (once per run) when tau replays all or nothing of the first eligible frame; True once judged."""
    if stats.eligible_steps().sum() < max(1, stats.frame_tokens // 2):
        return False
    msg = stats.threshold_warning()
    if msg:
        warnings.warn(msg, ThresholdWarning, stacklevel=_caller_level())
    return True


def _caller_level() -> int:
    """stacklevel of the first frame outside this package, so the warning names the user's line."""
    import sys

    level, f = 1, sys._getframe(1)
    while f is not None and str(f.f_globals.get("__name__", "")).startswith("fastcar_compile"):
        level, f = level + 1, f.f_back
    return level


class ThresholdWarning(UserWarning):
    """tau replays every eligible MLP or none: off the model's TAS scale."""


def generate(session: StepModel, prompt_ids: Any, num_frames: int, *, frame_tokens: int | None = None,
             threshold: float | Sequence[float] | None = None, do_sample: bool = False, temperature: float = 1.0,
             top_k: int = 0, top_p: float = 1.0, seed: int = 0, cfg_scale: float | None = None,
             uncond_prompt_ids: Any = None, pad_token_id: int = 0, callback: FrameCallback | None = None,
             progress: bool | None = None, collect_tas: bool = False, keep_logits: bool = False,
             trace: str | None = None, given_video_tokens: int = 0,
             logits_processor: Callable[[np.ndarray], np.ndarray] | None = None, draft: str | None = None,
             draft_tokens: int | None = None) -> GenerationResult:
    """Generate `num_frames` frames of `L` tokens for each prompt row, from fresh state.

    threshold: tau for this run (None: the model's baked default; float('inf') turns replay off).
    cfg_scale + uncond_prompt_ids: classifier-free guidance, logits u + s (c - u), one unconditional
    prompt per conditional one. callback(frame_index, tokens[rows, L]) after each frame; return False to
    stop. Ctrl-C stops too; both return what was generated so far. `trace`: also save run.json there.
    given_video_tokens: the last k tokens of every prompt are already video (e.g. a conditioning frame 0),
    so `video_start` sits before them and the first generated frame may replay at once.
    logits_processor(logits[rows, vocab]) -> logits, applied after guidance (e.g. mask special tokens).
    draft: speculative decoding ("temporal": the token one frame back; "ngram"; "temporal+ngram"), each draft
    verified in one multi-token step, the output the model's own (greedy: identical tokens; sampling: the same
    distribution; runtime/speculate.py). draft_tokens: K per step (default adaptive). On a FastCar model each
    token of a verify step decides replay as its own step would (K < L), and rejected tokens' MLP cache rows and
    ages are restored.
    """
    L = _frame_size(session, frame_tokens, num_frames, trace)
    if threshold is not None and not session.is_fastcar:
        raise FastCarError("threshold given but this is a dense model (no FastCar replay); drop it")
    thr = None if threshold is None else session.threshold_array(threshold)  # type/NaN checks first
    if collect_tas and not session.has_diagnostics:
        raise FastCarError("collect_tas needs a model compiled with --emit-diagnostics (tas.N outputs)")
    seed = check_int("seed", seed, 0, 2**64 - 1, "of the sampler's random generator")
    if cfg_scale is not None:
        cfg_scale = check_finite("cfg_scale", cfg_scale, "classifier-free guidance scale")
    sampler = Sampler(do_sample, temperature, top_k, top_p)
    spec = parse_draft(draft, draft_tokens)
    if spec is not None and (why := session.speculation_refusal()) is not None:
        raise FastCarError(why)
    cond, rows = _prompt_rows(prompt_ids, uncond_prompt_ids, cfg_scale, getattr(session, "vocab", None))
    ids, mask = left_pad(rows, pad_token_id)
    video_start = _video_start(session, rows, ids.shape[1], given_video_tokens, num_frames, L)
    stats = _new_stats(session, L, len(rows), video_start, num_frames, given_video_tokens, threshold, cfg_scale)
    if collect_tas:
        stats.tas = []
    run = _Run(session, stats, np.zeros((len(cond), num_frames * L), dtype=np.int64), thr, sampler,
               np.random.default_rng(seed), cfg_scale, len(rows), callback, logits_processor,
               [] if keep_logits else None, collect_tas)
    state = run.go(ids, mask, video_start, progress, spec, cond, given_video_tokens)
    stats.finalize()
    if stats.kv_diagnostics and state is not None:
        stats.add_kv_bytes(state.arrays, state.past_len)
    kept = np.stack(run.logit_rows, axis=1) if run.logit_rows else None
    result = GenerationResult(run.tokens[:, :run.n], stats, kept)
    if trace:
        stats.save(trace)
    return result


def _frame_size(session: StepModel, frame_tokens: int | None, num_frames: Any, trace: str | None) -> int:
    """L (the model's, or frame_tokens for a dense model), refusing another L, a bad frame count and an unwritable
    trace path before anything is generated (a bad path must not cost the generated tokens)."""
    L = int(frame_tokens or session.frame_tokens or 0)
    if session.frame_tokens and frame_tokens and frame_tokens != session.frame_tokens:
        raise FastCarError(f"frame_tokens={frame_tokens} but the model was compiled for L={session.frame_tokens}")
    if L <= 0:
        raise FastCarError("frame size unknown: pass frame_tokens=L (a dense model has no fastcar metadata)")
    if isinstance(num_frames, bool) or not isinstance(num_frames, int | np.integer) or not 1 <= num_frames <= 2**31:
        raise FastCarError(f"num_frames must be a whole number of frames >= 1, got {num_frames!r}")
    if trace is not None:
        from fastcar_compile.core.fileio import check_output_path

        check_output_path(trace, "trace")
    return L


def _prompt_rows(prompt_ids: Any, uncond_prompt_ids: Any, cfg_scale: float | None, vocab: int | None
                 ) -> tuple[list[list[int]], list[list[int]]]:
    """(the conditional prompts, every row of the batch): with guidance the unconditional ones follow, one each."""
    cond = _as_rows(prompt_ids, "prompt_ids", vocab)
    if cfg_scale is None:
        if uncond_prompt_ids is not None:
            raise FastCarError("uncond_prompt_ids given without cfg_scale")
        return cond, cond
    if uncond_prompt_ids is None:
        raise FastCarError("cfg_scale needs uncond_prompt_ids (one unconditional prompt per row)")
    uncond = _as_rows(uncond_prompt_ids, "uncond_prompt_ids", vocab)
    if len(uncond) != len(cond):
        raise FastCarError(f"{len(cond)} conditional prompts but {len(uncond)} unconditional ones")
    return cond, cond + uncond


def _video_start(session: StepModel, rows: list[list[int]], padded: int, given_video_tokens: int, num_frames: int,
                 L: int) -> int:
    """The KV index of the first video token (the given ones' included), refusing a video longer than the model's
    tables or this machine's memory before the first step."""
    if not 0 <= given_video_tokens <= min(len(r) for r in rows):
        raise FastCarError(f"given_video_tokens={given_video_tokens} must be in [0, shortest prompt length]")
    total = num_frames * L
    session.check_video_length(padded + total - 1)  # (the last token is sampled, never fed)
    session.check_memory(len(rows), f"{num_frames} frames of {L} tokens for {len(rows)} row(s) after a "
                         f"{padded}-token prompt", "generate fewer frames or rows", tokens=padded + total - 1)
    return padded - given_video_tokens


def _new_stats(session: StepModel, L: int, batch: int, video_start: int, num_frames: int, given_video_tokens: int,
               threshold: Any, cfg_scale: float | None) -> RunStats:
    mem = session.state_nbytes(batch)
    return RunStats(model=str(session.path), fastcar=session.is_fastcar, frame_tokens=L,
                    layers=list(session.layers), batch=batch, video_start=video_start, num_frames=num_frames,
                    given_video_tokens=given_video_tokens,
                    threshold=(float(threshold) if np.ndim(threshold) == 0 else list(map(float, threshold)))
                    if threshold is not None else session.default_threshold,
                    cfg_scale=cfg_scale, state_bytes=mem["fastcar_state"],
                    kv_bytes_per_token=mem["kv_per_token"], native_ops=session.native_library is not None)


@dataclass
class _Run:
    """One generate call's decoding: what each step needs besides the state, and the tokens so far (`n`)."""

    session: StepModel
    stats: RunStats
    tokens: np.ndarray  # [conditional rows, frames x L]
    thr: np.ndarray | None
    sampler: Sampler
    rng: np.random.Generator
    cfg_scale: float | None
    batch: int
    callback: FrameCallback | None
    logits_processor: Callable[[np.ndarray], np.ndarray] | None
    logit_rows: list[np.ndarray] | None  # the guided logits of each token (keep_logits), else None
    collect_tas: bool
    n: int = 0
    bar: Any = None

    @property
    def cfg(self) -> bool:
        return self.cfg_scale is not None

    def guided(self, last: np.ndarray, n: int) -> np.ndarray:
        """The logits token n is chosen from ([rows, vocab] float64): guidance, then the processor."""
        n_out = self.tokens.shape[0]
        g = guide(last[:n_out], last[n_out:], self.cfg_scale) if self.cfg else last.astype(np.float64)
        if np.isnan(g).any():
            raise FastCarError(f"the model's logits for token {n} contain NaN ({self.session.path.name}); its "
                               "weights or inputs hold NaN or overflow, so no token can be chosen")
        if self.logits_processor is not None:
            g = _processed(self.logits_processor, g, n)
        return g

    def choose(self, logits: np.ndarray) -> np.ndarray:
        """Token n (= self.n) of every row, from a step's last logits."""
        g = self.guided(logits[:, -1, :], self.n)
        if self.logit_rows is not None:
            self.logit_rows.append(g.astype(np.float32))
        return self.sampler(g, self.rng)

    def go(self, ids: np.ndarray, mask: np.ndarray, video_start: int, progress: bool | None, spec: DraftSpec | None,
           prompts: list[list[int]], given_video_tokens: int) -> Any:
        """Prefill, then the decode loop (with drafts: _speculate) until every frame is done, the callback stops
        it or Ctrl-C does; returns the state after the prefill (or the last decode step), None when none."""
        total = self.tokens.shape[1]
        show = progress if progress is not None else total >= AUTO_PROGRESS_TOKENS
        from fastcar_compile.core.progress import bar as progress_bar

        self.bar = progress_bar(total=total, unit="tok", desc=self.session.path.name, enabled=show, leave=False)
        if show:  # long run: say up front what it will hold in memory
            self.bar.write(self.session.describe_memory(self.batch, video_start + total))
        state = None
        try:
            state = self.session.new_state(self.batch, video_start=video_start)
            t0 = time.perf_counter()
            out = self.session.step(state, ids, attention_mask=mask, threshold=self.thr)
            self.stats.prefill_ms = 1e3 * (time.perf_counter() - t0)
            self.stats.add_kv_stats(out.extra)
            self.tokens[:, 0] = self.choose(out.logits)
            self.n = 1
            self.bar.update(1)
            state = out.state
            if spec is not None:
                self.n = _speculate(self, state, spec, [np.asarray(r, np.int64) for r in prompts], given_video_tokens,
                                    out.logits)
            else:
                state = self.decode(state)
        except KeyboardInterrupt:
            self.stats.interrupted = True
        finally:
            self.bar.close()
        return state

    def decode(self, state: Any) -> Any:
        """One token per step until the last frame is done or the callback returns False; the last state."""
        L, total, stats = self.stats.frame_tokens, self.tokens.shape[1], self.stats
        frame_ms = 0.0
        warned = False
        one = np.ones((self.batch, 1), np.int64)
        while self.n <= total:
            n = self.n
            if n % L == 0:  # a frame is complete
                f = n // L - 1
                if not warned and stats.steps:
                    warned = _warn_threshold(stats)
                stats.frame_ms.append(frame_ms)
                frame_ms = 0.0
                stats.frames_done = f + 1
                if self.callback is not None and self.callback(f, self.tokens[:, f * L: n].copy()) is False:
                    break
            if n == total:
                break
            fed = self.tokens[:, n - 1]
            feed = np.concatenate([fed, fed]) if self.cfg else fed
            pos = state.past_len
            t0 = time.perf_counter()
            out = self.session.step(state, feed[:, None], attention_mask=one, threshold=self.thr, check=False)
            dt = 1e3 * (time.perf_counter() - t0)
            self.tokens[:, n] = self.choose(out.logits)
            state = out.state
            stats.step_ms.append(dt)
            frame_ms += dt
            rep = out.replay.astype(int).tolist() if out.replay is not None else []
            stats.steps.append({"pos": int(pos), "replay": rep})
            stats.add_kv_stats(out.extra)
            if self.collect_tas and out.tas is not None:
                stats.tas.append(out.tas[:, :, 0].tolist())
            self.n = n + 1
            self.bar.update(1)
        return state


def _speculate(run: _Run, state: Any, spec: DraftSpec, prompts: list[np.ndarray], given_video_tokens: int,
               prefill_logits: np.ndarray) -> int:
    """The decode loop with drafts (runtime/speculate.py): each step feeds the last kept token and k draft
    tokens, keeps what the model accepts plus its own next token, and rewinds the KV cache to them. Returns the
    number of tokens generated. Each kept token is a trace step at its KV index, with its share of the step's
    time (and, on a FastCar model, its replay per layer and row); frames are reported to `callback` in order, and a
    False return drops the tokens after that frame. On a FastCar model a verify step holds at most L tokens (each
    token's slot written once, its decision that of a single-token step) and the FastCar state rows it writes are
    copied before it, so a rejection restores them (session.snapshot / rewind)."""
    session, tokens, n, thr, guided, sampler, rng, stats, bar = (run.session, run.tokens, run.n, run.thr, run.guided,
                                                                 run.sampler, run.rng, run.stats, run.bar)
    callback, logit_rows, batch, cfg = run.callback, run.logit_rows, run.batch, run.cfg
    n_out, total = tokens.shape
    L = stats.frame_tokens
    length = DraftLength(spec.tokens)
    stats.draft = str(spec)
    fastcar = bool(session.layers)
    max_k = L - 1 if fastcar else total  # FastCar: a verify step of at most one frame (docs/DESIGN.md "Semantics")
    frame_ms = np.zeros(max(1, -(-total // L)))
    # each row's real tokens: prompt (unpadded), then the video as it is kept (the draft's source)
    hist = [np.concatenate([p, np.zeros(total, np.int64)]) for p in prompts]
    for r, p in enumerate(prompts):
        hist[r][len(p)] = tokens[r, 0]
    reported = 0
    # sampled temporal drafts: the model's own distribution one frame back (slot = position mod L) where it is
    # known, so a token is accepted with probability 1 - TV(p, q) rather than p(previous token)
    # sampled temporal drafts: the model's own distribution one frame back where it is known (slot = video index
    # mod L): kept for every generated token, and for a given frame 0 and the first token read from the prefill
    # (its logits predict each of them), so a token is accepted with probability 1 - TV(p, q) rather than p(previous token)
    g = given_video_tokens
    ring = ring_pos = None
    if sampler.do_sample and spec.kind != contract.DRAFT_NGRAM:
        ring_pos = np.full(L, -1, np.int64)
        padded = prefill_logits.shape[1]
        for v in range(max(0, g + 1 - L), g + 1):  # (v = g: the first generated token, chosen from the last)
            at = padded - g - 1 + v  # the prompt position whose logits predict video token v
            if at >= 0:
                if ring is None:
                    ring = np.zeros((n_out, L, prefill_logits.shape[-1]), np.float32)
                ring[:, v % L], ring_pos[v % L] = sampler.probs(guided(prefill_logits[:, at, :], 0)), v
    try:
        while True:
            while reported < n // L:  # frames completed, one callback each, in order
                f = reported
                stats.frame_ms.append(float(frame_ms[f]))
                stats.frames_done = reported = f + 1
                if callback is not None and callback(f, tokens[:, f * L:(f + 1) * L].copy()) is False:
                    return (f + 1) * L
            if n >= total:
                return n
            k = min(length.k, total - 1 - n, max_k)  # the step's own token covers the last position
            views = [h[: len(p) + n] for h, p in zip(hist, prompts, strict=True)]
            draft = propose(spec, views, given_video_tokens + n, L, k) if k else np.zeros((n_out, 0), np.int64)
            k = draft.shape[1]
            q = None if ring is None else previous_frame_draws(draft, ring, ring_pos, g + n, rng)
            feed = np.concatenate([tokens[:, n - 1: n], draft], axis=1)
            if cfg:  # both rows of a pair verify the same draft; the guided logits decide
                feed = np.concatenate([feed, feed])
            pos = state.past_len
            t0 = time.perf_counter()
            snap = session.snapshot(state, k + 1) if fastcar else None
            out = session.step(state, feed, attention_mask=np.ones((batch, k + 1), np.int64), threshold=thr,
                               check=False)
            logits, seen = out.logits, []

            def position(i: int, logits=logits, seen=seen, n=n) -> np.ndarray:
                seen.append(guided(logits[:, i, :], n + i))
                return seen[-1]

            kept, a, dists = verify(draft, position, sampler, rng, q)
            state = session.rewind(out.state, pos + a + 1, snap)
            dt = 1e3 * (time.perf_counter() - t0)
            m = a + 1
            tokens[:, n: n + m] = kept
            for r, p in enumerate(prompts):
                hist[r][len(p) + n: len(p) + n + m] = kept[r]
            if logit_rows is not None:
                logit_rows.extend(g.astype(np.float32) for g in seen[:m])
            if ring_pos is not None:
                if ring is None:
                    ring = np.zeros((n_out, L, dists[0].shape[-1]), np.float32)
                for j in range(m):
                    ring[:, (g + n + j) % L], ring_pos[(g + n + j) % L] = dists[j], g + n + j
            rep = out.replay if out.replay is None or out.replay.ndim == 3 else out.replay[:, :, None]
            for j in range(m):
                stats.step_ms.append(dt / m)
                stats.steps.append({"pos": int(pos + j), "replay": [] if rep is None else rep[:, :, j].astype(int).tolist()})
                frame_ms[(n + j) // L] += dt / m
            stats.verify_steps += 1
            stats.draft_proposed += k
            stats.draft_accepted += a
            length.update(k, a)
            n += m
            bar.update(m)
    except KeyboardInterrupt:
        stats.interrupted = True
        return n
