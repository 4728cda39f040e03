"""FastCarSession's Python per decode step (step time outside ORT) for two versions of runtime/session.py, in one
process on one compiled model: interleaved blocks, so machine load hits both alike; the tokens must agree.

    git show 797a7e9:runtime/session.py > /tmp/old_session.py
    python benchmarks/experiments/ab_session.py /tmp/old_session.py FAST_ONNX [--ctx 1024] [--replay none|all]

OLD is loaded as a module of its own (its imports resolve against the installed fastcar_compile); the other
side is the installed FastCarSession. Prints the median Python ms per step of each and their ratio.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common and the suite scripts
from _common import interleave, lower_quartile_ms  # noqa: E402


def load_session_class(path: Path):
    """FastCarSession from a session.py file (registered in sys.modules under a name of its own)."""
    spec = importlib.util.spec_from_file_location("fastcar_ab_session", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"{path} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module.FastCarSession


class Decoder:
    """One session prefilled with the prompt, stepping greedily at forced replay; Python seconds per step."""

    def __init__(self, cls, model: Path, ctx: int, steps: int, replay_all: bool, threads: int):
        self.sess = cls(model, threads=threads, max_length=ctx + steps + 8)
        self.taus = np.full(len(self.sess.layers), -np.inf if replay_all else np.inf, np.float32)
        prompt = np.random.default_rng(0).integers(3, self.sess.vocab, (1, ctx)).astype(np.int64)
        out = self.sess.step(self.sess.new_state(1), prompt, threshold=self.taus)
        self.state, self.ids = out.state, out.logits[:, -1].argmax(-1)[:, None]
        self.python: list[float] = []
        self.tokens: list[int] = []

    def step(self) -> None:
        t0 = time.perf_counter()
        out = self.sess.step(self.state, self.ids, threshold=self.taus, check=False)
        self.python.append(time.perf_counter() - t0 - self.sess.last_ort_s)
        self.state, self.ids = out.state, out.logits[:, -1].argmax(-1)[:, None]
        self.tokens.append(int(self.ids[0, 0]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", type=Path, help="the other runtime/session.py")
    ap.add_argument("model", type=Path, help="a compiled fast.onnx (path (b): --fused-attention, shared KV)")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--replay", choices=["none", "all"], default="none")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--block", type=int, default=8)
    a = ap.parse_args(argv)
    from fastcar_compile.runtime import FastCarSession

    steps = a.rounds * (a.block + 1)
    runs = {name: Decoder(cls, a.model, a.ctx, steps, a.replay == "all", a.threads)
            for name, cls in (("old", load_session_class(a.old)), ("installed", FastCarSession))}
    times = interleave({n: r.step for n, r in runs.items()}, a.rounds, a.block)
    if runs["old"].tokens != runs["installed"].tokens:
        raise SystemExit("the two sessions decoded different tokens")
    py = {n: float(np.median(r.python)) * 1e3 for n, r in runs.items()}
    step_ms = lower_quartile_ms(times)
    for name in runs:
        print(f"{name:9s}: Python {py[name]:.3f} ms/step outside ORT (median of {len(runs[name].python)}), "
              f"step {step_ms[name]:.2f} ms (lower quartile)")
    print(f"installed / old Python per step: {py['installed'] / py['old']:.3f} ({a.model}, ctx {a.ctx}, replay "
          f"{a.replay}, same tokens)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
