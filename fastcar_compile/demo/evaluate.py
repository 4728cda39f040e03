"""Dense vs FastCar on held-out clips: the numbers behind `fastcar-compile demo` and `eval`.

PSNR vs ground truth is the mean over clips; FastCar vs dense pools the error of all clips (identical clips
would otherwise give infinities). Two per-token times, each model with one ORT thread and run on its own,
dense and FastCar alternating clip by clip: `FastCarSession.step` wall time (ORT plus the runtime's per-step
Python work) and the bare ORT `run` (what a native driver would pay; per step the fastest of `rounds`
repeats). Averages use `mixture_ms`. Quality is measured on
generated frames 1.. (frame 0 is given), against the dense model's frames and against the ground truth.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fastcar_compile.core.errors import FastCarError
from fastcar_compile.core.progress import bar
from fastcar_compile.demo.decoding import Decoding, clip_seed
from fastcar_compile.demo.export import ONNX, TOKENIZER
from fastcar_compile.demo.metrics import psnr, ssim
from fastcar_compile.demo.spec import VideoSpec
from fastcar_compile.demo.tokenizer import PatchTokenizer
from fastcar_compile.demo.video import VideoRun, generate_video, open_session, ort_alone_ms


@dataclass
class ClipResult:
    motion: str
    source: str
    gt: np.ndarray  # [T, H, W, 3] uint8 ground truth pixels
    dense: VideoRun
    fast: VideoRun
    inf_ort_ms: list[float] = field(default_factory=list)  # bare ORT of the compiled model at tau=+inf
    clip: Any = None  # the held-out clip (scene clips carry labels and the true camera path)
    extra: dict[str, VideoRun] = field(default_factory=dict)  # more videos to show beside dense and FastCar


@dataclass
class Summary:
    """One row of the demo/eval table."""

    tau: float
    tas_query: str
    max_replay: int
    replay_ratio: float
    replay_ceiling: float
    dense_ms: float
    fast_ms: float
    speedup: float
    dense_ort_ms: float
    fast_ort_ms: float
    speedup_ort: float
    inf_ort_ms: float  # the compiled model at tau=+inf (never replays): the graph/attention and replay factors
    speedup_graph_ort: float  # dense / compiled at tau=+inf (the gate's cost here: the export's ops are kept)
    speedup_replay_ort: float  # compiled at tau=+inf / FastCar
    token_agreement: float
    psnr_fast_vs_dense: float
    ssim_fast_vs_dense: float
    psnr_fast_vs_gt: float
    ssim_fast_vs_gt: float
    psnr_dense_vs_gt: float
    ssim_dense_vs_gt: float
    psnr_tokenizer: float
    psnr_hold_vs_gt: float  # baseline: repeat the given frame 0 (tokenized) for every frame
    clips: int
    frames: int
    per_motion: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def compile_bundled(out: Path, tau: float, tas_query: str = "rope", max_replay: int = 0,
                    model: Path = ONNX, frame_tokens: int = 64, diagnostics: bool = False) -> Path:
    """Compile the bundled decoder with the project's compiler into `out` (atomic)."""
    import fastcar_compile

    if not Path(model).exists():
        raise FastCarError(f"bundled decoder {model} is missing; run scripts/export_demo.py")
    # The exported attention and ops are kept (fused_attention=None, fusions=False), as in the dense decoder it
    # is compared with, so the demo's speed and quality figures are FastCar's alone.
    fastcar_compile.compile(str(model), output=str(out), frame_tokens=frame_tokens, threshold=float(tau),
                            tas_query=tas_query, max_replay=max_replay, emit_diagnostics=diagnostics,
                            fused_attention=None, fusions=False)
    return out


def _mean_finite(xs: list[float], cap: float = 100.0) -> float:
    return float(np.mean([min(x, cap) for x in xs])) if xs else float("nan")


def dense_tas(spec: VideoSpec, dense: Path, clips: list, tok, decoding: Decoding, out: Path,
              tas_query: str = "rope", threads: int = 1, seed: int = 0) -> np.ndarray:
    """TAS [steps, layers] along the dense videos of `clips` (clip i sampled with `clip_seed(seed, i)`): a
    never-replaying compile (tau = +inf, diagnostics on, written to `out`) generates the dense video, so the
    quantiles of these values are the thresholds that replay a given share of its decode-step MLPs."""
    uncond = spec.uncond if decoding.cfg_scale is not None else None
    diag = compile_bundled(out, float("inf"), tas_query, 0, model=dense, diagnostics=True,
                           frame_tokens=tok.tokens_per_frame)
    sess = open_session(diag, threads)
    return np.concatenate([generate_video(sess, spec.prompt(c), tok.encode(c.frames)[0], len(c.frames) - 1,
                                          threshold=float("inf"), decoding=decoding, seed=clip_seed(seed, i),
                                          uncond_ids=uncond, codes=spec.codes).tas for i, c in enumerate(clips)])


def run_clips(spec: VideoSpec, dense_path: Path, fast_path: Path, clips: list, tok, tau: float,
              threads: int = 1, progress: bool = True, rounds: int = 2, decoding: Decoding | None = None,
              seed: int = 0) -> list[ClipResult]:
    """Generate every clip with both models, then time each model on its own (see `ort_alone_ms`):
    `rounds` rotations of dense, the compiled model at tau=+inf (on the dense tokens, which it generates) and
    FastCar per clip, the order rotating from clip to clip (0: no bare-ORT timing; only the runtime step times
    of the generation itself). Decoding: `decoding` (default the model's recommended one); clip i is sampled
    with seed `clip_seed(seed, i)` by both models, so their videos differ only where replay changed logits."""
    decoding = spec.decoding if decoding is None else decoding
    uncond = spec.uncond if decoding.cfg_scale is not None else None
    dense = open_session(dense_path, threads)
    fast = open_session(fast_path, threads)
    out = []
    for i, c in enumerate(bar(clips, desc=f"clips tau={tau:g}", enabled=progress, leave=False)):
        toks = tok.encode(c.frames)
        pre = spec.prompt(c)
        order = [0, 1] if i % 2 == 0 else [1, 0]
        runs: dict[int, VideoRun] = {}
        for j in order:
            runs[j] = generate_video((dense, fast)[j], pre, toks[0], len(c.frames) - 1, threshold=tau if j else None,
                                     decoding=decoding, seed=clip_seed(seed, i), uncond_ids=uncond, codes=spec.codes)
        d, f = runs[0], runs[1]
        seqs = tuple(np.stack([np.concatenate([p, r.tokens.reshape(-1)]) for p in ([pre] + ([uncond] if uncond else []))])
                     for r in (d, f))
        # (session, sequence, tau): dense, the compiled model at tau=+inf on the dense tokens, FastCar
        timed = ((dense, seqs[0], None), (fast, seqs[0], float("inf")), (fast, seqs[1], tau))
        ort: tuple[list, list, list] = ([], [], [])
        for _ in range(rounds):
            for j in [(i + k) % 3 for k in range(3)]:  # each model first in turn
                sess, seq, thr = timed[j]
                ort[j].append(ort_alone_ms(sess, seq, len(pre) + tok.tokens_per_frame, thr, spec.video_start))
        inf_ms: list[float] = []
        if rounds:  # per step: the fastest of the rounds (noise only ever adds time)
            d.ort_ms, inf_ms, f.ort_ms = (list(np.min(np.array(t), axis=0)) for t in ort)
        out.append(ClipResult(spec.motion(c), c.source, c.frames, d, f, inf_ms, clip=c))
    return out


def mixture_ms(times: list[np.ndarray], replay: list[np.ndarray]) -> float:
    """Mean per-token time, robust to machine noise: steps grouped by how many layers replayed, the median
    of each group weighted by the group's share. (A plain median would report the replayed-step time once
    more than half the steps replay; a plain mean is dominated by spikes on a shared machine.)"""
    t = np.concatenate([np.asarray(x, np.float64) for x in times])
    if not t.size:
        return float("nan")
    groups = np.concatenate([r.sum(axis=1) if r.ndim == 2 and r.shape[1] else np.zeros(len(r)) for r in replay])
    groups = groups[: len(t)]
    return float(sum((groups == g).mean() * np.median(t[groups == g]) for g in np.unique(groups)))


def summarize(results: list[ClipResult], tok: PatchTokenizer, tau: float, tas_query: str,
              max_replay: int) -> Summary:
    pf_g, sf_g, pd_g, sd_g, ptok, agree, hold, sf_d = [], [], [], [], [], [], [], []
    all_d, all_f = [], []
    rep, ceil = [], []
    by_motion: dict[str, list[float]] = {}
    for r in results:
        gt = r.gt[1:]
        dv = tok.decode(r.dense.tokens)[1:]
        fv = tok.decode(r.fast.tokens)[1:]
        all_d.append(dv)
        all_f.append(fv)
        sf_d.append(ssim(dv, fv))
        hold.append(psnr(gt, np.repeat(tok.decode(r.dense.tokens[:1]), len(gt), axis=0)))
        pf_g.append(psnr(gt, fv))
        sf_g.append(ssim(gt, fv))
        pd_g.append(psnr(gt, dv))
        sd_g.append(ssim(gt, dv))
        ptok.append(psnr(gt, tok.decode(tok.encode(r.gt))[1:]))
        agree.append(float((r.dense.tokens[1:] == r.fast.tokens[1:]).mean()))
        rep.append(r.fast.replay_ratio)
        steps = len(r.fast.step_ms)
        ceil.append(1.0 if steps else 0.0)  # frame 0 is context: every decode step is eligible
        by_motion.setdefault(r.motion, []).append(pf_g[-1] - pd_g[-1])
    d_rep = [np.zeros((len(r.dense.step_ms), 0), bool) for r in results]
    f_rep = [r.fast.replay for r in results]
    dense_ms, fast_ms = mixture_ms([r.dense.step_ms for r in results], d_rep), \
        mixture_ms([r.fast.step_ms for r in results], f_rep)
    dense_ort = mixture_ms([r.dense.ort_ms for r in results], d_rep)
    fast_ort = mixture_ms([r.fast.ort_ms for r in results], f_rep)
    inf_ort = mixture_ms([r.inf_ort_ms for r in results], d_rep)
    frames = int(results[0].gt.shape[0]) if results else 0
    return Summary(tau=float(tau), tas_query=tas_query, max_replay=max_replay, replay_ratio=float(np.mean(rep)),
                   replay_ceiling=float(np.mean(ceil)), dense_ms=dense_ms, fast_ms=fast_ms,
                   speedup=dense_ms / fast_ms if fast_ms else float("nan"), dense_ort_ms=dense_ort,
                   fast_ort_ms=fast_ort, speedup_ort=dense_ort / fast_ort if fast_ort else float("nan"),
                   inf_ort_ms=inf_ort, speedup_graph_ort=dense_ort / inf_ort if inf_ort else float("nan"),
                   speedup_replay_ort=inf_ort / fast_ort if fast_ort else float("nan"),
                   token_agreement=float(np.mean(agree)),
                   psnr_fast_vs_dense=psnr(np.concatenate(all_d), np.concatenate(all_f)) if all_d else float("nan"),
                   ssim_fast_vs_dense=float(np.mean(sf_d)), psnr_fast_vs_gt=_mean_finite(pf_g),
                   ssim_fast_vs_gt=float(np.mean(sf_g)), psnr_dense_vs_gt=_mean_finite(pd_g),
                   ssim_dense_vs_gt=float(np.mean(sd_g)), psnr_tokenizer=_mean_finite(ptok),
                   psnr_hold_vs_gt=_mean_finite(hold),
                   clips=len(results), frames=frames,
                   per_motion={k: float(np.mean(v)) for k, v in sorted(by_motion.items())})


def load_tokenizer(path: Path = TOKENIZER) -> PatchTokenizer:
    return PatchTokenizer.load(path)

