"""A/B of compiled layouts on the genai benchmark's LLaMA: ms per decode step and kernel launches per step, at 0%
and 100% replay, for path (a) (a genai graph compiled by us, in og.Generator) and path (b) (the dynamo export
compiled with --fused-attention fastcar, in FastCarSession).

    python benchmarks/experiments/bench_row_layout.py --compile DIR [--nested]          # build one layout's models in DIR
    python benchmarks/experiments/bench_row_layout.py --models before=DIR1,after=DIR2 [--ctx 4096] [--tokens 48]

--compile uses the fastcar_compile that Python imports (run it from another checkout for a "before" build):
DIR/a-r0, DIR/a-r8 (onnxruntime-genai folders, tau +inf / -inf in all 8 layers), DIR/b/fast.onnx (per-layer tau
input). The sources are bench_genai.py's cached builder graph and dynamo export (`--cache`; build them with
`python benchmarks/bench_genai.py` once). Timing: every model is prefilled with the same `--ctx` tokens, then
the models decode in turn, `--block` tokens at a time after one untimed step (interleaved: machine load hits
them alike), lower quartile per model, ratios against the first `--models` entry of the same path and replay.
og.Generator folders get `--threads` and the current native library (bench_genai.set_session), so only the
graphs differ; `--cpu-time --threads 1` measures process CPU time (what a loaded machine disturbs least);
`--paths b` times (b) only. Besides the ratio of lower quartiles, the median (and IQR) of per-round ratios: each
round's block of a model against the same round's block of the first model, so slow drifts of the load cancel.
The first model created may pay for placement (seen: up to 1.3x between orders): run both orders.
Launches: ORT's profiler over FastCarSession steps of the same files (og.Generator has no per-node profile).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common and the suite scripts
import bench_genai  # noqa: E402
import profile_fused  # noqa: E402
from _common import (  # noqa: E402
    DEFAULT_CACHE,
    BadArgument,
    add_hugepage_flag,
    cached_export,
    interleave,
    lower_quartile_ms,
    ort_options,
    parse_models,
    reexec_with_hugepage_malloc,
)

LAYERS, FRAME_TOKENS = 8, 256
Key = tuple[str, str, str]  # (path "(a)"/"(b)", replay "0%"/"100%", model name): names may hold any character


def compile_models(out: Path, cache: Path, nested: bool) -> None:
    """DIR/a-r0, DIR/a-r8, DIR/b with the imported compiler (`nested`: shared_mlp=False, the pre-s4 layout)."""
    import fastcar_compile

    shape = bench_genai.FULL["shape"]
    kw = {"shared_mlp": False} if nested else {}
    src = bench_genai.build_genai(shape, cache) / "model.onnx"
    for k in (0, LAYERS):
        t0 = time.perf_counter()
        fastcar_compile.compile(src, out / f"a-r{k}" / "fast.onnx", frame_tokens=FRAME_TOKENS,
                                threshold=[np.inf if k == 0 else -np.inf] * LAYERS, per_layer_threshold=True, **kw)
        print(f"a-r{k}: {time.perf_counter() - t0:.0f} s ({fastcar_compile.__file__})", file=sys.stderr)
    fastcar_compile.compile(cached_export(shape, cache), out / "b" / "fast.onnx", frame_tokens=FRAME_TOKENS,
                            threshold=[np.inf] * LAYERS, per_layer_threshold=True, fused_attention="fastcar", **kw)


def timed(models: dict[str, Path], ctx: int, tokens: int, block: int, threads: int, vocab: int,
          cpu_time: bool = False, paths: str = "ab") -> dict[Key, list[float]]:
    """(path, replay, name) -> seconds per step of every (model, path, replay) combination, interleaved in blocks (rounds x block
    values, in order). cpu_time: process CPU time with spinning off (robust to other jobs on the machine; use 1
    thread). paths: which of (a) and (b) to run."""
    import onnxruntime_genai as og

    from fastcar_compile.runtime import FastCarSession

    entries = {"session.intra_op.allow_spinning": "0"} if cpu_time else {}
    rounds = -(-tokens // block)
    max_length = ctx + rounds * (block + 1) + 2
    prompt = np.random.default_rng(0).integers(3, vocab, (1, ctx)).astype(np.int32)
    gens: dict[Key, object] = {}
    keep = []
    for name, d in models.items():
        for replay, k in (("0%", 0), ("100%", LAYERS)) if "a" in paths else ():
            bench_genai.set_session(d / f"a-r{k}", threads, True, entries)  # threads, config, this library
            model = og.Model(str(d / f"a-r{k}"))
            params = og.GeneratorParams(model)
            params.set_search_options(max_length=max_length, do_sample=False)
            gen = og.Generator(model, params)
            gen.append_tokens(prompt)
            gen.generate_next_token()  # the first call only samples the token the prefill computed
            gens["(a)", replay, name] = gen
            keep.append(model)
        if "b" not in paths:
            continue
        sess = FastCarSession(d / "b" / "fast.onnx", session_options=ort_options(threads, spin=not cpu_time),
                              threads=threads, max_length=max_length)
        for replay, tau in (("0%", np.inf), ("100%", -np.inf)):
            gens["(b)", replay, name] = bench_genai.FusedStepper(sess, np.full(LAYERS, tau, np.float32), prompt)
        print(f"  {name}: prefilled {ctx} tokens", file=sys.stderr)
    return interleave({n: g.generate_next_token for n, g in gens.items()}, rounds, block,
                      clock=time.process_time if cpu_time else time.perf_counter)


def launches(models: dict[str, Path], threads: int) -> dict[Key, float]:
    """(path, replay, name) -> kernel launches per step (ORT's profiler, FastCarSession; ctx past one frame so tokens may replay:
    the counts do not depend on ctx)."""
    out = {}
    for name, d in models.items():
        for path, files in (("(a)", {"0%": d / "a-r0", "100%": d / f"a-r{LAYERS}"}), ("(b)", {"0%": d / "b", "100%": d / "b"})):
            for replay, folder in files.items():
                s = profile_fused.Stepper(folder / "fast.onnx", None, FRAME_TOKENS + 64, threads, replay == "100%", 8)
                for _ in range(6):
                    s.step()
                out[path, replay, name] = s.profile()[0]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)  # NO_HUGEPAGES whole
    add_hugepage_flag(ap)
    ap.add_argument("--compile", type=Path, help="build one layout's models in this folder and stop")
    ap.add_argument("--nested", action="store_true", help="with --compile: shared_mlp=False")
    ap.add_argument("--models", help="name=DIR,name=DIR,... (the first is the reference of the ratios)")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    ap.add_argument("--paths", default="ab", help="time path (a), (b) or both (ab)")
    ap.add_argument("--cpu-time", action="store_true", help="process CPU time per step, spinning off (with --threads 1)")
    a = ap.parse_args(argv)
    if a.compile:
        compile_models(a.compile, a.cache, a.nested)
        return 0
    if not a.models:
        ap.error("give --compile DIR or --models name=DIR,...")
    try:
        models = parse_models(a.models, files=False)
        if missing := [f"{n}={d}" for n, d in models.items() if not d.is_dir()]:
            raise BadArgument(f"--models: {', '.join(missing)} is not a folder; give folders built by --compile")
    except BadArgument as exc:
        print(f"bench_row_layout: {exc}", file=sys.stderr)
        return 2
    counts = launches(models, a.threads)  # (both paths: cheap at ctx 320)
    times = timed(models, a.ctx, a.tokens, a.block, a.threads, bench_genai.FULL["shape"].vocab, a.cpu_time, a.paths)
    ms = lower_quartile_ms(times)
    first = next(iter(models))
    clock = "process CPU time" if a.cpu_time else "wall time"
    print(f"ctx {a.ctx}, {a.threads} threads, {a.tokens} tokens per model, blocks of {a.block}, lower quartile of "
          f"{clock}")
    for key in ms:
        path, replay, name = key
        ref = (path, replay, first)
        # per round: the reference's lower quartile over this model's (paired blocks: slow drifts cancel)
        rounds = len(times[key]) // a.block
        pair = [np.percentile(r, 25) / np.percentile(m, 25) for r, m in
                zip(np.array_split(times[ref], rounds), np.array_split(times[key], rounds), strict=True)]
        print(f"{path} {replay:>4} {name:>10}: {ms[key]:7.2f} ms/step ({ms[ref] / ms[key]:.3f}x vs {first}; per-round "
              f"median {np.median(pair):.3f}, IQR {np.percentile(pair, 25):.3f}-{np.percentile(pair, 75):.3f}), "
              f"{counts[key]:.0f} launches/step ({counts[key] - counts[ref]:+.0f})")
    return 0


if __name__ == "__main__":
    # sessions created one after another in one process: huge pages for all alike (_common)
    reexec_with_hugepage_malloc(sys.argv[1:])
    raise SystemExit(main())
