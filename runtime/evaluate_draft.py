"""`fastcar-compile eval --model model.onnx --prompts p.npy --draft temporal:K`: speculative decoding against
plain decoding of the same model (dense, or FastCar-compiled at its tau), greedy, in the same run.

Every prompt batch is generated plainly and with the draft (the order rotating from batch to batch, so machine
load hits all alike); the figures are decode milliseconds per token (generate's wall time minus its prefill, over
the tokens decoded), their ratio, the share of draft tokens accepted and the tokens per verify step, and the share
of tokens equal to plain greedy decoding of the same model, which is 100% by construction (runtime/speculate.py)
and is measured, not assumed. A FastCar --model with `--dense` also runs the dense model plainly and with the
draft, so FastCar + draft is compared with the better of FastCar alone and the draft alone. Writes plain.json and
draft.json (runtime traces; dense.json and dense_draft.json with --dense) and eval.json.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import numpy as np

from fastcar_compile.core.errors import FastCarError
from fastcar_compile.core.fileio import check_output_dir, check_outputs, model_reads, staged_dir

OUTPUTS = ("plain.json", "draft.json", "eval.json")
DENSE_OUTPUTS = ("dense.json", "dense_draft.json")  # with --dense (a FastCar --model)


def evaluate_draft(model_path: str | os.PathLike, prompts: np.ndarray, out_dir: str | os.PathLike, draft: str, *,
                   frame_tokens: int | None = None, frames: int = 4, batch: int = 1, threads: int = 2,
                   given_video_tokens: int = 0, progress: bool = True,
                   dense_path: str | os.PathLike | None = None) -> dict[str, Any]:
    """Plain vs draft decoding of `model_path` on `prompts` (and of `dense_path`, the dense model a FastCar
    `model_path` was compiled from, when given); returns eval.json's dict."""
    from fastcar_compile.core.progress import bar
    from fastcar_compile.runtime.session import FastCarSession
    from fastcar_compile.runtime.speculate import parse_draft
    from fastcar_compile.runtime.stats import RunStats

    spec = parse_draft(draft)
    out = check_output_dir(out_dir, "--out")
    names = OUTPUTS + (DENSE_OUTPUTS if dense_path is not None else ())
    reads = model_reads(model_path, "--model") | (model_reads(dense_path, "--dense") if dense_path else {})
    check_outputs({out / name: f"--out's {name}" for name in names}, reads)
    if batch < 1 or len(prompts) % batch:
        raise FastCarError(f"--batch {batch} must divide the number of prompts ({len(prompts)})")
    sess = FastCarSession(model_path, frame_tokens=frame_tokens, threads=threads)
    if (why := sess.speculation_refusal()) is not None:
        raise FastCarError(why)
    if sess.frame_tokens is None:
        raise FastCarError("--draft needs the frame size: give --frame-shape HxW (H x W tokens per frame)")
    sessions = {"plain": sess, "draft": sess}
    if dense_path is not None:
        if not sess.is_fastcar:
            raise FastCarError("--draft runs on --model (a dense export) against itself; drop --dense")
        dense = FastCarSession(dense_path, frame_tokens=sess.frame_tokens, threads=threads)
        if dense.is_fastcar:
            raise FastCarError(f"--dense {dense_path} is FastCar-compiled; give the dense export it was compiled from")
        sessions.update(dense=dense, dense_draft=dense)
    kw = dict(given_video_tokens=given_video_tokens, progress=False)
    stats: dict[str, list] = {k: [] for k in sessions}
    secs = dict.fromkeys(sessions, 0.0)
    same: dict[str, list] = {"draft": [], "dense_draft": []}
    chunks = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    order = list(sessions)
    for i, chunk in enumerate(bar(chunks, desc=f"plain vs draft {spec}", unit="batch", enabled=progress)):
        res = {}
        for which in order[i % len(order):] + order[: i % len(order)]:
            t0 = time.perf_counter()
            res[which] = sessions[which].generate(chunk, frames, draft=spec if which.endswith("draft") else None,
                                                  **kw).complete()
            secs[which] += time.perf_counter() - t0 - res[which].stats.prefill_ms / 1e3
            stats[which].append(res[which].stats)
        same["draft"].append(res["plain"].tokens == res["draft"].tokens)
        if "dense" in res:
            same["dense_draft"].append(res["dense"].tokens == res["dense_draft"].tokens)
    merged = {k: RunStats.merge(v) for k, v in stats.items()}
    decoded = {k: len(m.steps) for k, m in merged.items()}  # tokens decoded after each prefill
    ms = {k: 1e3 * secs[k] / max(decoded[k], 1) for k in secs}
    d = merged["draft"]
    result = {
        "model": str(model_path), "draft": str(spec), "prompts": int(len(prompts)), "frames": frames,
        "frame_tokens": sess.frame_tokens, "batch": batch, "threads": threads,
        "plain_ms_per_token": ms["plain"], "draft_ms_per_token": ms["draft"],
        "speedup": ms["plain"] / ms["draft"] if ms["draft"] else None,
        "acceptance": d.acceptance, "tokens_per_step": d.tokens_per_step, "verify_steps": d.verify_steps,
        "token_agreement": float(np.mean(np.concatenate([s.ravel() for s in same["draft"]]))),
        "files": [str(out / name) for name in names],
    }
    if sess.is_fastcar:
        result.update(replay_plain=merged["plain"].replay_ratio, replay_draft=d.replay_ratio)
    if dense_path is not None:
        best = min(ms["plain"], ms["dense_draft"])  # the faster of FastCar alone and the draft alone
        result.update(dense=str(dense_path), dense_ms_per_token=ms["dense"], dense_draft_ms_per_token=ms["dense_draft"],
                      dense_acceptance=merged["dense_draft"].acceptance,
                      dense_token_agreement=float(np.mean(np.concatenate([s.ravel() for s in same["dense_draft"]]))),
                      speedup_vs_dense=ms["dense"] / ms["draft"], speedup_vs_best_alone=best / ms["draft"])
    with staged_dir(out) as tmp:
        for k, m in merged.items():
            m.save(tmp / f"{k}.json")
        (tmp / "eval.json").write_text(json.dumps(result, indent=1))
    what = "FastCar " if sess.is_fastcar else ""
    print(f"decode ms/token: {what}plain {ms['plain']:.3f}, {what}+ draft {spec} {ms['draft']:.3f} (generate's wall "
          f"time minus prefill; {len(prompts)} prompts x {frames} frames x {sess.frame_tokens} tokens, batch {batch}, "
          f"{threads} thread(s))")
    if sess.is_fastcar:
        print(f"MLP replay: plain {100 * result['replay_plain']:.1f}%, with the draft {100 * result['replay_draft']:.1f}%")
    print(f"speed-up {result['speedup']:.2f}x; draft tokens accepted {100 * d.acceptance:.1f}%, "
          f"{d.tokens_per_step:.2f} tokens per verify step")
    print(f"tokens equal to plain greedy decoding: {100 * result['token_agreement']:.1f}%")
    if dense_path is not None:
        print(f"dense: plain {ms['dense']:.3f}, + draft {ms['dense_draft']:.3f} ms/token (draft accepted "
              f"{100 * result['dense_acceptance']:.1f}%); FastCar + draft {result['speedup_vs_dense']:.2f}x dense, "
              f"{result['speedup_vs_best_alone']:.2f}x the faster of FastCar alone and the draft alone")
    print(f"wrote {len(names)} files in {out}")
    return result


def frame_tokens_of(frame_shape: str | None) -> int | None:
    """L from --frame-shape HxW (None when not given)."""
    from fastcar_compile.runtime.report import parse_frame_shape

    shape = parse_frame_shape(frame_shape, None)
    return None if shape is None else shape[0] * shape[1]
