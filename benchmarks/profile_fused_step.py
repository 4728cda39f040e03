"""One decode step of a compiled model (FastCarSession, shared KV buffer) with two or more builds of the native
kernels, interleaved in one run: ms per step and ORT's per-op kernel profile per build.

Made from the lead's profile script for the dense-attention work: the decode-attention kernel's effect on the whole
step of benchmarks/bench_genai.py's model (path (b): the dynamo export compiled with --fused-attention fastcar).
Every build gets its own session (FASTCAR_NATIVE=lib when it is created), the same prompt of --ctx tokens, then
--rounds rounds of --block steps per build in turn (forced replay 0% or 100%: --replay-all); per-step time = lower
quartile; per-op kernel time = mean over the timed steps (ORT profiling on for every build alike).

    python benchmarks/profile_fused_step.py MODEL/fast.onnx --ctx 4096 --libs OLD.so,NEW.so
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


class Build:
    """A FastCarSession on one kernel library, prefilled with the prompt, stepping greedily."""

    def __init__(self, model: Path, lib: str, ctx: int, layers: int, threads: int, replay_all: bool, steps: int):
        import onnxruntime as ort

        from fastcar_compile.runtime import FastCarSession

        so = ort.SessionOptions()
        so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
        so.enable_profiling = True
        so.profile_file_prefix = str(Path(tempfile.gettempdir()) / f"fastcar_profile_fused_{os.getpid()}")
        os.environ["FASTCAR_NATIVE"] = lib
        self.sess = FastCarSession(model, session_options=so, threads=threads, max_length=ctx + steps + 8)
        self.taus = np.full(layers, -np.inf if replay_all else np.inf, np.float32)
        prompt = np.random.default_rng(0).integers(3, self.sess.vocab, (1, ctx)).astype(np.int64)
        out = self.sess.step(self.sess.new_state(1), prompt, threshold=self.taus)
        self.state, self.ids = out.state, out.logits[:, -1].argmax(-1)[:, None]
        self.times: list[float] = []
        self.first_timed_ts: float | None = None

    def step(self, timed: bool) -> None:
        t0 = time.perf_counter()
        out = self.sess.step(self.state, self.ids, threshold=self.taus, check=False)
        if timed:
            self.times.append(time.perf_counter() - t0)
        self.state, self.ids = out.state, out.logits[:, -1].argmax(-1)[:, None]

    def profile(self) -> dict[str, float]:
        """ms per step per op type over the timed steps (the untimed first step of each round included)."""
        ev = json.load(open(self.sess.session.end_profiling()))
        runs = [e for e in ev if e.get("name") == "model_run"]
        timed = runs[1:]  # the prompt's run excluded
        agg: collections.Counter = collections.Counter()
        for e in ev:
            if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= timed[0]["ts"]:
                agg[e["args"].get("op_name")] += e["dur"]
        return {op: d / len(timed) / 1e3 for op, d in agg.most_common()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path, help="fast.onnx compiled with --fused-attention fastcar")
    ap.add_argument("--libs", required=True, help="comma-separated libfastcar_ops.so builds")
    ap.add_argument("--names", help="comma-separated names for --libs")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--block", type=int, default=5)
    ap.add_argument("--replay-all", action="store_true", help="tau = -inf (every MLP replayed); default +inf")
    ap.add_argument("--top", type=int, default=8, help="op types listed")
    a = ap.parse_args(argv)
    libs = a.libs.split(",")
    names = a.names.split(",") if a.names else [Path(x).stem for x in libs]
    steps = a.rounds * (a.block + 1)
    builds = {}
    for n, lib in zip(names, libs, strict=True):
        t0 = time.perf_counter()
        builds[n] = Build(a.model, lib, a.ctx, a.layers, a.threads, a.replay_all, steps)
        print(f"{n}: prefilled {a.ctx} tokens in {time.perf_counter() - t0:.1f} s ({lib})", file=sys.stderr)
    for _ in range(a.rounds):
        for b in builds.values():
            b.step(False)
            for _ in range(a.block):
                b.step(True)
    ms = {n: float(np.percentile(b.times, 25)) * 1e3 for n, b in builds.items()}
    base = names[0]
    print(f"ctx {a.ctx}, replay {'100' if a.replay_all else '0'}%, {a.threads} threads: " +
          ", ".join(f"{n} {x:.2f} ms/step ({ms[base] / x:.2f}x vs {base})" for n, x in ms.items()))
    for n, b in builds.items():
        prof = b.profile()
        print(f"  {n}: " + ", ".join(f"{op} {d:.2f}" for op, d in list(prof.items())[:a.top]) + " (ms/step)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
