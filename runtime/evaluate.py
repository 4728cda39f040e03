"""`fastcar-compile eval --model fast.onnx --prompts p.npy`: the user's own model, dense vs FastCar.

Every prompt batch is generated greedily by the input model (`--dense`), by the compiled model at tau=+inf (its
`fastcar_threshold` input set to +inf: no replay, no recompile) and by FastCar at its tau, in the same run, the
order rotating from batch to batch (so machine load hits all alike). The speed-up is reported as its factors:
graph/attention gain (compiled at tau=+inf vs the input model: the fused attention and norm fusions, net of the
gate's cost), replay gain (FastCar vs the same compiled model at tau=+inf) and their product. Also reported:
replay (with and without frame 0), decode ms per token of each (`RunStats.ms_per_token`, FastCarSession.step
incl. Python), token agreement, KL(dense || FastCar) per generated token, teacher-forced on the FastCar tokens
(one dense prefill over prompt + video), and with --kv-diagnostics models the KV cache's density, recall and
resident bytes over every video. Writes fast.json, fast_inf.json and dense.json (runtime traces: `fastcar-compile
report` and the FPGA simulator read them), eval.json and the pictures.
"""

from __future__ import annotations

import json
import math
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from fastcar_compile.core.errors import FastCarError
from fastcar_compile.core.fileio import (
    check_output_dir,
    check_outputs,
    model_reads,
    refuse_special_input,
    staged_dir,
)

OUTPUTS = ("dense.json", "fast.json", "fast_inf.json", "fast.replay.png", "fast.latency.png", "fast.kv.png",
           "fast.tokens.png", "eval.json")


def load_prompts(path: str | os.PathLike, what: str = "--prompts") -> np.ndarray:
    """An integer .npy [prompts, prompt_len] (one prompt may be 1-D); a clear error for anything else."""
    p = Path(path)
    refuse_special_input(p, what)
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


def spread(gains: list[dict[str, float | None]]) -> dict[str, Any]:
    """Each factor of `gains` (one dict per round, runtime/report.speedups) as its median over the rounds, with
    `<factor>_range` [lowest, highest] and `<factor>_rounds` (every round's value)."""
    out: dict[str, Any] = {}
    for key in ("speedup_graph", "speedup_replay", "speedup"):
        values = [g[key] for g in gains if g[key] is not None]
        out[key] = float(np.median(values)) if values else None
        out[f"{key}_range"] = [float(min(values)), float(max(values))] if values else None
        out[f"{key}_rounds"] = values
    return out


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
             given_video_tokens: int = 0, frame_shape: str | None = None, rounds: int = 3,
             progress: bool = True) -> dict[str, Any]:
    """Dense vs FastCar on `prompts`; returns the eval.json dict and writes the files into out_dir.
    frame_shape: "HxW" (H x W = L) for the per-token replay picture.

    The speed-up is reported as its two factors, each measured in this run: the graph/attention gain (the
    compiled model at tau=+inf, i.e. its `fastcar_threshold` input set to +inf, against the input model: fused
    attention and norm fusions, minus the gate's cost) and the replay gain (FastCar at its tau against that same
    compiled model at tau=+inf), and their product. Without `dense_path` only the replay gain is measured.

    rounds: the interleaved pass over every prompt batch is repeated this many times, and each factor is reported
    as its median over the rounds with the lowest and highest (one round on a shared machine can be 3x off);
    quality, replay and the traces come from the first round (greedy decoding repeats its tokens)."""
    from fastcar_compile.core.limits import check_int
    from fastcar_compile.runtime.report import parse_frame_shape, render_report, speedups
    from fastcar_compile.runtime.stats import RunStats

    out = Path(out_dir)
    check_files(fast_path, dense_path, out)
    if frames < 2:
        raise FastCarError("--frames must be >= 2 (frame 0 never replays)")
    if batch < 1 or len(prompts) % batch:
        raise FastCarError(f"--batch {batch} must divide the number of prompts ({len(prompts)})")
    check_int("--rounds", rounds, 1, 100, "interleaved timing rounds")
    fast, dense = _sessions(fast_path, dense_path, threads)
    shape = parse_frame_shape(frame_shape, fast.frame_tokens)
    stats, kl, agree, inf_agree = _interleaved(fast, dense, prompts, frames, batch, given_video_tokens, rounds,
                                               progress)
    per_round = [{k: RunStats.merge(v) for k, v in st.items()} for st in stats]
    gains = [speedups(m.get("dense"), m["inf"], m["fast"]) for m in per_round]
    merged = per_round[0]
    ms = {name: float(np.median([m[name].ms_per_token for m in per_round])) for name in merged}
    fs, gs, ds = merged["fast"], merged["inf"], merged.get("dense")
    if (msg := fs.threshold_warning()) is not None:
        print(f"warning: {msg}", file=sys.stderr)
    pictures = render_report(fs, stem="fast", dense=ds, frame_shape=shape, compiled_inf=gs)
    traces = {"fast.json": fs, "fast_inf.json": gs, **({"dense.json": ds} if ds is not None else {})}
    result = _result(fast, fast_path, dense_path, prompts, frames, batch, threads, merged, kl, agree, inf_agree,
                     [str(out / name) for name in (*traces, *pictures, "eval.json")], ms, gains)
    with staged_dir(out) as tmp:  # every file of the run appears together at the end, or none
        for name, run in traces.items():
            run.save(tmp / name)
        for name, data in pictures.items():
            (tmp / name).write_bytes(data)
        (tmp / "eval.json").write_text(json.dumps(result, indent=1))
    _print_summary(result, merged, out, gains)
    return result


def _sessions(fast_path: str | os.PathLike, dense_path: str | os.PathLike | None, threads: int) -> tuple[Any, Any]:
    """The compiled model and (given) the input model, refused when they are the other way round."""
    from fastcar_compile.runtime.session import FastCarSession

    fast = FastCarSession(fast_path, threads=threads)
    if not fast.is_fastcar:
        raise FastCarError(f"--model {fast_path} is not FastCar-compiled (no fastcar.* metadata); pass the "
                           "compiled fast.onnx to --model and the original export to --dense")
    dense = FastCarSession(dense_path, frame_tokens=fast.frame_tokens, threads=threads) if dense_path else None
    if dense is not None and dense.is_fastcar:
        raise FastCarError(f"--dense {dense_path} is a FastCar-compiled model; pass the original export")
    return fast, dense


def _interleaved(fast, dense, prompts: np.ndarray, frames: int, batch: int, given_video_tokens: int, rounds: int,
                 progress: bool) -> tuple[list[dict[str, list]], list, list, list]:
    """`rounds` times every batch of prompts through the compiled model at tau=+inf, FastCar at its tau and (given)
    the input model, each first in turn: (per round their run statistics, per batch of the first round the
    KL(dense || FastCar) per token, FastCar's tokens equal to the reference's, the tau=+inf tokens equal to the
    input model's)."""
    from fastcar_compile.core.progress import bar
    from fastcar_compile.runtime.calibrate import NeverReplay, teacher_forced_kl
    from fastcar_compile.runtime.decode import ThresholdWarning

    reference = dense if dense is not None else NeverReplay(fast)
    kw = dict(given_video_tokens=given_video_tokens, progress=False)
    runs: dict[str, Callable[[np.ndarray], Any]] = {
        "inf": lambda chunk: fast.generate(chunk, frames, threshold=math.inf, **kw),
        "fast": lambda chunk: fast.generate(chunk, frames, keep_logits=True, **kw)}
    if dense is not None:
        runs["dense"] = lambda chunk: dense.generate(chunk, frames, **kw)
    stats: list[dict[str, list]] = [{k: [] for k in runs} for _ in range(rounds)]
    kl, agree, inf_agree = [], [], []
    chunks = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    order = list(runs)
    with warnings.catch_warnings():  # one video may replay all of frame 1 legitimately: judged on the whole run
        warnings.simplefilter("ignore", ThresholdWarning)
        work = [(r, i, c) for r in range(rounds) for i, c in enumerate(chunks)]
        for r, i, chunk in bar(work, desc="dense vs FastCar", unit="batch", enabled=progress):
            res = {}
            k = r * len(chunks) + i
            for which in order[k % len(order):] + order[: k % len(order)]:  # each model first in turn
                res[which] = runs[which](chunk).complete()
                stats[r][which].append(res[which].stats)
            if r:  # later rounds re-time the same greedy videos
                continue
            f, d = res["fast"], res.get("dense", res["inf"])
            kl.append(teacher_forced_kl(reference, [list(map(int, r)) for r in chunk], f.tokens, f.logits))
            agree.append(d.tokens == f.tokens)
            if dense is not None:
                inf_agree.append(res["inf"].tokens == d.tokens)
    return stats, kl, agree, inf_agree


def _result(fast, fast_path, dense_path, prompts: np.ndarray, frames: int, batch: int, threads: int, merged: dict,
            kl: list, agree: list, inf_agree: list, files: list[str], ms: dict[str, float], gains: list[dict]
            ) -> dict[str, Any]:
    """eval.json's content (ms per token and the speed-up factors: the rounds' medians, with their spread)."""
    fs = merged["fast"]
    k = np.concatenate([x.ravel() for x in kl])
    return {
        "model": str(fast_path), "dense": str(dense_path) if dense_path else None,
        "prompts": int(len(prompts)), "frames": frames, "frame_tokens": fast.frame_tokens, "batch": batch,
        "threads": threads, "native_kernels": fast.native_library is not None, "tau": fs.threshold,
        "replay_ratio": fs.replay_ratio, "replay_ratio_eligible": fs.replay_ratio_eligible,
        "replay_ceiling": fs.eligible_ratio_ceiling,
        "dense_ms_per_token": ms.get("dense"), "inf_ms_per_token": ms["inf"], "fast_ms_per_token": ms["fast"],
        "rounds": len(gains), **spread(gains),
        "kl_mean": float(k.mean()), "kl_p95": float(np.quantile(k, 0.95)),
        "token_agreement": float(np.mean(np.concatenate([a.ravel() for a in agree]))),
        "inf_token_agreement": float(np.mean(np.concatenate([a.ravel() for a in inf_agree]))) if inf_agree else None,
        "kv_diagnostics": fs.kv_diagnostics, "kv_diagnostics_per_video": fs.kv_diagnostics_per_video,
        "files": files,
    }


def _print_summary(result: dict[str, Any], merged: dict, out: Path, gains: list[dict]) -> None:
    from fastcar_compile.runtime.report import comparison, kv_summary

    fs, gs, ds = merged["fast"], merged["inf"], merged.get("dense")
    print(comparison(fs, ds, gs, rounds=gains))
    if result["inf_token_agreement"] is not None:
        print(f"tokens of the compiled model at tau=+inf equal to the input model's: "
              f"{100 * result['inf_token_agreement']:.1f}%")
    print(f"tokens of FastCar equal to {'the input model' if ds is not None else 'tau=+inf'}: "
          f"{100 * result['token_agreement']:.1f}%; KL(dense || FastCar) per token: mean "
          f"{result['kl_mean']:.4g}, 95th percentile {result['kl_p95']:.4g} nats (teacher-forced on FastCar's tokens)")
    if (kv := kv_summary(fs)) is not None:
        print(kv)
    print(f"native kernels: {'on' if result['native_kernels'] else 'OFF'}; {result['prompts']} prompts x "
          f"{result['frames']} frames x {result['frame_tokens']} tokens, batch {result['batch']}, "
          f"{result['threads']} thread(s)")
    print(f"wrote {len(result['files'])} files in {out}:")
    for p in result["files"]:
        print(f"  {p}")
