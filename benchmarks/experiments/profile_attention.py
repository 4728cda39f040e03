"""The attention op's time per call inside the genai benchmark's two decode steps, same run: (a) genai's graph with
ai.fastcar.GroupQueryAttention (`denseN` of bench_genai.py) and (b) the fused dynamo export with
ai.fastcar.CompressedAttention, both running the dense core (runtime/native/dense_attention.h RunDense).

Why per call and by median: the ORT profiler's per-op mean on this shared machine is dominated by preempted calls
(mean ~2x median), and a per-op table of one model says nothing about the other's core. Variants (any subset, in
turn, --block steps each per round, interleaved so load hits them alike):
- `a`: (a) bound like profile_genai (one KV buffer per layer bound as past and present, filled with random data);
- `b`: (b) bound the same way (the same KV contents and layout as `a`: the two ops' cores compared alone);
- `bP`: (b) run by FastCarSession after a real `--ctx`-token prefill (the benchmark's own path);
- `aZ`, `bZ`: `a` / `b` with np.zeros KV buffers, never written: every untouched page maps the kernel's one zero
  page, so the attention reads its K/V from L1 (what profile_genai measured before `--kv random`).
`--libs OLD.so,NEW.so` runs each variant once per kernel build (`a@old`, ...; FASTCAR_NATIVE per session).
Prints per variant: median / lower-quartile attention time per call, x layers per step, and the step's lower quartile.

    python benchmarks/experiments/profile_attention.py --ctx 1024 --variants a,b,bP,aZ,bZ
    python benchmarks/experiments/profile_attention.py --ctx 4096 --variants a,bP --libs OLD.so,NEW.so --names old,new
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common and the suite scripts
import bench_genai  # noqa: E402
import profile_fused  # noqa: E402
import profile_genai  # noqa: E402
from _common import DEFAULT_CACHE, interleave, lower_quartile_ms  # noqa: E402

ATTENTION = ("GroupQueryAttention", "CompressedAttention")


class IoStep:
    """One profiled ORT session stepping one decode token with profile_genai's IO binding."""

    def __init__(self, path: Path, ctx: int, threads: int, zeros: bool, head_dim: int, vocab: int):
        self.session = profile_genai._session(path, threads, True, True)
        self.io, self._keep = profile_genai._binding(self.session, ctx, ctx + 8, head_dim, vocab, zeros=zeros)

    def step(self) -> None:
        self.session.run_with_iobinding(self.io)


class SessionStep:
    """FastCarSession on (b) after a real prefill (profile_fused's Stepper, tau +inf: no replay)."""

    def __init__(self, path: Path, ctx: int, threads: int, steps: int):
        self.stepper = profile_fused.Stepper(path, None, ctx, threads, False, steps)  # replay_all False
        self.session = self.stepper.sess.session

    def step(self) -> None:
        self.stepper.step()


def attention_us(session, runs: int) -> np.ndarray:
    """Per-call kernel times (us) of the attention op over the last `runs` model runs of a profiled session."""
    events = json.loads(Path(session.end_profiling()).read_text())
    start = [e for e in events if e.get("name") == "model_run"][-runs]["ts"]
    return np.array([e["dur"] for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")
                     and e["ts"] >= start and e["args"].get("op_name") in ATTENTION], float)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--variants", default="a,b,bP", help="comma-separated: a, b, bP, aZ, bZ")
    ap.add_argument("--libs", help="comma-separated kernel libraries (default: the current build)")
    ap.add_argument("--names", help="names for --libs (default: the file stems)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--block", type=int, default=5)
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    a = ap.parse_args(argv)
    cfg, shape = bench_genai.FULL, bench_genai.FULL["shape"]
    model_a = a.cache / f"genai-variants-{shape.tag()}-L{cfg['frame_tokens']}" / "denseN" / "model.onnx"
    model_b = a.cache / f"fused-fastcar-{shape.tag()}-L{cfg['frame_tokens']}-fz" / "fast.onnx"
    for m in (model_a, model_b):
        if not m.is_file():
            print(f"profile_attention: {m} is missing; run benchmarks/bench_genai.py once to build it", file=sys.stderr)
            return 2
    libs: list[str | None] = a.libs.split(",") if a.libs else [None]
    names = a.names.split(",") if a.names else [Path(x).stem if x else "" for x in libs]
    if len(names) != len(libs):
        ap.error("--names: give one name per --libs entry")
    kinds = [v.strip() for v in a.variants.split(",")]
    if not set(kinds) <= {"a", "b", "bP", "aZ", "bZ"}:
        ap.error("--variants: choose from a, b, bP, aZ, bZ")
    steps = a.rounds * (a.block + 1)
    runs = {}
    for lib, lname in zip(libs, names, strict=True):
        if lib is not None:
            os.environ["FASTCAR_NATIVE"] = lib
        for kind in kinds:
            label = f"{kind}@{lname}" if lname else kind
            if kind == "bP":
                runs[label] = SessionStep(model_b, a.ctx, a.threads, steps + 2)
            else:
                runs[label] = IoStep(model_a if kind[0] == "a" else model_b, a.ctx, a.threads, kind.endswith("Z"),
                                     shape.head_dim, shape.vocab)
    # one untimed step per block: the others ran in between
    step_ms = lower_quartile_ms(interleave({n: r.step for n, r in runs.items()}, a.rounds, a.block))
    print(f"ctx {a.ctx}, {a.threads} threads, {a.rounds} x {a.block} steps per variant (interleaved); attention "
          f"per call (us) and x {shape.layers} layers per step (ms)")
    first = None
    for n, r in runs.items():
        us = attention_us(r.session, steps)
        med = float(np.median(us))
        first = first or med
        print(f"  {n:10s} median {med:7.1f}  lq {np.percentile(us, 25):7.1f}  mean {us.mean():7.1f}  "
              f"-> {med * shape.layers / 1e3:.3f} ms/step ({med / first:.2f}x the first)  step lq "
              f"{step_ms[n]:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
