"""Calibration time and held-out error vs the number of calibration prompts: one-pass TAS quantile
(+ refinement passes) vs the bisection search, on the bundled demo model (L = 64, frame 0 given).

For each n, `--draws` disjoint calibration sets of n clips pick tau for `--target`; every tau is then run
on the same held-out clips. Reported per (method, n): mean calibration time, mean |held-out replay -
target|, the mean 95% CI half width the calibration itself reported (over its n prompts), and the passes.
Methods alternate per draw, so machine load hits both alike.

    python benchmarks/experiments/calibration.py [--target 0.5] [--ns 4,8,16,32,64] [--draws 3] [--heldout 128]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np


def prompts(tok, start: int, n: int) -> np.ndarray:
    """Prompt + the clip's first frame (given video), as the demo runs them."""
    from fastcar_compile.demo import data
    from fastcar_compile.demo.model import prompt

    clips = data.make_clips("eval", n, frames=2, seed=0, start=start)
    return np.array([prompt(c.motion) + [int(t) for t in tok.encode(c.frames)[0]] for c in clips])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=float, default=0.5)
    ap.add_argument("--ns", default="4,8,16,32,64", help="calibration set sizes")
    ap.add_argument("--draws", type=int, default=3, help="disjoint calibration sets per size")
    ap.add_argument("--heldout", type=int, default=128, help="held-out clips")
    ap.add_argument("--frames", type=int, default=3, help="frames per clip incl. the given frame 0")
    ap.add_argument("--out", help="also write the table (markdown) here")
    a = ap.parse_args(argv)
    from fastcar_compile.demo.evaluate import compile_bundled, load_tokenizer
    from fastcar_compile.demo.model import CODES
    from fastcar_compile.runtime import FastCarSession, calibrate_threshold
    from fastcar_compile.runtime.calib_stats import ci95
    from fastcar_compile.runtime.decode import ThresholdWarning

    warnings.simplefilter("ignore", ThresholdWarning)
    tok = load_tokenizer()
    L = tok.tokens_per_frame
    ns = [int(x) for x in a.ns.split(",")]

    def codes_only(g: np.ndarray) -> np.ndarray:
        g = g.copy()
        g[:, CODES:] = -np.inf
        return g

    kw = dict(given_video_tokens=L, logits_processor=codes_only)
    with tempfile.TemporaryDirectory() as tmp:
        diag = compile_bundled(Path(tmp) / "diag.onnx", tau=0.0, diagnostics=True)
        held = prompts(tok, 0, a.heldout)
        sess = FastCarSession(diag, threads=1)
        rows: dict[tuple[str, int], list[tuple[float, float, float, int]]] = {}
        start = a.heldout
        for n in ns:
            for d in range(a.draws):
                calib = prompts(tok, start, n)
                start += n
                for method in (("quantile", "search") if d % 2 == 0 else ("search", "quantile")):
                    t0 = time.perf_counter()
                    r = calibrate_threshold(diag, calib, num_frames=a.frames, target_replay=a.target,
                                            method=method, progress=False, batch_size=64, **kw)
                    secs = time.perf_counter() - t0
                    per = []
                    for i in range(0, len(held), 64):
                        st = sess.generate(held[i:i + 64], a.frames, threshold=r.tau, progress=False, **kw).stats
                        per += list(st.replay_array().mean(axis=(0, 1)))
                    err = abs(float(np.mean(per)) - a.target)
                    rows.setdefault((method, n), []).append((secs, err, r.replay_calib_ci, len(r.probes)))
                    print(f"n={n:3d} draw {d} {method:8s}: tau {r.tau:8.4g}, {secs:5.1f} s, {len(r.probes):2d} "
                          f"passes, calib {100 * r.replay_calib:.1f}% +- {100 * r.replay_calib_ci:.1f}, held-out "
                          f"{100 * np.mean(per):.1f}% (+- {100 * ci95(np.array(per)):.1f})", flush=True)
    head = ("| method | prompts | calibration s | passes | held-out abs error (pts) | reported 95% CI (pts) |\n"
            "|---|---:|---:|---:|---:|---:|")
    lines = [head]
    for n in ns:
        for method in ("quantile", "search"):
            v = np.array(rows[(method, n)])
            lines.append(f"| {method} | {n} | {v[:, 0].mean():.1f} | {v[:, 3].mean():.1f} | "
                         f"{100 * v[:, 1].mean():.1f} (max {100 * v[:, 1].max():.1f}) | +-{100 * v[:, 2].mean():.1f} |")
    table = "\n".join(lines)
    print(f"\ntarget {a.target}, demo model (L={L}, frame 0 given, {a.frames - 1} generated frames), "
          f"{a.heldout} held-out clips, {a.draws} draws per size\n{table}")
    if a.out:
        from fastcar_compile.core.atomic import write_text

        write_text(a.out, table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
