"""`fastcar-compile report run.json [dense.json] [fast_inf.json]`: PNG pictures of runtime runs (replay heatmap,
per-frame latency with the input model's and the compiled model's tau=+inf runs beside FastCar, KV cache
diagnostics, per-token replay when the frame is a grid)."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from fastcar_compile.core.errors import FastCarError


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="fastcar-compile report",
        description="Write <run>.replay.png (layer x frame), <run>.latency.png, <run>.kv.png (--kv-diagnostics "
                    "runs) and, with --frame-shape, <run>.tokens.png. Given a FastCar run with the input model's run "
                    "and/or the compiled model's tau=+inf run of the same prompts (fast.json, dense.json, "
                    "fast_inf.json from `fastcar-compile eval --model`), compares them: the speed-up as graph/"
                    "attention gain x replay gain, their bars in the latency picture.")
    ap.add_argument("runs", nargs="+", metavar="run.json",
                    help="one run, or a FastCar run with the input model's run and/or the compiled model's tau=+inf "
                         "run of the same prompts (any order)")
    ap.add_argument("--frame-shape", metavar="HxW", help="frame as a token grid (e.g. 16x16 for L=256): also "
                                                         "draw the replay share of every token position")
    ap.add_argument("-o", "--out-dir", default=None, help="folder for the PNGs (default: next to the run)")
    a = ap.parse_args(argv)
    from fastcar_compile.core.fileio import check_outputs
    from fastcar_compile.runtime.report import (
        PICTURES,
        comparison,
        kv_summary,
        parse_frame_shape,
        picture_name,
        write_report,
    )
    from fastcar_compile.runtime.stats import RunStats

    if len(a.runs) > 3:
        raise FastCarError(f"give one run.json, or a FastCar run with the input model's and/or the tau=+inf run "
                           f"(three at most), not {len(a.runs)}")
    # before reading them: the pictures go beside the FastCar run, which may be any of the files
    for p in a.runs:
        out = Path(a.out_dir or Path(p).parent)
        check_outputs({out / picture_name(Path(p).stem, kind): "picture" for kind in PICTURES},
                      {r: "the run" for r in a.runs})
    runs = [(Path(p), RunStats.load(p)) for p in a.runs]
    src, stats = runs[0]
    dense = compiled_inf = None
    if len(runs) > 1:
        kinds = [_kind(r) for _, r in runs]
        if kinds.count("FastCar") != 1 or len(set(kinds)) != len(runs):
            raise FastCarError("comparing runs needs one FastCar run with the input model's run and/or the compiled "
                               "model's tau=+inf run; got " + ", ".join(f"{p} ({k})" for (p, _), k in
                                                                         zip(runs, kinds, strict=True)))
        by_kind = dict(zip(kinds, runs, strict=True))
        src, stats = by_kind["FastCar"]
        dense = by_kind.get("input model", (None, None))[1]
        compiled_inf = by_kind.get("compiled at tau=+inf", (None, None))[1]
        if any(r.frame_tokens != stats.frame_tokens for _, r in runs):
            raise FastCarError("the runs have different frame sizes; compare runs of the same prompts")
    shape = parse_frame_shape(a.frame_shape, stats.frame_tokens)
    paths = write_report(stats, a.out_dir or src.parent, stem=src.stem, dense=dense, frame_shape=shape,
                         compiled_inf=compiled_inf)
    print(stats.summary())
    if dense is not None or compiled_inf is not None:
        print(comparison(stats, dense, compiled_inf))
    if (kv := kv_summary(stats)) is not None:
        print(kv)
    for p in paths:
        print(f"wrote {p}")
    return 0


def _kind(run) -> str:
    """What a run.json is: the input model (no FastCar), FastCar, or the compiled model at tau=+inf (never replays)."""
    if not run.fastcar:
        return "input model"
    try:
        tau = np.asarray(run.threshold if run.threshold is not None else 0.0, dtype=float)
    except (TypeError, ValueError):
        return "FastCar"
    return "compiled at tau=+inf" if tau.size and np.all(np.isposinf(tau)) else "FastCar"
