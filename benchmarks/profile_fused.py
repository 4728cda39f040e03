"""Profile one FastCarSession decode step of a compiled model: ms per step, Python ms per step (outside ORT),
kernel launches per step and the kernel time per op type (ORT's profiler, the last `--profiled` steps).

    python benchmarks/profile_fused.py FAST_ONNX [--ctx 4096] [--replay all|none] [--threads 2]

Path (b) of docs/genai.md (a dynamo export compiled with --fused-attention fastcar) against genai's 89 launches
per step; a loaded machine moves the times but not the launch counts.
"""

from __future__ import annotations

import argparse
import collections
import json
import tempfile
import time
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None) -> int:
    import onnxruntime as ort

    from fastcar_compile.runtime import FastCarSession

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--ctx", type=int, default=4096, help="prompt tokens before the timed decode steps")
    ap.add_argument("--replay", choices=["none", "all"], default="none", help="tau +inf (none) or -inf (all)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--profiled", type=int, default=20, help="last steps whose ORT profile events are counted")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="fastcar-prof-")
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = a.threads, 1
    so.enable_profiling, so.profile_file_prefix = True, str(Path(tmp) / "step")
    sess = FastCarSession(a.model, session_options=so, threads=a.threads, max_length=a.ctx + a.steps + 8)
    taus = np.full(len(sess.layers), -np.inf if a.replay == "all" else np.inf, np.float32)
    prompt = np.random.default_rng(0).integers(3, sess.vocab or 2, (1, a.ctx)).astype(np.int64)
    out = sess.step(sess.new_state(1), prompt, threshold=taus)
    state, ids = out.state, out.logits[:, -1].argmax(-1)[:, None]
    total, python = [], []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        out = sess.step(state, ids, threshold=taus, check=False)
        dt = time.perf_counter() - t0
        total.append(dt)
        python.append(dt - sess.last_ort_s)
        state, ids = out.state, out.logits[:, -1].argmax(-1)[:, None]
    tail = slice(a.steps // 4, None)
    print(f"{a.model} ctx {a.ctx} replay {a.replay}: {np.median(total[tail]) * 1e3:.2f} ms/step (median), "
          f"Python {np.median(python[tail]) * 1e3:.3f} ms/step outside ORT")
    events = json.loads(Path(sess.session.end_profiling()).read_text())
    runs = [e for e in events if e.get("name") == "model_run"]
    n = min(a.profiled, len(runs))
    start = runs[-n]["ts"]
    time_us, count = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= start:
            op = e["args"].get("op_name")
            time_us[op] += e["dur"]
            count[op] += 1
    print(f"kernel launches per step {sum(count.values()) / n:.0f}, kernel time {sum(time_us.values()) / n / 1e3:.2f} "
          f"ms/step (If includes its branch)")
    for op, us in time_us.most_common(a.top):
        print(f"  {op:36s} {us / n / 1e3:7.3f} ms  x{count[op] / n:.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
