"""Process memory (VmRSS) of a compiled model vs the dense model it came from, each in a fresh child process.

The LLaMA of bench_genai.py (hidden 1024, 8 layers, 16/2 heads, MLP 3072, ~378 MB of fp32 weights), as
(a) onnxruntime-genai's builder graph and (b) the torch dynamo export, dense and compiled by fastcar-compile
(tau=+inf; (b) with --fused-attention fastcar), run by onnxruntime-genai's `og.Generator` (genai folders) or
`FastCarSession` (plain ONNX Runtime, 2 threads). `-nested` variants are compiled with shared_mlp=False and (b)'s
saved with inline weights: the layout before docs/memory.md's fix, where ORT held every MLP weight twice.
Each child reports VmRSS after imports, after loading, after a prefill of --ctx tokens + --steps decode steps,
and the peak (VmHWM).

    python benchmarks/memory_footprint.py                  # ~3 min on 2 cores (models built once, cached)
    python benchmarks/memory_footprint.py --quick          # bench_genai's small LLaMA
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DEFAULT_CACHE, cached_export, save_results  # noqa: E402
from bench_genai import FULL, QUICK, build_genai, mark_fresh, set_session, stale  # noqa: E402

from fastcar_compile.core.atomic import write_text  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20


def _status() -> dict[str, int]:
    """VmRSS / VmHWM of this process in bytes (Linux /proc)."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key = line.split(":", 1)[0]
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(line.split()[1]) * 1024
    return out


def child(job: dict) -> None:
    """Load one model, prefill, decode; print the RSS at each stage as one JSON line."""
    rss = {"start": _status()["VmRSS"]}
    prompt = np.random.default_rng(0).integers(3, job["vocab"], (1, job["ctx"]))
    if job["runner"] == "og":
        import onnxruntime_genai as og

        model = og.Model(job["path"])
        rss["loaded"] = _status()["VmRSS"]
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=job["ctx"] + job["steps"] + 2, do_sample=False)
        gen = og.Generator(model, params)
        gen.append_tokens(prompt.astype(np.int32))
        for _ in range(job["steps"]):
            gen.generate_next_token()
    else:
        from fastcar_compile.runtime import FastCarSession

        sess = FastCarSession(job["path"], threads=job["threads"])
        rss["loaded"] = _status()["VmRSS"]
        out = sess.step(sess.new_state(1), prompt)
        for _ in range(job["steps"]):
            out = sess.step(out.state, out.logits[:, -1].argmax(-1)[:, None], check=False)
    st = _status()
    rss["decoded"], rss["peak"] = st["VmRSS"], st["VmHWM"]
    print(json.dumps(rss), flush=True)


def _inline(src: Path, dst: Path) -> None:
    """`src` saved as one file with inline weights (how compiled dynamo exports were written before)."""
    import onnx

    dst.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(onnx.load(str(src)), str(dst))


def prepare(cfg: dict, cache: Path, threads: int) -> dict[str, tuple[str, Path]]:
    """variant -> (runner, model path); compiled variants are rebuilt when the compiler's sources changed."""
    import fastcar_compile

    shape, layers, ft = cfg["shape"], cfg["shape"].layers, cfg["frame_tokens"]
    genai = build_genai(shape, cache)
    export = cached_export(shape, cache)
    work = cache / f"memory-{shape.tag()}-L{ft}"
    taus = [np.inf] * layers
    out: dict[str, tuple[str, Path]] = {}
    for shared in (True, False):
        tag = "" if shared else "-nested"
        comp = work / f"genai{tag}" / "fast.onnx"
        if stale(comp):
            fastcar_compile.compile(genai / "model.onnx", comp, frame_tokens=ft, threshold=taus,
                                    per_layer_threshold=True, shared_mlp=shared, video_start=0)  # run by og
            mark_fresh(comp)
        set_session(comp.parent, threads, native=True)
        fused = work / f"dynamo{tag}" / "fast.onnx"
        if stale(fused):
            fastcar_compile.compile(export, fused, frame_tokens=ft, threshold=taus, per_layer_threshold=True,
                                    fused_attention="fastcar", shared_mlp=shared)
            if not shared:
                _inline(fused, work / "dynamo-nested-inline" / "fast.onnx")
            mark_fresh(fused)
        out[f"(a) genai compiled{tag} [og]"] = ("og", comp.parent)
        out[f"(a) genai compiled{tag} [ort]"] = ("ort", comp)
        out[f"(b) dynamo fastcar{tag}{'-inline' if not shared else ''} [ort]"] = (
            "ort", fused if shared else work / "dynamo-nested-inline" / "fast.onnx")
    set_session(genai, threads, native=False)
    return {"(a) genai dense [og]": ("og", genai), "(a) genai dense [ort]": ("ort", genai / "model.onnx"),
            "(b) dynamo export [ort]": ("ort", export), **dict(sorted(out.items()))}


def run_all(variants: dict[str, tuple[str, Path]], ctx: int, steps: int, vocab: int, threads: int) -> list[dict]:
    from tqdm import tqdm

    rows = []
    for name, (runner, path) in tqdm(variants.items(), desc="variants", file=sys.stderr):
        job = dict(runner=runner, path=str(path), ctx=ctx, steps=steps, vocab=vocab, threads=threads)
        proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(job)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
        rows.append({"variant": name, "runner": runner, "path": str(path),
                     **json.loads(proc.stdout.strip().splitlines()[-1])})
    return rows


def table(rows: list[dict]) -> str:
    dense = {"(a)": next(r for r in rows if r["variant"] == "(a) genai dense [ort]"),
             "(b)": next(r for r in rows if r["variant"] == "(b) dynamo export [ort]")}
    dense_og = next(r for r in rows if r["variant"] == "(a) genai dense [og]")
    out = ["| variant | loaded MiB | after decode MiB | peak MiB | loaded - dense (same runner) |",
           "|---|---:|---:|---:|---:|"]
    for r in rows:
        ref = dense_og if r["runner"] == "og" else dense[r["variant"][:3]]
        out.append(f"| {r['variant']} | {r['loaded'] / MIB:.0f} | {r['decoded'] / MIB:.0f} | {r['peak'] / MIB:.0f} | "
                   f"{(r['loaded'] - ref['loaded']) / MIB:+.0f} ({r['loaded'] / ref['loaded']:.2f}x) |")
    return "\n".join(out)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.2))
    names = [r["variant"] for r in rows][::-1]
    ax.barh(names, [r["decoded"] / MIB for r in rows][::-1], color="#9ecae1", label="after decode")
    ax.barh(names, [r["loaded"] / MIB for r in rows][::-1], color="#3182bd", label="after load")
    ax.set_xlabel("process VmRSS (MiB)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="bench_genai's small LLaMA")
    ap.add_argument("--ctx", type=int, default=256, help="prompt tokens (default 256)")
    ap.add_argument("--steps", type=int, default=8, help="decode steps after the prompt (default 8)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    ap.add_argument("--out", type=Path, default=Path("fastcar-out/bench/memory_footprint.json"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(json.loads(args.child))
        return 0
    cfg = QUICK if args.quick else FULL
    variants = prepare(cfg, args.cache, args.threads)
    rows = run_all(variants, args.ctx, args.steps, cfg["shape"].vocab, args.threads)
    text = table(rows)
    print(text)
    out = args.out if not args.quick else args.out.with_name(args.out.stem + "_quick.json")
    write_text(out.with_suffix(".md"), f"`{' '.join(['python benchmarks/memory_footprint.py', *(argv or sys.argv[1:])])}`\n\n{text}\n")
    plot(rows, out.with_suffix(".png"))
    return save_results(out, {"shape": str(cfg["shape"]), "ctx": args.ctx, "steps": args.steps,
                              "threads": args.threads, "rows": rows})


if __name__ == "__main__":
    raise SystemExit(main())
