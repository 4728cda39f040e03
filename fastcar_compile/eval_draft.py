"""`fastcar-compile eval --model model.onnx --prompts p.npy --draft temporal:K`: speculative decoding against
plain decoding of the same dense model, greedy, in the same run.

Every prompt batch is generated twice, plainly and with the draft (the order alternating from batch to batch,
so machine load hits both alike); the figures are decode milliseconds per token (generate's wall time minus
its prefill, over the tokens decoded), their ratio, the share of draft tokens accepted and the tokens per
verify step, and the share of tokens equal to plain greedy decoding, which is 100% by construction (runtime/
speculate.py) and is measured, not assumed. Writes plain.json and draft.json (runtime traces) and eval.json.
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


def evaluate_draft(model_path: str | os.PathLike, prompts: np.ndarray, out_dir: str | os.PathLike, draft: str, *,
                   frame_tokens: int | None = None, frames: int = 4, batch: int = 1, threads: int = 2,
                   given_video_tokens: int = 0, progress: bool = True) -> dict[str, Any]:
    """Plain vs draft decoding of `model_path` (a dense model) on `prompts`; returns eval.json's dict."""
    from tqdm.auto import tqdm

    from fastcar_compile.runtime.session import FastCarSession
    from fastcar_compile.runtime.speculate import parse_draft
    from fastcar_compile.runtime.stats import RunStats

    spec = parse_draft(draft)
    out = check_output_dir(out_dir, "--out")
    check_outputs({out / name: f"--out's {name}" for name in OUTPUTS}, model_reads(model_path, "--model"))
    if batch < 1 or len(prompts) % batch:
        raise FastCarError(f"--batch {batch} must divide the number of prompts ({len(prompts)})")
    sess = FastCarSession(model_path, frame_tokens=frame_tokens, threads=threads)
    if (why := sess.speculation_refusal()) is not None:
        raise FastCarError(why)
    if sess.frame_tokens is None:
        raise FastCarError("--draft needs the frame size: give --frame-shape HxW (H x W tokens per frame)")
    kw = dict(given_video_tokens=given_video_tokens, progress=False)
    stats: dict[str, list] = {"plain": [], "draft": []}
    secs = {"plain": 0.0, "draft": 0.0}
    same = []
    chunks = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    for i, chunk in enumerate(tqdm(chunks, desc=f"plain vs draft {spec}", unit="batch", disable=not progress)):
        res = {}
        for which in (("plain", "draft") if i % 2 == 0 else ("draft", "plain")):
            t0 = time.perf_counter()
            res[which] = sess.generate(chunk, frames, draft=None if which == "plain" else spec, **kw).complete()
            secs[which] += time.perf_counter() - t0 - res[which].stats.prefill_ms / 1e3
            stats[which].append(res[which].stats)
        same.append(res["plain"].tokens == res["draft"].tokens)
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
        "token_agreement": float(np.mean(np.concatenate([s.ravel() for s in same]))),
        "files": [str(out / name) for name in OUTPUTS],
    }
    with staged_dir(out) as tmp:
        merged["plain"].save(tmp / "plain.json")
        d.save(tmp / "draft.json")
        (tmp / "eval.json").write_text(json.dumps(result, indent=1))
    print(f"decode ms/token: plain {ms['plain']:.3f}, draft {spec} {ms['draft']:.3f} (generate's wall time minus "
          f"prefill; {len(prompts)} prompts x {frames} frames x {sess.frame_tokens} tokens, batch {batch}, "
          f"{threads} thread(s))")
    print(f"speed-up {result['speedup']:.2f}x; draft tokens accepted {100 * d.acceptance:.1f}%, "
          f"{d.tokens_per_step:.2f} tokens per verify step")
    print(f"tokens equal to plain greedy decoding: {100 * result['token_agreement']:.1f}%")
    print(f"wrote {len(OUTPUTS)} files in {out}")
    return result


def frame_tokens_of(frame_shape: str | None) -> int | None:
    """L from --frame-shape HxW (None when not given)."""
    from fastcar_compile.runtime.report import parse_frame_shape

    shape = parse_frame_shape(frame_shape, None)
    return None if shape is None else shape[0] * shape[1]
