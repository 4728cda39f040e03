"""`fastcar-compile sim MODEL.fcb --replay-trace run.json`: the FPGA backend's simulator on a replay trace or
synthetic masks."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

from fastcar_compile.core import options
from fastcar_compile.core.errors import FastCarError
from fastcar_compile.core.options import ascii_float, ascii_int


def board_presets() -> str:
    """The shipped board presets (fpga_backend/boards/*.json, what hwspec.PRESETS loads) for help texts, listed
    without importing the backend: its import costs a second on every command line."""
    spec = importlib.util.find_spec("fastcar_compile.fpga_backend")
    if spec is None or not spec.submodule_search_locations:
        return "see docs/fpga.md"
    boards = Path(next(iter(spec.submodule_search_locations)), "boards")
    return ", ".join(sorted(p.stem for p in boards.glob("*.json")))


def _sim_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fastcar-compile sim",
                                description="Simulate a .fcb bundle program on a replay trace or synthetic masks.")
    p.add_argument("fcb", help="bundle file from `fastcar-compile fast.onnx --target fpga -o model.fcb`")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--replay-trace", help="run.json recorded by the runtime (per step, per layer, per row 0/1)")
    src.add_argument("--replay-ratio", type=ascii_float, help="synthetic masks with this replay ratio (0-1); default 0")
    p.add_argument("--mask", choices=["random", "clustered"], default="random", help="synthetic mask kind")
    p.add_argument("--batch", type=ascii_int, help="rows to simulate (<= the batch the program was compiled for)")
    p.add_argument("--steps", type=ascii_int, default=8, help="synthetic decode steps (default 8)")
    p.add_argument("--context", type=ascii_int, help="KV length for synthetic steps (default: the compiled one)")
    p.add_argument("--seed", type=ascii_int, default=0, help="synthetic mask seed")
    p.add_argument("--board", help=f"board preset to simulate on ({board_presets()}); must have the program's "
                                   "cores and buffers")
    p.add_argument("--board-file", help="JSON file overriding board figures (clock, bandwidth, efficiency, ...)")
    p.add_argument("--policy", choices=["static", "drs", "both"], default="both", help="dispatch policy")
    p.add_argument("--weights", choices=["broadcast", "per_core"],
                   help="weight streams: one broadcast to all cores, or one per core (default: the mode the "
                        "program's DRS thresholds were compiled for)")
    p.add_argument("--timeline", help="write a per-core timeline PNG of one decode step, one panel per policy")
    p.add_argument("--timeline-step", type=ascii_int,
                   help="step drawn in the timeline (default: a representative one, whose replay is closest to "
                        "the run's mean; frame 0, where nothing replays, only when nothing replays at all)")
    p.add_argument("--timeline-layers", type=ascii_int, default=0,
                   help="draw only the first N decoder layers (default 0: all, each labelled)")
    p.add_argument("--baseline", metavar="DENSE.fcb",
                   help="the same model compiled with --dense: simulated on the same steps and contexts, "
                        "to print 'x dense' speed-ups")
    options.add_arguments(p, SIM_KV)
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    return p


def main(argv: list[str]) -> int:
    args = _sim_parser().parse_args(argv)
    _check_sim_args(args)
    from fastcar_compile.fpga_backend import encode
    from fastcar_compile.fpga_backend.hwspec import load_board
    from fastcar_compile.fpga_backend.simulate import Simulator

    program = encode.load(args.fcb)
    board = load_board(args.board or program.board, args.board_file) if args.board or args.board_file else None
    sim = Simulator(program, board)
    _pick_weights(args, program)
    replay, ctx, batch, source, video_start = _replay_source(args, program, sim)
    kv_len, source = _kv_lengths(args, program, sim.num_layers, replay, ctx, source)
    step = representative_step(replay[:, sorted(sim.replayable_layers), :batch]) if args.timeline_step is None \
        else args.timeline_step
    if not 0 <= step < replay.shape[0]:
        raise FastCarError(f"--timeline-step {step} is outside the {replay.shape[0]} steps")
    policies = ["static", "drs"] if args.policy == "both" else [args.policy]
    results = {pol: sim.run(replay, ctx, policy=pol, stream=args.weights, batch=batch, timeline=bool(args.timeline),
                            progress=replay.shape[0] > 64, timeline_step=step, kv_len=kv_len) for pol in policies}
    if args.timeline:
        _draw_timeline(args, sim, results, replay, batch, source, step)
    out = {pol: r.to_dict() for pol, r in results.items()}
    out["video_start"] = video_start
    if len(results) == 2:
        out["drs_speedup_over_static"] = results["static"].cycles / results["drs"].cycles
    if args.baseline:
        out.update(_against_baseline(args, board, sim.num_layers, replay, ctx, batch, results))
    if args.json:
        json.dump({"source": source, **out}, sys.stdout, indent=2)
        print()
        return 0
    _print_results(args, sim, results, out, batch, source, video_start, step)
    return 0


# sim's bounded KV cache: the compiler's --kv-budget/--kv-sinks/--kv-window (the same bounds), unset by default
# (the model's own record applies); without --kv-budget, the last W tokens plus the sinks (local attention)
SIM_KV = tuple(dataclasses.replace(options.BY_NAME[name], default=None, group="bounded KV cache (overrides the one "
                                   "the model records for every layer; without --kv-budget: local attention)")
               for name in ("kv_budget", "kv_sinks", "kv_window"))


def _check_sim_args(args: argparse.Namespace) -> None:
    """The numbers sim takes, each refused in one line when out of range, and the outputs' paths."""
    from fastcar_compile.core.limits import INT64_MAX, check_int
    from fastcar_compile.fpga_backend import isa

    if args.batch is not None:
        check_int("--batch", args.batch, 1, isa.MAX_ROWS, "rows of the Index Register")
    if args.context is not None:
        check_int("--context", args.context, 1, isa.MAX_CONTEXT, "KV length of a synthetic step")
    check_int("--seed", args.seed, 0, INT64_MAX)
    check_int("--timeline-layers", args.timeline_layers, 0, isa.MAX_LAYERS, "0 draws every layer")
    if args.timeline:
        from fastcar_compile.core.fileio import check_output_path, check_outputs

        check_output_path(args.timeline, "--timeline")
        check_outputs({args.timeline: "--timeline"}, {args.fcb: "the bundle", args.replay_trace: "--replay-trace",
                                                      args.board_file: "--board-file", args.baseline: "--baseline"})


def _pick_weights(args: argparse.Namespace, program) -> None:
    """--weights: the mode the program's DRS thresholds were compiled for unless given (a note when another)."""
    compiled_for = program.meta.get("drs_weights", "broadcast")
    args.weights = args.weights or compiled_for
    if args.weights != compiled_for:
        print(f"note: DRS remap thresholds were compiled for {compiled_for} weight streams; DRS decisions may be "
              f"suboptimal with {args.weights}", file=sys.stderr)


def _replay_source(args: argparse.Namespace, program, sim):
    """The replay masks [steps, layers, rows] simulated, their context, rows, a description and video_start:
    from --replay-trace (the runtime's run.json) or synthetic masks."""
    from fastcar_compile.fpga_backend import masks

    video_start = int(program.meta["model"].get("video_start", 0))
    layers = sim.num_layers
    if not args.replay_trace:
        batch = sim.batch if args.batch is None else args.batch
        if not 1 <= args.steps <= 1_000_000:
            raise FastCarError(f"--steps must be in 1..1000000, got {args.steps}")
        ratio = 0.0 if args.replay_ratio is None else args.replay_ratio
        replay = masks.synthetic(ratio, batch, layers, args.steps, kind=args.mask, seed=args.seed,
                                 replayable=frozenset(sim.replayable_layers))
        ctx = int(program.meta["context"]) if args.context is None else args.context
        return replay, ctx, batch, f"synthetic {args.mask} masks, ratio {ratio:g}, {args.steps} steps, context " \
            f"{ctx}", video_start
    import numpy as np

    replay, ctx, batch = masks.load_trace(args.replay_trace, layers)
    used = masks.trace_video_start(args.replay_trace)
    if used is not None and used != video_start:
        if program.meta.get("video_start_known") is True:  # given at compile time, and not the run's
            print(f"note: the trace's run used video_start {used} but the program was compiled for "
                  f"{video_start}; simulating the trace's (recompile with --video-start {used} so the bundle "
                  "records it)", file=sys.stderr)
        video_start = used
    if args.batch is not None and args.batch != batch:
        raise FastCarError(f"--batch {args.batch} disagrees with the trace's batch {batch}")
    if batch > sim.batch:
        raise FastCarError(f"the trace has {batch} rows (videos decoded at once), more than the {sim.batch} "
                           f"{args.fcb} was compiled for; compile it with --batch {batch}")
    if batch < sim.batch and args.batch is None:  # fill the bundle's rows: its schedule is for sim.batch
        print(f"note: the trace has {batch} row(s), the bundle was compiled for batch {sim.batch}: its rows are "
              f"repeated to fill {sim.batch} (videos with the same replay); --batch {batch} simulates "
              f"{batch} row(s)", file=sys.stderr)
        replay = np.take(replay, np.arange(sim.batch) % batch, axis=2)
        batch = sim.batch
    ignored = sorted(set(np.flatnonzero(replay.any(axis=(0, 2))).tolist()) - set(sim.replayable_layers))
    if ignored:
        print(f"note: the trace replays layers {ignored}, which this program computes densely; ignored",
              file=sys.stderr)
    return replay, ctx, batch, f"trace {args.replay_trace} ({replay.shape[0]} steps)", video_start


def _kv_lengths(args: argparse.Namespace, program, layers: int, replay, ctx, source: str):
    """The KV length each step's attention reads per layer (None: the context) and the description with it:
    the model's recorded compressed cache, or the --kv-* override."""
    import numpy as np

    from fastcar_compile.fpga_backend.kvbound import KVBound, describe, kv_lengths, recorded_bounds

    bounds = recorded_bounds(program.meta, layers)
    if any(v is not None for v in (args.kv_window, args.kv_budget, args.kv_sinks)):
        from fastcar_compile.fastar.config import KVCompressConfig

        # the compiler's value object checks them (its bounds, budget > sinks + window); the simulator reads its size
        kv = KVCompressConfig(budget=args.kv_budget, sinks=args.kv_sinks or 0, window=args.kv_window or 0)
        bound = KVBound(budget=kv.budget, sinks=kv.sinks, window=kv.window)
        was = f"compressed: {describe(bounds)}" if bounds else "dense"
        print(f"note: --kv-* override the KV cache the model records ({was}): every layer reads at most "
              f"{bound.capacity} slots (sinks {bound.sinks}, window {bound.window})", file=sys.stderr)
        bounds = dict.fromkeys(range(layers), bound)
    if not bounds:
        return None, source
    steps = np.broadcast_to(np.asarray(ctx, np.int64), (replay.shape[0],))
    return kv_lengths(steps, layers, per_layer=bounds), f"{source}, KV bounded to {describe(bounds)}"


def _draw_timeline(args: argparse.Namespace, sim, results: dict, replay, batch: int, source: str, step: int) -> None:
    from fastcar_compile.fpga_backend.simulate import plot_timeline

    share = replay[step][sorted(sim.replayable_layers), :batch].mean() if sim.replayable_layers else 0.0
    plot_timeline(list(results.values()), args.timeline,
                  title=f"{sim.board.name} batch {batch}, {source}; step {step} ({100 * share:.0f}% replayed)",
                  layers=args.timeline_layers)


def _against_baseline(args: argparse.Namespace, board, layers: int, replay, ctx, batch: int, results: dict) -> dict:
    """--baseline: the dense program simulated on the same steps and contexts; its cycles and each policy's x."""
    import numpy as np

    from fastcar_compile.fpga_backend import encode
    from fastcar_compile.fpga_backend.simulate import Simulator

    base = Simulator(encode.load(args.baseline), board)
    if base.replayable_layers:
        raise FastCarError(f"--baseline {args.baseline} has FastCar instructions; compile it with --dense")
    if base.num_layers != layers:
        raise FastCarError(f"--baseline has {base.num_layers} layers, the program {layers}")
    b = base.run(np.zeros_like(replay), ctx, policy="static", stream=args.weights, batch=batch)
    return {"dense_cycles": b.cycles, **{f"{pol}_x_dense": b.cycles / r.cycles for pol, r in results.items()}}


def _print_results(args: argparse.Namespace, sim, results: dict, out: dict, batch: int, source: str,
                   video_start: int, step: int) -> None:
    kind = "dense baseline (no FastCar instructions)" if not sim.replayable_layers else "FastCar"
    print(f"board {sim.board.name}, batch {batch}, {source}, weights {args.weights}; {kind} program, "
          f"video_start {video_start}")
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
    if args.baseline:
        print("  x dense (" + args.baseline + "): " + ", ".join(f"{pol} {out[f'{pol}_x_dense']:.3f}x"
                                                             for pol in results))
    if args.timeline:
        print(f"  wrote {args.timeline} (step {step})")


def representative_step(replay) -> int:
    """The decode step whose replay share is closest to the run's mean (ties: the middle one); steps where
    nothing replays (frame 0) only when nothing replays anywhere."""
    import numpy as np

    if replay.size == 0 or replay.shape[1] == 0:
        return 0
    share = replay.reshape(replay.shape[0], -1).mean(axis=1)
    cand = np.flatnonzero(share > 0) if share.max() > 0 else np.arange(len(share))
    gap = np.abs(share[cand] - share[cand].mean())
    best = cand[gap == gap.min()]
    return int(best[len(best) // 2])
