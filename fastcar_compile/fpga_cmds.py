"""CLI subcommands of the FPGA backend: `sim`, `disasm`, `asm` (registered in commands.SUBCOMMANDS)."""

from __future__ import annotations

import argparse
import json
import sys

from fastcar_compile.errors import FastCarError


def _sim_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fastcar-compile sim",
                                description="Simulate a .fcb bundle program on a replay trace or synthetic masks.")
    p.add_argument("fcb", help="bundle file from `fastcar-compile fast.onnx --target fpga -o model.fcb`")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--replay-trace", help="run.json recorded by the runtime (per step, per layer, per row 0/1)")
    src.add_argument("--replay-ratio", type=float, help="synthetic masks with this replay ratio (0-1); default 0")
    p.add_argument("--mask", choices=["random", "clustered"], default="random", help="synthetic mask kind")
    p.add_argument("--batch", type=int, help="rows to simulate (<= the batch the program was compiled for)")
    p.add_argument("--steps", type=int, default=8, help="synthetic decode steps (default 8)")
    p.add_argument("--context", type=int, help="KV length for synthetic steps (default: the compiled one)")
    p.add_argument("--seed", type=int, default=0, help="synthetic mask seed")
    p.add_argument("--board", help="board preset to simulate on (must have the program's cores and buffers)")
    p.add_argument("--board-file", help="JSON file overriding board figures (clock, bandwidth, efficiency, ...)")
    p.add_argument("--policy", choices=["static", "drs", "both"], default="both", help="dispatch policy")
    p.add_argument("--weights", choices=["broadcast", "per_core"],
                   help="weight streams: one broadcast to all cores, or one per core (default: the mode the "
                        "program's DRS thresholds were compiled for)")
    p.add_argument("--timeline", help="write a per-core timeline PNG of the first step, one panel per policy")
    p.add_argument("--timeline-layers", type=int, default=3, help="decoder layers drawn in the timeline (0: all)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    return p


def sim_main(argv: list[str]) -> int:
    args = _sim_parser().parse_args(argv)
    import numpy as np

    from fastcar_compile.fpga_backend import encode, masks
    from fastcar_compile.fpga_backend.hwspec import load_board
    from fastcar_compile.fpga_backend.simulate import Simulator, plot_timeline

    if args.batch is not None and not 1 <= args.batch <= 32:
        raise FastCarError(f"--batch must be in 1..32 (rows of the Index Register), got {args.batch}")
    if args.context is not None and not 1 <= args.context <= 2**32 - 1:
        raise FastCarError(f"--context must be in 1..{2**32 - 1} (KV length of a synthetic step), got {args.context}")
    if args.timeline:
        from fastcar_compile.fileio import check_output_path

        check_output_path(args.timeline, "--timeline")
    program = encode.load(args.fcb)
    board = None
    if args.board or args.board_file:
        board = load_board(args.board or program.board, args.board_file)
    sim = Simulator(program, board)
    layers = sim.num_layers
    compiled_for = program.meta.get("drs_weights", "broadcast")
    args.weights = args.weights or compiled_for
    if args.weights != compiled_for:
        print(f"note: DRS remap thresholds were compiled for {compiled_for} weight streams; DRS decisions may be "
              f"suboptimal with {args.weights}", file=sys.stderr)
    if args.replay_trace:
        replay, ctx, batch = masks.load_trace(args.replay_trace, layers)
        if args.batch is not None and args.batch != batch:
            raise FastCarError(f"--batch {args.batch} disagrees with the trace's batch {batch}")
        source = f"trace {args.replay_trace} ({replay.shape[0]} steps)"
        ignored = sorted(set(np.flatnonzero(replay.any(axis=(0, 2))).tolist()) - set(sim.replayable_layers))
        if ignored:
            print(f"note: the trace replays layers {ignored}, which this program computes densely; ignored",
                  file=sys.stderr)
    else:
        batch = sim.batch if args.batch is None else args.batch
        if not 1 <= args.steps <= 1_000_000:
            raise FastCarError(f"--steps must be in 1..1000000, got {args.steps}")
        ratio = 0.0 if args.replay_ratio is None else args.replay_ratio
        replay = masks.synthetic(ratio, batch, layers, args.steps, kind=args.mask, seed=args.seed,
                                 replayable=frozenset(sim.replayable_layers))
        ctx = int(program.meta["context"]) if args.context is None else args.context
        source = f"synthetic {args.mask} masks, ratio {ratio:g}, {args.steps} steps, context {ctx}"
    policies = ["static", "drs"] if args.policy == "both" else [args.policy]
    results = {}
    for pol in policies:
        results[pol] = sim.run(replay, ctx, policy=pol, stream=args.weights, batch=batch,
                               timeline=bool(args.timeline), progress=replay.shape[0] > 64)
    if args.timeline:
        plot_timeline(list(results.values()), args.timeline, title=f"{sim.board.name} batch {batch}, {source}",
                      layers=args.timeline_layers)
    out = {pol: r.to_dict() for pol, r in results.items()}
    if len(results) == 2:
        out["drs_speedup_over_static"] = results["static"].cycles / results["drs"].cycles
    if args.json:
        json.dump({"source": source, **out}, sys.stdout, indent=2)
        print()
        return 0
    print(f"board {sim.board.name}, batch {batch}, {source}, weights {args.weights}")
    for pol, r in results.items():
        d = r.to_dict()
        dram = sum(d["dram_bytes_per_step"].values())
        print(f"  {pol:>6}: {d['cycles_per_step']:.0f} cycles/step ({d['ms_per_step']:.3f} ms), "
              f"{d['tokens_per_s']:.1f} tokens/s, utilisation {d['utilisation']:.1%}, {d['bound']}-bound, "
              f"replay {d['replay_ratio']:.1%}")
        print(f"          DRAM {dram / 1e6:.2f} MB/step ({d['dram_gbps_used']:.2f} GB/s), "
              f"energy {d['energy_j_per_step']['total'] * 1e3:.3f} mJ/step, DRS remaps {d['drs_remaps']}")
        busy = " ".join(f"{b:.0%}" for b in d["core_busy"])
        stall = " ".join(f"{s:.0%}" for s in d["core_stall"])
        print(f"          core busy [{busy}]  stall [{stall}]")
    print("  energy = MACs x pJ/MAC + DRAM/SRAM bytes x pJ/B + static W x time; figures and assumptions: "
          f"board file ({sim.board.pj_per_mac} pJ/MAC, {sim.board.pj_per_dram_byte} pJ/B DRAM, "
          f"{sim.board.static_watts} W static), --json for the list")
    if "drs_speedup_over_static" in out:
        print(f"  DRS speedup over static: {out['drs_speedup_over_static']:.3f}x")
    if args.timeline:
        print(f"  wrote {args.timeline}")
    return 0


def disasm_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="fastcar-compile disasm", description="Print a .fcb file as assembly.")
    p.add_argument("fcb")
    p.add_argument("-o", "--output", help="write to this file (atomically) instead of stdout")
    args = p.parse_args(argv)
    from fastcar_compile.atomic import write_text
    from fastcar_compile.fpga_backend import asm, encode

    program = encode.load(args.fcb)
    if args.output:
        from fastcar_compile.fileio import check_output_path, same_file

        check_output_path(args.output, "-o")
        if same_file(args.fcb, args.output):
            raise FastCarError(f"-o {args.output} is the bundle file being read; choose another output path")
        write_text(args.output, asm.disassemble(program))
        return 0
    try:
        for line in asm.disassemble_lines(program):
            sys.stdout.write(line + "\n")
    except BrokenPipeError:  # `| head`
        sys.stderr.close()
    return 0


def asm_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="fastcar-compile asm", description="Assemble text into a .fcb file.")
    p.add_argument("source", help="assembly text (as printed by disasm)")
    p.add_argument("-o", "--output", required=True, help="bundle file to write")
    args = p.parse_args(argv)
    from fastcar_compile.fileio import check_output_path, read_text, same_file
    from fastcar_compile.fpga_backend import asm, encode
    from fastcar_compile.fpga_backend.verify import check_program

    check_output_path(args.output, "-o")
    if same_file(args.source, args.output):
        raise FastCarError(f"-o {args.output} is the assembly source; choose another output path")
    program = asm.assemble(read_text(args.source, "assembly file"))
    check_program(program)  # what sim would refuse is never written
    size = encode.save(program, args.output)
    print(f"wrote {args.output} ({len(program)} bundles, {size} bytes)")
    return 0
