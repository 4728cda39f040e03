"""The DRS dispatcher's RTL against the simulator, its resources, and the dense bandwidth bound.

    python benchmarks/fpga_rtl.py --out DIR            # everything (~15-25 min on 2 cores, builds included)
    python benchmarks/fpga_rtl.py --out DIR --quick    # kv260 only, no 7B runs, no synthesis

1. Co-simulation matrix: every board preset x batch 1 / 16 x replay 0 / 50 / 100% (clustered masks, 2 decode
   steps each) of a small LLaMA-shaped decoder (modelspec.SMALL_LLAMA), static and DRS policies, through the
   RTL under Verilator + cocotb and through the Python simulator: cycles per step on each side, whether every
   bundle, operation, per-core cycle count and byte agreed (the mismatch count), operations issued, remaps.
2. The DRS-over-static speed-up of LLaMA-2-7B dims on the U280 at batch 32 (clustered 50 / 80% replay, one
   step each), measured on the RTL and in the simulator.
3. The dense bound: a dense LLaMA-2-7B-shaped (VILA-U-7B backbone) int4 decode on the KV260 preset, batch 1,
   context 256: tokens/s against the DRAM bandwidth bound (bytes a step moves / 19.2 GB/s), and the RTL's
   cycles for the same step.
4. The loader against the decoder on fuzzed files (tests/fcb_fuzz.py mutations): verdicts compared.
5. yosys synthesis of the DRS unit for the KV260 and U280 presets: LUT, FF, BRAM, DSP against the device.
Writes fpga_rtl.json into --out.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import numpy as np

from fastcar_compile.core.atomic import write_text
from fastcar_compile.fpga_backend import LLAMA2_7B, SMALL_LLAMA, build_program, encode, load_board, masks
from fastcar_compile.fpga_backend.hwspec import PRESETS
from fastcar_compile.fpga_backend.rtl import cosim, synth

QUIET = lambda m: None  # noqa: E731


def matrix(boards: list[str]) -> list[dict]:
    rows = []
    for board in boards:
        cfg = load_board(board)
        for batch in (1, 16):
            program = build_program(SMALL_LLAMA, cfg, batch=batch, context=48)
            for ratio in (0.0, 0.5, 1.0):
                replay = masks.synthetic(ratio, batch, SMALL_LLAMA.layers, 2, kind="clustered", seed=7)
                rep = cosim.cosimulate(program, replay, np.array([48, 49]), log=QUIET)
                s, d = rep.policies["static"], rep.policies["drs"]
                rows.append({"board": board, "batch": batch, "replay": ratio,
                             "static_rtl": np.mean(s.rtl_cycles), "static_sim": np.mean(s.sim_cycles),
                             "drs_rtl": np.mean(d.rtl_cycles), "drs_sim": np.mean(d.sim_cycles),
                             "mismatches": len(rep.mismatches), "issued": s.issued + d.issued,
                             "remaps": f"{d.remaps_rtl}/{d.remaps_sim}", "drs_speedup_rtl": rep.speedup()[0],
                             "drs_speedup_sim": rep.speedup()[1], "bundles": len(program),
                             "label": f"{board} b{batch} {ratio:.0%}"})
                print(f"  {rows[-1]['label']}: static {rows[-1]['static_rtl']:.0f} / {rows[-1]['static_sim']:.0f}, "
                      f"drs {rows[-1]['drs_rtl']:.0f} / {rows[-1]['drs_sim']:.0f} cycles, "
                      f"{rows[-1]['mismatches']} mismatches", file=sys.stderr)
    return rows


def speedup() -> list[dict]:
    program = build_program(LLAMA2_7B, load_board("u280"), batch=32, context=1152)
    out = []
    for ratio in (0.5, 0.8):
        replay = masks.synthetic(ratio, 32, LLAMA2_7B.layers, 1, kind="clustered", seed=0)
        rep = cosim.cosimulate(program, replay, 1152, log=QUIET)
        s, d = rep.policies["static"], rep.policies["drs"]
        out.append({"replay": ratio, "static_rtl": s.rtl_cycles[0], "drs_rtl": d.rtl_cycles[0],
                    "static_sim": s.sim_cycles[0], "drs_sim": d.sim_cycles[0], "speedup_rtl": rep.speedup()[0],
                    "speedup_sim": rep.speedup()[1], "mismatches": len(rep.mismatches), "remaps": d.remaps_rtl})
        print(f"  u280 7B b32 {ratio:.0%}: DRS/static {out[-1]['speedup_rtl']:.3f} RTL, {out[-1]['speedup_sim']:.3f} "
              "simulator", file=sys.stderr)
    return out


def dense_bound(context: int = 256) -> dict:
    board = load_board("kv260")
    program = build_program(LLAMA2_7B, board, batch=1, context=context, dense=True, weight_bits=4)
    from fastcar_compile.fpga_backend.simulate import Simulator

    res = Simulator(program).run(np.zeros((1, LLAMA2_7B.layers, 1), bool), context, policy="static")
    moved = sum(res.dram_bytes.values())
    bound = board.dram_gbps * 1e9 / moved
    rest = moved - res.dram_bytes["weights"]  # KV, activations: the mixed-traffic rate
    effective = 1.0 / (res.dram_bytes["weights"] / (board.dram_gbps * 1e9 * board.dram_stream_efficiency)
                       + rest / (board.dram_gbps * 1e9 * board.dram_efficiency))
    rep = cosim.cosimulate(program, np.zeros((1, LLAMA2_7B.layers, 1), bool), context, policies=("static",),
                           log=QUIET)
    return {"context": context, "tokens_per_s": res.tokens_per_s, "bound_tokens_per_s": bound,
            "share_of_bound": res.tokens_per_s / bound, "dram_efficiency": board.dram_efficiency,
            "dram_stream_efficiency": board.dram_stream_efficiency,
            "share_of_effective_bound": res.tokens_per_s / effective,
            "weights_gb": res.dram_bytes["weights"] / 1e9, "kv_gb": res.dram_bytes["kv"] / 1e9,
            "sim_cycles": res.cycles, "rtl_cycles": rep.policies["static"].rtl_cycles[0],
            "mismatches": len(rep.mismatches), "bundles": len(program)}


def loader(n: int) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import fcb_fuzz

    board = load_board("kv260")
    rng = np.random.default_rng(2)
    progs = fcb_fuzz.base_programs()
    files = [encode.encode(p) for p in progs] + [fcb_fuzz.mutate(progs[i % 2], rng) for i in range(n)]
    want = [cosim.reference_verdict(f, board) for f in files]
    sent = [f for f, w in zip(files, want, strict=True) if w is not None]
    got = cosim.loader_verdicts(board, sent, log=QUIET)
    expected = [w for w in want if w is not None]
    agree = sum(tuple(g) == w for g, w in zip(got, expected, strict=True))
    refused = sum(w[0] != 0 for w in expected)
    return {"files": len(files), "host_side": len(files) - len(sent), "compared": len(sent), "agree": agree,
            "refused": refused}


def synthesis(boards: list[str]) -> list[dict]:
    rows = []
    for board in boards:
        cfg = load_board(board)
        counts = synth.synthesize(cfg, log=QUIET)
        rows += synth.table_rows(cfg, counts)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    t0 = time.time()
    out: dict = {}
    boards = ["kv260"] if a.quick else sorted(PRESETS)
    print("co-simulation matrix", file=sys.stderr)
    out["matrix"] = matrix(boards)
    out["loader"] = loader(100 if a.quick else 1000)
    if not a.quick:
        print("7B U280 batch 32 DRS speed-up", file=sys.stderr)
        out["speedup"] = speedup()
        print("dense int4 7B on the KV260", file=sys.stderr)
        out["dense"] = dense_bound()
        print("yosys synthesis", file=sys.stderr)
        out["synth"] = synthesis(["kv260", "u280"])
    child = resource.getrusage(resource.RUSAGE_CHILDREN)
    out["seconds"] = time.time() - t0
    out["child_cpu_seconds"] = child.ru_utime + child.ru_stime
    Path(a.out).mkdir(parents=True, exist_ok=True)
    write_text(Path(a.out) / "fpga_rtl.json", json.dumps(out, indent=1, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
