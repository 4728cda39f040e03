"""`fastcar-compile model.onnx -o fast.onnx ...`: the compiler's command line."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from fastcar_compile.cli import registry
from fastcar_compile.cli.sim import board_presets
from fastcar_compile.core import contract, options
from fastcar_compile.core.errors import FastCarError
from fastcar_compile.core.limits import INT64_MAX, check_int

MAX_CALIB_FRAMES = 4096  # frames per calibration prompt: far beyond what a calibration needs

# Options whose value may start with '-' (argparse takes `--threshold -1e30` / `-inf` for an option).
_NEGATIVE_OK = ("--threshold",)


def _join_negative_values(argv: list[str]) -> list[str]:
    """`--threshold -1e30` -> `--threshold=-1e30` when the value reads as numbers."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] in _NEGATIVE_OK and i + 1 < len(argv) and argv[i + 1].startswith("-") \
                and options.read_thresholds(argv[i + 1]) is not None:
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def build_parser() -> argparse.ArgumentParser:
    sub = registry.help_lines()
    p = argparse.ArgumentParser(
        prog="fastcar-compile",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Compile an exported AR video decoder (ONNX, with KV cache) so that it replays cached MLP "
                    "outputs for tokens whose temporal attention score (TAS) exceeds a threshold (FastCar).",
        epilog=f"other commands (each has --help):\n{sub}",
    )
    p.add_argument("model", help="input .onnx decoder (I/O: input_ids, attention_mask, position_ids, "
                                 "past_key_values.N.key|value -> logits, present.N.key|value); never modified")
    p.add_argument("-o", "--output", help="output path (.onnx, or .fcb with --target fpga); written atomically")
    options.add_arguments(p)  # every compile option (fastcar_compile/core/options.py)
    p.add_argument("--inspect", action="store_true",
                   help="only report what discovery finds per layer (and why a layer does not match) and, with -v, "
                        "the plan a compile with the options given would build")
    p.add_argument("--verbose", "-v", action="store_true",
                   help="print every anchor found per layer and the compiler's passes, in order")
    cal = p.add_argument_group("threshold calibration (needs the runtime)")
    options.add_arguments(cal, [options.CALIBRATE_REPLAY])
    cal.add_argument("--calibrate-quality", type=options.ascii_float, metavar="BUDGET",
                     help="pick the largest replay whose mean KL(dense || FastCar) per generated token (nats, "
                          "teacher-forced on the FastCar tokens) stays within BUDGET, e.g. 0.05")
    cal.add_argument("--calib-data", help=".npy int array [prompts, prompt_len] of calibration prompts")
    cal.add_argument("--calib-frames", type=options.ascii_int, default=3,
                     help="frames generated per calibration prompt (default 3; frame 0 never replays)")
    cal.add_argument("--given-video-tokens", type=options.ascii_int, default=0, metavar="N",
                     help="the calibration prompts end with N video tokens (e.g. a given frame 0: N = L), so "
                          "the first generated frame may already replay (default 0)")
    fpga = p.add_argument_group("FPGA backend")
    fpga.add_argument("--target", choices=["onnx", "fpga"], default="onnx",
                      help="onnx (default): write fast.onnx; fpga: compile a fast.onnx into DRS bundles (.fcb)")
    fpga.add_argument("--board", default="kv260", help=f"board preset ({board_presets()}; default kv260)")
    fpga.add_argument("--board-file", help="JSON file overriding board parameters")
    fpga.add_argument("--batch", type=options.ascii_int, default=1, help="batch rows the bundles are scheduled for (<= 32)")
    fpga.add_argument("--context", type=options.ascii_int, help="KV context the attention tiles are sized for (default 2 x L)")
    fpga.add_argument("--weights", choices=["broadcast", "per_core"], default="broadcast",
                      help="weight streaming the DRS decision table is built for: one stream shared by all rows "
                           "(a skipped MLP saves traffic only if every row skips) or one per core")
    fpga.add_argument("--dense", action="store_true",
                      help="compile without FastCar instructions (no TAS, nothing skipped): the dense baseline "
                           "for `sim --baseline`")
    return p


def _not_planned(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The flags given that --inspect cannot plan: those outside the compile options (the output, calibration, the
    FPGA backend), which act only when a model is compiled, calibrated or scheduled."""
    planned = {o.name for o in options.CLI_OPTIONS} | {"model", "inspect", "verbose", "help"}
    return [max(a.option_strings, key=len) for a in parser._actions
            if a.dest not in planned and a.option_strings and getattr(args, a.dest, a.default) != a.default]


# Output names that say "not a model": a compiled graph written there would pass for a prompt, trace or picture
# (`-o t.npy --calib-data t.npy` once replaced the calibration data with a graph).
NOT_A_MODEL = (".npy", ".npz", ".json", ".png", ".gif", ".jpg", ".txt", ".csv", ".md", ".s", ".safetensors", ".pt")


def _check_output_name(args: argparse.Namespace) -> None:
    """The output's extension must not name another kind of file: a model is never written as x.npy, a bundle
    never as x.onnx."""
    from fastcar_compile.core.fileio import same_file

    inputs = [x for x in (args.model, args.calib_data, args.board_file) if x is not None]
    if args.output is None or any(same_file(args.output, x) for x in inputs):  # the input's own refusal says more
        return
    suffix = Path(args.output).suffix.lower()
    if args.target == "fpga" and suffix == ".onnx":
        raise FastCarError(f"-o {args.output}: --target fpga writes a bundle (.fcb), not an ONNX model; name it "
                           "model.fcb")
    if suffix in NOT_A_MODEL or (args.target == "onnx" and suffix == ".fcb"):
        raise FastCarError(f"-o {args.output}: {suffix} names another kind of file; the compiler writes an ONNX "
                           f"model{' bundle (.fcb)' if args.target == 'fpga' else ' (.onnx)'}")


def _check_calibration_args(args: argparse.Namespace, argv: list[str]) -> None:
    calibrating = args.calibrate_replay is not None or args.calibrate_quality is not None
    check_int("--calib-frames", args.calib_frames, 1, MAX_CALIB_FRAMES, "frames generated per calibration prompt")
    check_int("--given-video-tokens", args.given_video_tokens, 0, INT64_MAX, "video tokens at the end of each "
              "calibration prompt")
    if calibrating and any(a == "--threshold" or a.startswith("--threshold=") for a in argv):
        raise FastCarError("--threshold and --calibrate-* both set tau: calibration picks it; give one of them")


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(_join_negative_values(argv))
    _check_output_name(args)
    _check_calibration_args(args, argv)
    import fastcar_compile as fc

    if args.inspect:
        refused = _not_planned(parser, args)
        if refused:
            raise FastCarError(f"--inspect plans without compiling and cannot apply {', '.join(refused)}; leave "
                               f"{'it' if len(refused) == 1 else 'them'} out (or compile without --inspect)")
        report = fc.inspect(args.model, **options.from_args(args))
        print(report.format(verbose=args.verbose))
        if not report.matched:
            raise FastCarError(f"no {report.unit[:-1]} matched (see the missing anchors above)")
        return 0
    if args.target == "fpga":
        return _fpga(args)
    options.check_all({k: v for k, v in options.from_args(args).items() if v is not None})  # before any work
    loaded = fc.load(args.model)  # its kind picks the target, once
    if loaded.kind != contract.DECODER:  # a DiT knows its tokens per frame
        return _compile_dit(args, loaded)
    if args.frame_tokens is None:
        raise FastCarError("--frame-tokens is required: the number of tokens per video frame (e.g. 256)")
    if args.output is None:
        raise FastCarError("-o/--output is required: where to write the compiled model")
    if args.calibrate_replay is not None or args.calibrate_quality is not None:
        return _calibrate(args)
    start = time.perf_counter()
    _, report = fc.compile(loaded, args.output, **options.from_args(args))
    print(report.format(verbose=args.verbose))
    print(f"wrote {args.output} ({len(report.rewritten)} layers rewritten, {time.perf_counter() - start:.1f} s)")
    if args.tas_query == contract.TAS_ROPE and all(t <= -1.0 for t in args.threshold):
        print(f"note: tau {args.threshold[0]:g} is on the paper's raw-TAS scale; post-RoPE TAS (--tas-query rope) "
              "often replays every eligible MLP there. Calibrate (--calibrate-replay 0.5 --calib-data p.npy) or "
              "use --tas-query raw", file=sys.stderr)
    return 0


def _fpga(args) -> int:
    if args.output is None:
        raise FastCarError("-o/--output is required: where to write the .fcb bundle file")
    try:
        from fastcar_compile.fpga_backend import compile_to_bundles
    except ImportError as exc:
        raise FastCarError(f"the FPGA backend is not available: {exc}") from None
    report = compile_to_bundles(args.model, args.output, board=args.board, board_file=args.board_file,
                                batch=args.batch, context=args.context, weights=args.weights,
                                dense=args.dense, video_start=args.video_start, frame_tokens=args.frame_tokens)
    print(report.summary())
    return 0


def _calibrate(args) -> int:
    import tempfile

    import fastcar_compile as fc

    if args.calib_data is None:
        raise FastCarError("--calibrate-* needs --calib-data prompts.npy (int array [prompts, prompt_len])")
    from fastcar_compile.api import check_files
    from fastcar_compile.runtime.evaluate import load_prompts

    check_files(args.model, args.output, genai=args.genai, reads={args.calib_data: "--calib-data"})
    prompts = load_prompts(args.calib_data, "--calib-data")
    from fastcar_compile.runtime.calibrate import calibrate_threshold

    with tempfile.TemporaryDirectory() as tmp:
        # the probe records TAS (tas.N outputs), so one pass gives the quantile (runtime/calibrate.py)
        probe = Path(tmp) / "probe.onnx"
        # the final model (compressed KV cache, fusions, ...) so the TAS it records is the final model's, with
        # one tau for every layer, the outputs calibration reads, no genai files
        fc.compile(args.model, probe, **options.from_args(
            args, threshold=args.threshold[0], per_layer_threshold=False, emit_diagnostics=True, genai=False,
            validate=False, required_video_inputs=False, provider="cpu"))
        n_held = max(1, len(prompts) // 4) if len(prompts) > 1 else 0
        calib, held = (prompts[:-n_held], prompts[-n_held:]) if n_held else (prompts, None)
        print(f"calibrating on {len(calib)} prompts x {args.calib_frames} frames, {n_held} held out ...", flush=True)
        result = calibrate_threshold(str(probe), calib, num_frames=args.calib_frames,
                                     target_replay=args.calibrate_replay, quality_budget=args.calibrate_quality,
                                     dense_model_path=args.model, heldout_prompts=held,
                                     given_video_tokens=args.given_video_tokens)
    print(result.summary())
    print(f"calibrated tau = {result.tau:.6g}; compiling {args.output} with it", flush=True)
    _, report = fc.compile(args.model, args.output, **options.from_args(args, threshold=result.tau))
    print(f"wrote {args.output} ({len(report.rewritten)} layers rewritten, tau = {result.tau:.6g})")
    return 0


def _check_dit_files(a: argparse.Namespace, loaded) -> None:
    """Before any work (a calibration streams the model): the output, the prompt graph written beside it and their
    data files are none of the inputs: the step graph, its prompt graph, their data and --calib-data."""
    from fastcar_compile.core import fileio

    out = fileio.check_output_path(a.output, "-o")
    reads: dict = dict(fileio.model_reads(a.model, "the step graph"))
    text_src = Path(a.model).with_name(contract.dit_text_graph_name(loaded.model.metadata_props, str(a.model)))
    if text_src.is_file():
        reads.update(fileio.model_reads(text_src, "the prompt graph"))
    if a.calib_data is not None:
        reads[Path(a.calib_data)] = "--calib-data"
    text_out = contract.text_graph_path(out)
    fileio.check_outputs({out: "-o", out.with_name(out.name + ".data"): "the output's data",
                          text_out: "the prompt graph's copy", text_out.with_name(text_out.name + ".data"):
                          "the prompt graph's data"}, reads)


def _compile_dit(a: argparse.Namespace, loaded) -> int:
    """`fastcar-compile dit.onnx -o fast.onnx` on a DiT step graph (the compiler's parsed arguments, the model
    loaded)."""
    import fastcar_compile as fc
    from fastcar_compile.api import refuse_prompt_graph
    from fastcar_compile.passes.dit_plan import REPLAY_FEATURE

    refuse_prompt_graph(loaded)
    if a.calibrate_quality is not None:
        raise FastCarError(f"--calibrate-quality: calibrating {REPLAY_FEATURE} by quality is not supported yet; "
                           "give --calibrate-replay RATIO or --threshold TAU")
    if a.output is None:
        raise FastCarError("-o/--output is required: where to write the compiled step graph")
    t0 = time.perf_counter()
    opts = options.from_args(a)
    _check_dit_files(a, loaded)
    if a.calibrate_replay is not None:
        options.CALIBRATE_REPLAY.check(a.calibrate_replay)
        from fastcar_compile.api import calibrate_dit
        from fastcar_compile.cli.stream import read_text_embeds

        cfg = contract.dit_config_of(loaded.model.metadata_props, str(a.model))
        text = read_text_embeds(a.calib_data, cfg.text_dim) if a.calib_data else None
        tau = calibrate_dit(a.model, a.calibrate_replay, text=text, frames=a.calib_frames, **opts)
        opts["threshold"] = (tau,)
        print(f"calibrated --threshold {tau:.6g} for replay ratio {a.calibrate_replay:g} (TAS quantile over the "
              f"eligible rows of a {max(a.calib_frames, 2 * cfg.chunk_frames)}-frame stream, "
              f"{'--calib-data' if text is not None else 'a seeded random'} prompt)")
    _, report = fc.compile(loaded, a.output, **opts)
    print(report.format(verbose=a.verbose))
    print(f"wrote {a.output} ({len(report.rewritten)} DiT blocks rewritten, {time.perf_counter() - t0:.1f} s); "
          f"next: fastcar-compile stream {a.output} --frames 24 -o stream_out")
    return 0

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
