"""Sweep the FPGA simulator: DRS vs static and FastCar vs dense over replay ratio, batch, board, mask kind.

    python benchmarks/experiments/fpga_sweep.py                     # LLaMA-2-7B (VILA-U backbone) dims, all boards
    python benchmarks/experiments/fpga_sweep.py --model tiny --quick # seconds

Prints a markdown table (also written to --out-dir/fpga_sweep.md with the JSON and a PNG). Speedups are
ratios of simulated cycles measured in the same run.
"dense" is the same model compiled without FastCar (no TAS, no replay-cache traffic).
The paper's FastCar (U280, VILA-U 7B) reports 1.24x / 1.45x / 1.76x over dense at 20 / 50 / 80 % replay.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from fastcar_compile.core.atomic import write_bytes
from fastcar_compile.fpga_backend import LLAMA2_7B, TINY, build_program, load_board
from fastcar_compile.fpga_backend import masks as M
from fastcar_compile.fpga_backend.simulate import Simulator

PAPER = {0.2: 1.24, 0.5: 1.45, 0.8: 1.76}


def sweep(model: str, boards: list[str], batches: list[int], ratios: list[float], kinds: list[str], steps: int,
          context: int, stream: str) -> list[dict]:
    spec = LLAMA2_7B if model == "7b" else TINY
    rows = []
    jobs = [(b, n) for b in boards for n in batches]
    for board, batch in tqdm(jobs, desc="board x batch", unit="program"):
        cfg = load_board(board)
        sim = Simulator(build_program(spec, cfg, batch=batch, context=context, weights=stream))
        # dense baseline: the same model compiled without FastCar (no TAS, no replay-cache traffic)
        plain = Simulator(build_program(dataclasses.replace(spec, replay_layers=()), cfg, batch=batch, context=context))
        dense = plain.run(np.zeros((steps, spec.layers, batch), bool), context, policy="static", stream=stream)
        fastcar0 = sim.run(np.zeros((steps, spec.layers, batch), bool), context, policy="drs", stream=stream)
        for kind in kinds:
            for ratio in ratios:
                replay = M.synthetic(ratio, batch, spec.layers, steps, kind=kind, seed=17)
                st = sim.run(replay, context, policy="static", stream=stream)
                dr = sim.run(replay, context, policy="drs", stream=stream)
                rows.append({
                    "board": board, "batch": batch, "mask": kind, "replay_target": ratio,
                    "replay": dr.replay_ratio, "dense_ms": 1e3 * dense.seconds / steps,
                    "static_ms": 1e3 * st.seconds / steps, "drs_ms": 1e3 * dr.seconds / steps,
                    "static_vs_dense": dense.cycles / st.cycles, "drs_vs_dense": dense.cycles / dr.cycles,
                    "drs_vs_static": st.cycles / dr.cycles, "util_static": st.utilisation, "util_drs": dr.utilisation,
                    "bound_dense": dense.bound, "bound_drs": dr.bound, "tokens_s_drs": dr.tokens_per_s,
                    "remaps": dr.remaps, "fastcar_overhead": fastcar0.cycles / dense.cycles - 1,
                })
    return rows


def table(rows: list[dict], kind: str) -> str:
    out = ["| board | batch | replay | dense ms/step | bound dense / DRS | static x | DRS x | DRS/static | util static "
           "| util DRS | paper x |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["mask"] != kind:
            continue
        paper = PAPER.get(r["replay_target"])
        out.append(
            f"| {r['board']} | {r['batch']} | {r['replay']:.0%} | {r['dense_ms']:.2f} | {r['bound_dense']} / "
            f"{r['bound_drs']} | "
            f"{r['static_vs_dense']:.2f} | {r['drs_vs_dense']:.2f} | {r['drs_vs_static']:.3f} | "
            f"{r['util_static']:.0%} | {r['util_drs']:.0%} | {paper if paper and r['board'] == 'u280' else ''} |"
        )
    return "\n".join(out)


def plot(rows: list[dict], path: Path, boards: list[str], kinds: list[str]) -> None:
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(boards), figsize=(4.2 * len(boards), 7), squeeze=False)
    for j, board in enumerate(boards):
        sub = [r for r in rows if r["board"] == board and r["mask"] == kinds[-1]]
        for batch in sorted({r["batch"] for r in sub}):
            pts = sorted((r["replay"], r["drs_vs_dense"], r["drs_vs_static"]) for r in sub if r["batch"] == batch)
            x = [p[0] for p in pts]
            axes[0, j].plot(x, [p[1] for p in pts], marker="o", label=f"batch {batch}")
            axes[1, j].plot(x, [p[2] for p in pts], marker="o", label=f"batch {batch}")
        axes[0, j].plot(list(PAPER), list(PAPER.values()), "k*", ms=10, label="paper (U280)")
        axes[0, j].set_title(f"{board}: FastCar+DRS vs dense ({kinds[-1]} masks)", fontsize=9)
        axes[1, j].set_title(f"{board}: DRS vs static", fontsize=9)
        for i in range(2):
            axes[i, j].set_xlabel("replay ratio")
            axes[i, j].grid(alpha=0.3)
        axes[0, j].set_ylabel("speedup (x)")
        axes[1, j].set_ylabel("speedup (x)")
        top = max([r["drs_vs_static"] for r in sub] + [1.0])
        axes[1, j].set_ylim(0.98, max(1.1, top * 1.03))  # no offset axis: a 1.0004x gain must look like 1.0
        axes[1, j].ticklabel_format(axis="y", useOffset=False)
    axes[0, 0].legend(fontsize=7)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    write_bytes(path, buf.getvalue())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["7b", "tiny"], default="7b")
    p.add_argument("--boards", default="kv260,zcu102,u280")
    p.add_argument("--batches", default="1,4,8,16,32")
    p.add_argument("--ratios", default="0.2,0.5,0.8,0.87")
    p.add_argument("--masks", default="random,clustered")
    p.add_argument("--steps", type=int, default=2, help="synthetic steps per point")
    p.add_argument("--context", type=int, default=1152, help="KV length (8 frames x 256 + prompt: mid-video)")
    p.add_argument("--weights", choices=["broadcast", "per_core"], default="broadcast")
    p.add_argument("--quick", action="store_true", help="2 boards, batches 1 and 8, ratios 0.5 and 0.8")
    p.add_argument("--table-only", action="store_true", help="re-print the tables from a JSON this script wrote")
    p.add_argument("--out-dir", default="fastcar-out/bench", help="where the .md/.json/.png go")
    a = p.parse_args(argv)
    boards = a.boards.split(",")
    batches = [int(x) for x in a.batches.split(",")]
    ratios = [float(x) for x in a.ratios.split(",")]
    kinds = a.masks.split(",")
    if a.quick:
        boards, batches, ratios = boards[:1] + boards[-1:], [1, 8], [0.5, 0.8]
    t0 = time.perf_counter()
    stem = f"fpga_sweep_{a.model}_{a.weights}"
    if a.table_only:
        rows = json.loads((Path(a.out_dir) / f"{stem}.json").read_text())
        kinds = [k for k in M.MASK_KINDS if any(r["mask"] == k for r in rows)]
        print("\n\n".join(f"### {k} masks\n\n{table(rows, k)}" for k in kinds))
        boards = list(dict.fromkeys(r["board"] for r in rows))
        plot(rows, Path(a.out_dir) / f"{stem}.png", boards, kinds)
        return 0
    rows = sweep(a.model, boards, batches, ratios, kinds, a.steps, a.context, a.weights)
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md = [f"Model {a.model}, context {a.context}, weights {a.weights}, {a.steps} steps per point; x = speedup over dense."]
    for kind in kinds:
        md += ["", f"### {kind} masks", "", table(rows, kind)]
    text = "\n".join(md) + "\n"
    print(text)
    write_bytes(out / f"{stem}.md", text.encode())
    write_bytes(out / f"{stem}.json", json.dumps(rows, indent=1).encode())
    plot(rows, out / f"{stem}.png", boards, kinds)
    print(f"wrote {out / stem}.{{md,json,png}} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
