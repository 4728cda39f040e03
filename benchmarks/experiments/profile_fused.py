"""Profile one FastCarSession decode step of a compiled model: ms per step, Python ms per step (outside ORT),
kernel launches per step and the kernel time per op type (ORT's profiler over the timed steps).

    python benchmarks/experiments/profile_fused.py FAST_ONNX [--ctx 4096] [--replay all|none] [--threads 2]
    python benchmarks/experiments/profile_fused.py FAST_ONNX --libs OLD.so,NEW.so [--names old,new]   # kernel builds A/B

Path (b) of docs/genai.md (a dynamo export compiled with --fused-attention fastcar) against genai's 89 launches
per step; a loaded machine moves the times but not the launch counts. With --libs, every build of the native
kernels gets its own session (FASTCAR_NATIVE=lib when it is created), the same prompt, then --rounds rounds of
one untimed and --block timed steps per build in turn (interleaved, so load hits them alike); per-step time =
lower quartile, ratios against the first build. Python ms/step: the median over every step, untimed ones too.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common and the suite scripts
from _common import (  # noqa: E402
    add_hugepage_flag,
    interleave,
    lower_quartile_ms,
    ort_options,
    reexec_with_hugepage_malloc,
)


class Stepper:
    """A FastCarSession on one kernel library (None: the default one), prefilled with the prompt, stepping
    greedily at forced replay (tau -inf for every layer, or +inf), with ORT's profiler on."""

    def __init__(self, model: Path, lib: str | None, ctx: int, threads: int, replay_all: bool, steps: int):
        from fastcar_compile.runtime import FastCarSession

        so = ort_options(threads, profile=Path(tempfile.mkdtemp(prefix="fastcar-prof-")) / "step")
        if lib is not None:
            os.environ["FASTCAR_NATIVE"] = lib
        self.sess = FastCarSession(model, session_options=so, threads=threads, max_length=ctx + steps + 8)
        self.taus = np.full(len(self.sess.layers), -np.inf if replay_all else np.inf, np.float32)
        prompt = np.random.default_rng(0).integers(3, self.sess.vocab or 2, (1, ctx)).astype(np.int64)
        out = self.sess.step(self.sess.new_state(1), prompt, threshold=self.taus)
        self.state, self.ids = out.state, out.logits[:, -1].argmax(-1)[:, None]
        self.python: list[float] = []  # seconds per step outside ORT

    def step(self) -> None:
        t0 = time.perf_counter()
        out = self.sess.step(self.state, self.ids, threshold=self.taus, check=False)
        self.python.append(time.perf_counter() - t0 - self.sess.last_ort_s)
        self.state, self.ids = out.state, out.logits[:, -1].argmax(-1)[:, None]

    def profile(self) -> tuple[float, dict[str, tuple[float, float]]]:
        """(launches per step, op type -> (ms per step, launches per step)) over the decode steps (the prompt's
        run excluded; untimed steps count alike, they run the same graph)."""
        ev = json.loads(Path(self.sess.session.end_profiling()).read_text())
        runs = [e for e in ev if e.get("name") == "model_run"][1:]
        time_us: collections.Counter = collections.Counter()
        count: collections.Counter = collections.Counter()
        for e in ev:
            if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= runs[0]["ts"]:
                op = e["args"].get("op_name")
                time_us[op] += e["dur"]
                count[op] += 1
        n = len(runs)
        return sum(count.values()) / n, {op: (us / n / 1e3, count[op] / n) for op, us in time_us.most_common()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)  # NO_HUGEPAGES whole
    add_hugepage_flag(ap)
    ap.add_argument("model", type=Path, help="fast.onnx compiled with --fused-attention fastcar")
    ap.add_argument("--ctx", type=int, default=4096, help="prompt tokens before the timed decode steps")
    ap.add_argument("--replay", choices=["none", "all"], default="none", help="tau +inf (none) or -inf (all)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--libs", help="comma-separated libfastcar_ops.so builds to compare (default: the current one)")
    ap.add_argument("--names", help="comma-separated names for --libs")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--block", type=int, default=5)
    ap.add_argument("--top", type=int, default=25, help="op types listed")
    a = ap.parse_args(argv)
    libs: list[str | None] = a.libs.split(",") if a.libs else [None]
    names = a.names.split(",") if a.names else [Path(x).stem if x else "current" for x in libs]
    if len(names) != len(libs):
        ap.error("--names: give one name per --libs entry")
    steps = a.rounds * (a.block + 1)
    runs = {}
    for n, lib in zip(names, libs, strict=True):
        t0 = time.perf_counter()
        runs[n] = Stepper(a.model, lib, a.ctx, a.threads, a.replay == "all", steps)
        print(f"{n}: prefilled {a.ctx} tokens in {time.perf_counter() - t0:.1f} s ({lib or 'default library'})",
              file=sys.stderr)
    ms = lower_quartile_ms(interleave({n: r.step for n, r in runs.items()}, a.rounds, a.block))
    base = names[0]
    for n, r in runs.items():
        launches, ops = r.profile()
        vs = f" ({ms[base] / ms[n]:.2f}x vs {base})" if len(runs) > 1 else ""
        print(f"{n}: {a.model} ctx {a.ctx} replay {a.replay}, {a.threads} threads: {ms[n]:.2f} ms/step (lower "
              f"quartile){vs}, Python {np.median(r.python) * 1e3:.3f} ms/step outside ORT; kernel launches per step "
              f"{launches:.0f}, kernel time {sum(t for t, _ in ops.values()):.2f} ms/step (If includes its branch)")
        for op, (t, c) in list(ops.items())[:a.top]:
            print(f"  {op:36s} {t:7.3f} ms  x{c:.0f}")
    return 0


if __name__ == "__main__":
    # sessions created one after another in one process: huge pages for all alike (_common)
    reexec_with_hugepage_malloc(sys.argv[1:])
    raise SystemExit(main())
