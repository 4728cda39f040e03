"""Does an ORT session config entry make onnxruntime-genai's decode faster? Same run, interleaved A/B.

bench_genai.py's baseline must be the fastest dense decode a user can get, so an entry that speeds up genai's
dense step (e.g. `session.disable_prepacking=1`: MLAS' prepacked SGEMM vs its M = 1 path) goes into every
variant there. This times each variant (genai dense, without MLPs, FastCar at 0% and 100% replay) with and
without the entries in og.Generator, `--block` tokens at a time in turn (bench_genai.measure), and prints the
lower-quartile ms/token and the ratio with / without per variant.

    python benchmarks/experiments/ab_genai_session_config.py --contexts 1024,4096 session.disable_prepacking=1
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common and the suite scripts
import bench_genai  # noqa: E402
from _common import DEFAULT_CACHE, lower_quartile_ms  # noqa: E402


def twin(folder: Path, dst: Path) -> Path:
    """`folder`'s files linked into `dst` (genai_config.json copied, so its session options can differ)."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in folder.iterdir():
        target = dst / f.name
        if f.name == "genai_config.json":
            shutil.copyfile(f, target)
        elif f.is_file() and f.suffix != ".so" and not target.exists():  # set_session copies the kernels
            target.symlink_to(f.resolve())
    return dst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("entries", nargs="+", metavar="session.KEY=VALUE")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--contexts", help="comma-separated contexts (default: bench_genai's)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--variants", default="dense,noMLP,r0,rall")
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    a = ap.parse_args(argv)
    entries = bench_genai.parse_entries(a.entries)
    cfg = dict(bench_genai.QUICK if a.quick else bench_genai.FULL)
    shape = cfg["shape"]
    src = bench_genai.build_genai(shape, a.cache)
    work = a.cache / f"genai-variants-{shape.tag()}-L{cfg['frame_tokens']}"
    base = bench_genai.variants(src, work, shape.layers, cfg["frame_tokens"])
    names = [f"r{shape.layers}" if n == "rall" else n for n in a.variants.split(",")]
    folders = {}
    for name in names:
        folders[name] = twin(base[name], work / "ab" / f"{name}-off")
        folders[f"{name}+cfg"] = twin(base[name], work / "ab" / f"{name}-on")
        bench_genai.set_session(folders[name], a.threads, True, {})
        bench_genai.set_session(folders[f"{name}+cfg"], a.threads, True, entries)
    contexts = [int(c) for c in a.contexts.split(",")] if a.contexts else list(cfg["contexts"])
    for ctx in contexts:
        times, _ = bench_genai.measure(folders, ctx, a.tokens, shape.vocab, None, shape.layers, a.threads, a.block)
        p25 = lower_quartile_ms(times)
        print(f"\nctx {ctx}, {a.threads} threads, {a.tokens} tokens, lower quartile ms/token; with = {entries}")
        print("| variant | without | with | with / without |")
        print("|---|---:|---:|---:|")
        for name in names:
            print(f"| {name} | {p25[name]:.2f} | {p25[name + '+cfg']:.2f} | {p25[name + '+cfg'] / p25[name]:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
