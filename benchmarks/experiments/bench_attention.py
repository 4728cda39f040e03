"""Fused attention variants side by side: ORT's GroupQueryAttention (`--fused-attention gqa`) vs the ai.fastcar
CompressedAttention native kernel (`--fused-attention fastcar`) vs the exported attention kept (`none`, today's
default: growing cache, Concat + transpose per step), per decode token, in one run.

Same seeded LLaMA as benchmarks/bench_genai.py (hidden 1024, 8 layers, 16 heads / 2 KV heads, MLP 3072; dynamo
export, cached), compiled three times with per-layer tau; the fused ones run in FastCarSession with a shared KV buffer
(max_length: the buffer is bound as past and present and written in place), `none` with the growing cache; batch 1, `--threads` intra-op
threads, at forced replay 0% (every MLP computed) and 100% (every MLP replayed: the step is mostly attention).
For each context all four sessions are prefilled with the same tokens, then decode in turn, `--block` tokens at
a time after one untimed step (interleaved, so load hits them alike); per-token time = lower quartile.
Also recorded: whether each variant runs a 2-token step after the prompt at batch 2 (ORT's GQA refuses it).

    python benchmarks/experiments/bench_attention.py                  # ctx 1024 and 4096
    python benchmarks/experiments/bench_attention.py --quick          # small model, ctx 256
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common and the suite scripts
from _common import (  # noqa: E402
    DEFAULT_CACHE,
    add_hugepage_flag,
    hugepage_malloc_record,
    interleave,
    lower_quartile_ms,
    ms_lists,
    reexec_with_hugepage_malloc,
    save_results,
)
from bench_genai import FULL, QUICK, FusedStepper, fused_export  # noqa: E402

KINDS = ("gqa", "fastcar", "none")


def multi_token_ok(sess, vocab: int) -> str:
    """'ok' when a 2-token step after the prompt runs at batch 2, else the first line of the refusal."""
    rng = np.random.default_rng(1)
    try:
        out = sess.step(sess.new_state(2), rng.integers(3, vocab, (2, 5)))
        sess.step(out.state, rng.integers(3, vocab, (2, 2)))
        return "ok"
    except Exception as exc:  # the refusal is the result here
        return str(exc).splitlines()[0][-160:]


def measure(paths: dict[str, Path], ctx: int, tokens: int, vocab: int, layers: int, threads: int,
            block: int) -> tuple[dict[str, list[float]], dict[str, float], dict[str, str]]:
    from fastcar_compile.runtime import FastCarSession

    rounds = -(-tokens // block)
    steps = rounds * (block + 1)
    prompt = np.random.default_rng(0).integers(3, vocab, (1, ctx))
    gens, checks = {}, {}
    for kind, path in paths.items():
        shared = {} if kind == "none" else {"max_length": ctx + steps + 4}
        sess = FastCarSession(path, threads=threads, **shared)
        checks[kind] = multi_token_ok(FastCarSession(path, threads=threads, **({} if kind == "none" else
                                                                                {"max_length": 64})), vocab)
        for replay in (0, layers):
            taus = np.full(layers, -np.inf if replay else np.inf, np.float32)
            t0 = time.perf_counter()
            gens[f"{kind}-r{replay}"] = FusedStepper(sess, taus, prompt)
            print(f"  ctx {ctx}: {kind} replay {replay}/{layers} prefilled in {time.perf_counter() - t0:.1f} s",
                  file=sys.stderr)
    times = interleave({n: g.generate_next_token for n, g in gens.items()}, rounds, block)
    python = {n: float(np.median(g.python_s)) * 1e3 for n, g in gens.items()}
    return times, python, checks


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)  # NO_HUGEPAGES whole
    add_hugepage_flag(ap)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--contexts", help="comma-separated contexts (default: 1024,4096; quick: 256)")
    ap.add_argument("--tokens", type=int, default=32, help="decode tokens timed per variant")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    ap.add_argument("--out", type=Path, default=Path("fastcar-out/bench/bench_attention.json"))
    a = ap.parse_args(argv)
    cfg = dict(QUICK if a.quick else FULL)
    contexts = [int(c) for c in a.contexts.split(",")] if a.contexts else list(cfg["contexts"])
    shape = cfg["shape"]
    paths = {k: fused_export(shape, a.cache, cfg["frame_tokens"], None if k == "none" else k) for k in KINDS}
    results = {"shape": shape.tag(), "threads": a.threads, "tokens": a.tokens, **hugepage_malloc_record(),
               "contexts": {}}
    for ctx in contexts:
        times, python, checks = measure(paths, ctx, a.tokens, shape.vocab, shape.layers, a.threads, a.block)
        q25 = lower_quartile_ms(times)
        print(f"\nctx {ctx}, {a.threads} threads, {a.tokens} tokens (lower quartile ms/token, Python per step)")
        print("| replay | none (exported attention) | gqa | fastcar | fastcar / gqa | fastcar / none |")
        print("|---:|---:|---:|---:|---:|---:|")
        for r in (0, shape.layers):
            g, f, u = q25[f"gqa-r{r}"], q25[f"fastcar-r{r}"], q25[f"none-r{r}"]
            print(f"| {r / shape.layers:.0%} | {u:.2f} ({python[f'none-r{r}']:.2f}) | {g:.2f} "
                  f"({python[f'gqa-r{r}']:.2f}) | {f:.2f} ({python[f'fastcar-r{r}']:.2f}) | {f / g:.3f} | "
                  f"{f / u:.3f} |")
        for kind, verdict in checks.items():
            print(f"2-token step after the prompt at batch 2, {kind}: {verdict}")
        results["contexts"][str(ctx)] = {"ms": q25, "python_ms": python, "multi_token_batch2": checks,
                                         "raw_ms": ms_lists(times)}
    return save_results(a.out, results)


if __name__ == "__main__":
    # sessions created one after another in one process: huge pages for all alike (_common)
    reexec_with_hugepage_malloc(sys.argv[1:])
    sys.exit(main())
