"""`fastcar-compile eval --model fast.onnx --prompts p.npy`: the user's own model, dense vs FastCar.

Every prompt batch is generated greedily by the dense model and by FastCar in the same run, the order
alternating from batch to batch (so machine load hits both alike). Reported: replay (with and without
frame 0), decode ms per token of each (`RunStats.ms_per_token`, FastCarSession.step incl. Python), the
speed-up, token agreement with dense, and KL(dense || FastCar) per generated token, teacher-forced on the
FastCar tokens (one dense prefill over prompt + video). Writes dense.json and fast.json (runtime traces:
`fastcar-compile report` and the FPGA simulator read them), eval.json and the pictures.
"""

from __future__ import annotations

import json
import math
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from fastcar_compile.errors import FastCarError
from fastcar_compile.fileio import check_output_dir, check_outputs, model_reads, staged_dir

OUTPUTS = ("dense.json", "fast.json", "fast.replay.png", "fast.latency.png", "fast.tokens.png", "eval.json")


def load_prompts(path: str | os.PathLike, what: str = "--prompts") -> np.ndarray:
    """An integer .npy [prompts, prompt_len] (one prompt may be 1-D); a clear error for anything else."""
    p = Path(path)
    if not p.is_file():
        raise FastCarError(f"{what} {p} does not exist; save token ids with np.save('p.npy', ids) "
                           "(int array [prompts, prompt_len])")
    try:
        arr = np.load(p, allow_pickle=False)
    except Exception as exc:  # noqa: BLE001 - numpy raises several types for a non-.npy file
        raise FastCarError(f"{what} {p}: not a .npy array ({str(exc)[:120]})") from None
    if not isinstance(arr, np.ndarray):  # an .npz archive
        arr.close()
        raise FastCarError(f"{what} {p} is an .npz archive; save the one token array with np.save('p.npy', ids)")
    if arr.ndim == 1:
        arr = arr[None]
    if arr.ndim != 2 or not np.issubdtype(arr.dtype, np.integer) or arr.size == 0:
        raise FastCarError(f"{what} {p} must hold integer token ids [prompts, prompt_len], got {arr.dtype} "
                           f"{list(arr.shape)}")
    return arr


def check_files(fast_path: str | os.PathLike, dense_path: str | os.PathLike | None, out_dir: str | os.PathLike,
                prompts_path: str | os.PathLike | None = None) -> None:
    """Before any work: the output folder can be written and none of the files written into it (OUTPUTS)
    is a special file or one of the inputs (the models, their external data, the prompts)."""
    out = check_output_dir(out_dir, "--out")
    reads: dict[str | os.PathLike, str] = {**model_reads(fast_path, "--model")}
    if dense_path is not None:
        reads.update(model_reads(dense_path, "--dense"))
    if prompts_path is not None:
        reads[prompts_path] = "--prompts"
    check_outputs({out / name: f"--out's {name}" for name in OUTPUTS}, reads)


def evaluate(fast_path: str | os.PathLike, prompts: np.ndarray, out_dir: str | os.PathLike, *,
             dense_path: str | os.PathLike | None = None, frames: int = 4, batch: int = 1, threads: int = 2,
             given_video_tokens: int = 0, frame_shape: str | None = None,
             progress: bool = True) -> dict[str, Any]:
    """Dense vs FastCar on `prompts`; returns the eval.json dict and writes the files into out_dir.
    frame_shape: "HxW" (H x W = L) for the per-token replay picture."""
    from tqdm.auto import tqdm

    from fastcar_compile.runtime.calibrate import NeverReplay, teacher_forced_kl
    from fastcar_compile.runtime.decode import ThresholdWarning
    from fastcar_compile.runtime.report import comparison, parse_frame_shape, render_report
    from fastcar_compile.runtime.session import FastCarSession
    from fastcar_compile.runtime.stats import RunStats

    out = Path(out_dir)
    check_files(fast_path, dense_path, out)
    if frames < 2:
        raise FastCarError("--frames must be >= 2 (frame 0 never replays)")
    if batch < 1 or len(prompts) % batch:
        raise FastCarError(f"--batch {batch} must divide the number of prompts ({len(prompts)})")
    fast = FastCarSession(fast_path, threads=threads)
    if not fast.is_fastcar:
        raise FastCarError(f"--model {fast_path} is not FastCar-compiled (no fastcar.* metadata); pass the "
                           "compiled fast.onnx to --model and the original export to --dense")
    shape = parse_frame_shape(frame_shape, fast.frame_tokens)
    dense = FastCarSession(dense_path, frame_tokens=fast.frame_tokens, threads=threads) if dense_path else None
    if dense is not None and dense.is_fastcar:
        raise FastCarError(f"--dense {dense_path} is a FastCar-compiled model; pass the original export")
    reference = dense if dense is not None else NeverReplay(fast)
    kw = dict(given_video_tokens=given_video_tokens, progress=False)
    d_runs, f_runs, kl, agree = [], [], [], []
    chunks = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    with warnings.catch_warnings():  # one video may replay all of frame 1 legitimately: judged on the whole run
        warnings.simplefilter("ignore", ThresholdWarning)
        for i, chunk in enumerate(tqdm(chunks, desc="dense vs FastCar", unit="batch", disable=not progress)):
            for which in ((0, 1) if i % 2 == 0 else (1, 0)):
                if which == 0:
                    d = (dense.generate(chunk, frames, **kw) if dense is not None
                         else fast.generate(chunk, frames, threshold=math.inf, **kw))
                else:
                    f = fast.generate(chunk, frames, keep_logits=True, **kw)
            d_runs.append(_as_dense(d.stats) if dense is None else d.stats)
            f_runs.append(f.stats)
            kl.append(teacher_forced_kl(reference, [list(map(int, r)) for r in chunk], f.tokens, f.logits))
            agree.append(d.tokens == f.tokens)
    ds, fs = RunStats.merge(d_runs), RunStats.merge(f_runs)
    if (msg := fs.threshold_warning()) is not None:
        print(f"warning: {msg}", file=sys.stderr)
    pictures = render_report(fs, stem="fast", dense=ds, frame_shape=shape)
    k = np.concatenate([x.ravel() for x in kl])
    result = {
        "model": str(fast_path), "dense": str(dense_path) if dense_path else f"{fast_path} at tau=+inf",
        "prompts": int(len(prompts)), "frames": frames, "frame_tokens": fast.frame_tokens, "batch": batch,
        "threads": threads, "native_kernels": fast.native_library is not None, "tau": fs.threshold,
        "replay_ratio": fs.replay_ratio, "replay_ratio_eligible": fs.replay_ratio_eligible,
        "replay_ceiling": fs.eligible_ratio_ceiling,
        "dense_ms_per_token": ds.ms_per_token, "fast_ms_per_token": fs.ms_per_token,
        "speedup": ds.ms_per_token / fs.ms_per_token if fs.ms_per_token else float("nan"),
        "kl_mean": float(k.mean()), "kl_p95": float(np.quantile(k, 0.95)),
        "token_agreement": float(np.mean(np.concatenate([a.ravel() for a in agree]))),
        "files": [str(out / name) for name in ("dense.json", "fast.json", *pictures, "eval.json")],
    }
    with staged_dir(out) as tmp:  # every file of the run appears together at the end, or none
        ds.save(tmp / "dense.json")
        fs.save(tmp / "fast.json")
        for name, data in pictures.items():
            (tmp / name).write_bytes(data)
        (tmp / "eval.json").write_text(json.dumps(result, indent=1))
    print(comparison(fs, ds))
    print(f"tokens equal to dense: {100 * result['token_agreement']:.1f}%; KL(dense || FastCar) per token: mean "
          f"{result['kl_mean']:.4g}, 95th percentile {result['kl_p95']:.4g} nats (teacher-forced on FastCar's tokens)")
    print(f"native kernels: {'on' if result['native_kernels'] else 'OFF'}; {len(prompts)} prompts x {frames} "
          f"frames x {fast.frame_tokens} tokens, batch {batch}, {threads} thread(s)")
    print(f"wrote {len(result['files'])} files in {out}:")
    for p in result["files"]:
        print(f"  {p}")
    return result


def _as_dense(stats):
    """The fast model's tau=+inf run relabelled as the dense baseline (no replay by construction)."""
    stats.fastcar, stats.layers = False, []
    stats.steps = [{"pos": s["pos"], "replay": []} for s in stats.steps]
    return stats.finalize()
