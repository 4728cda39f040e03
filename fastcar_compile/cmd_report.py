"""`fastcar-compile report run.json [dense.json]`: PNG pictures of runtime runs (replay heatmap, per-frame
latency with the dense run beside FastCar, per-token replay when the frame is a grid)."""

from __future__ import annotations

import argparse
from pathlib import Path

from fastcar_compile.errors import FastCarError


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="fastcar-compile report",
        description="Write <run>.replay.png (layer x frame), <run>.latency.png and, with --frame-shape, "
                    "<run>.tokens.png. Given a FastCar run and a dense run (e.g. fast.json and dense.json from "
                    "`fastcar-compile eval --model`), compares them: speed-up, dense bars in the latency picture.")
    ap.add_argument("runs", nargs="+", metavar="run.json",
                    help="one run, or a FastCar run and a dense run of the same prompts (any order)")
    ap.add_argument("--frame-shape", metavar="HxW", help="frame as a token grid (e.g. 16x16 for L=256): also "
                                                         "draw the replay share of every token position")
    ap.add_argument("-o", "--out-dir", default=None, help="folder for the PNGs (default: next to the run)")
    a = ap.parse_args(argv)
    from fastcar_compile.fileio import check_outputs
    from fastcar_compile.runtime.report import (
        PICTURES,
        comparison,
        parse_frame_shape,
        picture_name,
        write_report,
    )
    from fastcar_compile.runtime.stats import RunStats

    if len(a.runs) > 2:
        raise FastCarError(f"give one run.json, or two (FastCar and dense), not {len(a.runs)}")
    # before reading them: the pictures go beside the FastCar run, which may be either file
    for p in a.runs:
        out = Path(a.out_dir or Path(p).parent)
        check_outputs({out / picture_name(Path(p).stem, kind): "picture" for kind in PICTURES},
                      {r: "the run" for r in a.runs})
    runs = [(Path(p), RunStats.load(p)) for p in a.runs]
    dense = None
    if len(runs) == 2:
        kinds = [r.fastcar for _, r in runs]
        if kinds.count(False) != 1:
            raise FastCarError(f"comparing two runs needs one FastCar run and one dense run; {a.runs[0]} is "
                               f"{'FastCar' if kinds[0] else 'dense'} and {a.runs[1]} is "
                               f"{'FastCar' if kinds[1] else 'dense'}")
        runs.sort(key=lambda x: not x[1].fastcar)
        dense = runs[1][1]
        if dense.frame_tokens != runs[0][1].frame_tokens:
            raise FastCarError("the two runs have different frame sizes; compare runs of the same prompts")
    src, stats = runs[0]
    shape = parse_frame_shape(a.frame_shape, stats.frame_tokens)
    paths = write_report(stats, a.out_dir or src.parent, stem=src.stem, dense=dense, frame_shape=shape)
    print(stats.summary())
    if dense is not None:
        print(comparison(stats, dense))
    for p in paths:
        print(f"wrote {p}")
    return 0
