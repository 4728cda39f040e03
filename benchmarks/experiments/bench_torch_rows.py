"""Row compaction at batch > 1: one decode step with 0, half or all rows replaying, per runtime.

At batch 1 a step replays all rows or none, so bench_torch.py never sees compaction. Here one seeded random
LLaMA-style decoder (benchmarks/_common.py) runs a decode step at batch B with the replaying rows forced
through the state (tau = -inf replays every eligible row; a row whose slot age is -1 is not eligible and
computes), in three runtimes: PyTorch eager (`fastcar_compile.torch.build`), torch.compile of the same program
(nested torch.cond, compacted rows through `fastcar::compact_branch`) and ONNX Runtime on its `to_onnx`
output (BranchPass's compacted If). Without compaction half-replaying rows would cost as much as none;
`saved` = (t_none - t_half) / ((t_none - t_all) / 2) is 1 when half the rows save half of what replaying every
row saves. All configurations run interleaved; medians over rounds of wall and process CPU time (with one
thread CPU time is what the step itself used, less disturbed by other processes on a loaded machine).
Writes bench_torch_rows.json/.png.

    python benchmarks/experiments/bench_torch_rows.py --threads 1            # hidden 1024, 8 layers, batch 8, context 256
    python benchmarks/experiments/bench_torch_rows.py --quick --no-compile   # small model, smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common and the suite scripts
from _common import LlamaShape, build_random_llama, make_session  # noqa: E402

FULL = dict(shape=LlamaShape(max_pos=2048), context=256, frame_tokens=256)
QUICK = dict(shape=LlamaShape(hidden=256, layers=4, heads=4, kv_heads=2, intermediate=704, vocab=512, max_pos=1024),
             context=128, frame_tokens=64)


def step_inputs(dec, batch: int, context: int, computing: int) -> list:
    """Program inputs of one decode step where the first `computing` rows compute and the others replay."""
    import torch

    g = torch.Generator().manual_seed(0)
    hkv, d = dec.kv_shape
    args = [torch.randint(0, 100, (batch, 1), generator=g), torch.ones(batch, context + 1, dtype=torch.int64),
            torch.full((batch, 1), context)]
    args += [torch.randn(batch, hkv, context, d, generator=g) for _ in range(dec.num_kv)]
    args += [torch.tensor(0), torch.tensor(-math.inf)]
    ages = torch.tensor([-1] * computing + [0] * (batch - computing))[:, None].expand(batch, dec.frame_tokens)
    for _ in dec.layers:
        args += [torch.randn(batch, dec.frame_tokens, dec.hidden, generator=g), ages.contiguous()]
    return args


def plot(rows: list[dict], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fastcar_compile.core.atomic import save_figure

    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    for rt in dict.fromkeys(r["runtime"] for r in rows):
        pts = [r for r in rows if r["runtime"] == rt and r["time"] == "cpu"]
        ax.plot([100 * r["replaying_rows"] for r in pts], [r["ms"] for r in pts], "o-", label=rt)
    ax.set_xlabel("rows replaying (%)")
    ax.set_ylabel("CPU ms per decode step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small model (hidden 256, 4 layers), context 128")
    ap.add_argument("--out", type=Path, default=Path("fastcar-out/bench"), help="folder for the .json/.png")
    ap.add_argument("--threads", type=int, default=1, help="torch and ORT intra-op threads (default 1)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, help="past tokens (default 256, --quick 128); at least --frame-tokens")
    ap.add_argument("--frame-tokens", type=int, help="L (default 256, --quick 64)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile (it takes minutes on 2 cores)")
    a = ap.parse_args(argv)
    if a.batch < 2 or a.batch % 2:
        ap.error("--batch must be even and >= 2 (half the rows replay)")

    import torch
    from tqdm import tqdm

    import fastcar_compile.torch as fct
    from fastcar_compile.core.atomic import write_text
    from fastcar_compile.torch.onnx_export import io_names

    torch.set_num_threads(a.threads)
    preset = QUICK if a.quick else FULL
    shape, context, L, B = preset["shape"], a.context or preset["context"], a.frame_tokens or preset["frame_tokens"], a.batch
    if context < L:
        ap.error(f"--context {context} < L {L}: no token has a previous frame to replay")
    dec = fct.build(build_random_llama(shape), frame_tokens=L, threshold=-math.inf)
    fns = {"torch eager": dec.program}
    if not a.no_compile:
        fns["torch.compile"] = torch.compile(dec.program, dynamic=True)
    with tempfile.TemporaryDirectory() as tmp:
        print("lowering with to_onnx ...", file=sys.stderr)
        fct.to_onnx(dec, Path(tmp) / "fast.onnx")
        sess = make_session(Path(tmp) / "fast.onnx", a.threads, spin=False)
    in_names = {i.name for i in sess.get_inputs()} | {i.name for i in sess.get_overridable_initializers()}
    ort_names = io_names(dec)[0]  # the program's input order

    def ort_fn(*args):
        return sess.run(None, {n: v.numpy() for n, v in zip(ort_names, args, strict=True) if n in in_names})

    fns["ORT (to_onnx)"] = ort_fn
    cases = {c: step_inputs(dec, B, context, c) for c in (B, B // 2, 0)}  # computing rows
    with torch.no_grad():  # the forced pattern really replays: B - c rows in every layer
        for c, args in cases.items():
            replay = dec.program(*args)[1 + dec.num_kv + 2 * len(dec.layers)::2]
            assert all(int(r.sum()) == B - c for r in replay), (c, [int(r.sum()) for r in replay])
    configs = [(rt, c) for rt in fns for c in cases]
    times: dict = {k: [] for k in configs}
    cpu: dict = {k: [] for k in configs}
    with torch.no_grad():
        for rt, c in tqdm(configs, desc="warm-up (torch.compile compiles here)"):
            fns[rt](*cases[c])
            fns[rt](*cases[c])
        for _ in tqdm(range(a.rounds), desc=f"timing {len(configs)} configs", unit="round"):
            for rt, c in configs:
                c0, t0 = time.process_time(), time.perf_counter()
                fns[rt](*cases[c])
                times[(rt, c)].append(1e3 * (time.perf_counter() - t0))
                cpu[(rt, c)].append(1e3 * (time.process_time() - c0))
    rows = []
    title = (f"LLaMA-style h{shape.hidden} x{shape.layers}, ctx {context}, batch {B}, CPU {a.threads} threads, "
             f"{a.rounds} interleaved rounds")
    print(f"\n{title}\n{'runtime':<15} {'time':<5} {'none replay':>12} {'half':>8} {'all':>8} {'saved':>6}")
    for rt in fns:
        for kind, data in (("wall", times), ("cpu", cpu)):
            ms = {c: float(np.median(data[(rt, c)])) for c in cases}
            for c in cases:
                rows.append({"runtime": rt, "time": kind, "replaying_rows": (B - c) / B, "ms": ms[c]})
            saved = (ms[B] - ms[B // 2]) / ((ms[B] - ms[0]) / 2)
            print(f"{rt:<15} {kind:<5} {ms[B]:12.2f} {ms[B // 2]:8.2f} {ms[0]:8.2f} {saved:6.2f}")
    a.out.mkdir(parents=True, exist_ok=True)
    write_text(a.out / "bench_torch_rows.json", json.dumps({"title": title, "rows": rows}, indent=1))
    plot(rows, title, a.out / "bench_torch_rows.png")
    print(f"wrote {a.out / 'bench_torch_rows.json'} and {a.out / 'bench_torch_rows.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
