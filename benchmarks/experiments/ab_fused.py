"""Interleaved A/B of path (b) compiles (dynamo export + fused attention, FastCarSession) against genai dense
(og.Generator on the builder's graph of the same weights): ms per decode step at 0% and 100% replay.

    python benchmarks/experiments/ab_fused.py --models plain=DIR1/fast.onnx,packed=DIR2/fast.onnx [--ctx 4096] [--tokens 32]

Every model is prefilled with the same `--ctx` tokens, then all decode in turn, `--block` tokens at a time after
one untimed step (machine load hits them alike); lower quartile per model; ratios = genai dense ms / model ms
(> 1: faster than genai dense) and against the first `--models` entry. The genai folder is bench_genai.py's
cached build (`--cache`; `python benchmarks/bench_genai.py` builds it once). Compile the models with per-layer
tau (the replay ratio is forced through the `fastcar_threshold` input), as bench_genai.py's fused_export does.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common and the suite scripts
import bench_genai  # noqa: E402
from _common import (  # noqa: E402
    DEFAULT_CACHE,
    BadArgument,
    add_hugepage_flag,
    interleave,
    lower_quartile_ms,
    ort_options,
    parse_models,
    reexec_with_hugepage_malloc,
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)  # NO_HUGEPAGES whole
    add_hugepage_flag(ap)
    ap.add_argument("--models", required=True, help="name=fast.onnx,... (the first is the reference of the A/B)")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    ap.add_argument("--cpu-time", action="store_true",
                    help="time steps in process CPU time (use with --threads 1: no pool spinning), which other "
                         "processes' load moves less than wall time")
    a = ap.parse_args(argv)
    try:
        models = parse_models(a.models)
    except BadArgument as exc:
        print(f"ab_fused: {exc}", file=sys.stderr)
        return 2
    import onnxruntime_genai as og

    from fastcar_compile.runtime import FastCarSession

    shape = bench_genai.FULL["shape"]
    rounds = -(-a.tokens // a.block)
    steps = rounds * (a.block + 1) + 2
    prompt = np.random.default_rng(0).integers(3, shape.vocab, (1, a.ctx)).astype(np.int32)
    folder = bench_genai.build_genai(shape, a.cache)
    bench_genai.set_session(folder, a.threads, native=False)
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=a.ctx + steps, do_sample=False)
    gens: dict[str, object] = {"genai dense": og.Generator(model, params)}
    gens["genai dense"].append_tokens(prompt)
    for name, path in models.items():
        sess = FastCarSession(path, session_options=ort_options(a.threads, spin=not a.cpu_time), threads=a.threads,
                              max_length=a.ctx + steps)
        layers = len(sess.layers)
        for replay, tau in (("0%", np.inf), ("100%", -np.inf)):
            gens[f"{name} {replay}"] = bench_genai.FusedStepper(sess, np.full(layers, tau, np.float32), prompt)
        print(f"  {name}: prefilled {a.ctx} tokens", file=sys.stderr)
    for gen in gens.values():
        gen.generate_next_token()
    clock = time.process_time if a.cpu_time else time.perf_counter
    # one untimed step per block brings the model's working set back
    ms = lower_quartile_ms(interleave({n: g.generate_next_token for n, g in gens.items()}, rounds, a.block,
                                      clock=clock))
    first = next(iter(models))
    print(f"ctx {a.ctx}, {a.threads} threads, {a.tokens} tokens per model, blocks of {a.block} (lower quartile"
          f"{', CPU time' if a.cpu_time else ''}); "
          f"genai dense {ms['genai dense']:.2f} ms/step")
    for key, value in ms.items():
        if key == "genai dense":
            continue
        name, replay = key.rsplit(" ", 1)
        ref = ms[f"{first} {replay}"]
        print(f"{name:>12} {replay:>4}: {value:7.2f} ms/step, {ms['genai dense'] / value:.3f}x genai dense, "
              f"{ref / value:.3f}x {first}")
    return 0


if __name__ == "__main__":
    # sessions created one after another in one process: huge pages for all alike (_common)
    reexec_with_hugepage_malloc(sys.argv[1:])
    raise SystemExit(main())
