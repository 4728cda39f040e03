"""`fastcar-compile report run.json`: PNG pictures of a runtime run (replay heatmap, per-frame latency)."""

from __future__ import annotations

import argparse
from pathlib import Path


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="fastcar-compile report",
                                 description="Write <run>.replay.png (layer x frame) and <run>.latency.png.")
    ap.add_argument("run_json", help="statistics saved by generate(..., trace=PATH) or RunStats.save()")
    ap.add_argument("-o", "--out-dir", default=None, help="folder for the PNGs (default: next to run.json)")
    a = ap.parse_args(argv)
    from fastcar_compile.runtime.report import write_report
    from fastcar_compile.runtime.stats import RunStats

    src = Path(a.run_json)
    stats = RunStats.load(src)
    paths = write_report(stats, a.out_dir or src.parent, stem=src.stem)
    print(stats.summary())
    for p in paths:
        print(f"wrote {p}")
    return 0
