"""`fastcar-compile model.onnx -o fast.onnx ...`: the compiler's command line."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from fastcar_compile import commands, contract
from fastcar_compile.errors import FastCarError
from fastcar_compile.limits import DEFAULT_ROTARY_POSITIONS


def _floats(text: str) -> list[float] | None:
    try:
        return [float(t) for t in text.split(",")]
    except ValueError:
        return None


def _threshold(text: str) -> list[float]:
    values = _floats(text)
    if values is None:
        raise argparse.ArgumentTypeError(f"not a number or comma-separated list of numbers: {text!r}")
    try:
        return [float(t) for t in contract.check_thresholds(values)]
    except FastCarError as exc:  # NaN, or beyond float32 (where the model stores tau)
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--threshold ")) from None


# Options whose value may start with '-' (argparse takes `--threshold -1e30` / `-inf` for an option).
_NEGATIVE_OK = ("--threshold",)


def _join_negative_values(argv: list[str]) -> list[str]:
    """`--threshold -1e30` -> `--threshold=-1e30` when the value reads as numbers."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] in _NEGATIVE_OK and i + 1 < len(argv) and argv[i + 1].startswith("-") \
                and _floats(argv[i + 1]) is not None:
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def build_parser() -> argparse.ArgumentParser:
    sub = commands.help_lines()
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
    p.add_argument("--frame-tokens", type=int, help="tokens per video frame L (aligned token is L positions back)")
    p.add_argument("--threshold", type=_threshold, default=[-4.0],
                   help="tau: replay when TAS > tau (default -4; inf never replays). With --per-layer-threshold "
                        "a comma-separated list, one per rewritten layer. Stored as the default of the "
                        "overridable input 'fastcar_threshold'")
    p.add_argument("--tas-query", choices=list(contract.TAS_QUERIES), default=contract.TAS_ROPE,
                   help="query for TAS: 'rope' = as attention uses it (default); 'raw' = before RoPE, as the "
                        "published FastCar code does, so its thresholds (-1/-4/-8) carry over")
    p.add_argument("--max-replay", type=int, default=0, metavar="K",
                   help="drift guard: recompute a slot replayed K frames in a row (0 = unlimited, the paper)")
    p.add_argument("--layers", help="rewrite only these decoder layers, e.g. 0,2-5 (default: all matched)")
    p.add_argument("--per-layer-threshold", action="store_true",
                   help="make fastcar_threshold a [layers] input, one tau per rewritten layer")
    p.add_argument("--emit-diagnostics", action="store_true",
                   help="add outputs replay_mask.N and tas.N per rewritten layer")
    p.add_argument("--fused-attention", nargs="?", const="gqa", default="fastcar", metavar="fastcar|gqa|off",
                   help="replace exported attention cores (cache Concat, K transpose, MatMul/Softmax) by an attention "
                        "that writes the KV cache in place: 'fastcar' (default) = the ai.fastcar CompressedAttention "
                        "op (native kernel; exact with left padding, batch > 1, multi-token steps); 'gqa' (the bare "
                        "flag) = com.microsoft.GroupQueryAttention (batch > 1 multi-token steps after the prompt are "
                        "refused by ORT's kernel); 'off' = keep the exported attention")
    p.add_argument("--fusions", choices=["on", "off"], default="on",
                   help="after the rewrite, fuse the export's RMSNorm chains into (Skip)SimplifiedLayerNormalization "
                        "and rotate-half RoPE into RotaryEmbedding (same values, fewer kernels per step; default on)")
    p.add_argument("--native-attention", choices=["on", "off"], default="on",
                   help="com.microsoft.GroupQueryAttention (genai graphs, --fused-attention gqa) -> the ai.fastcar "
                        "op with the native dense attention core: same semantics, faster; its function body is the "
                        "original op, so without the native library nothing changes (default on)")
    p.add_argument("--pack-qkv", choices=["on", "off"], default="on",
                   help="with --fusions and --fused-attention fastcar or gqa: one packed q/k/v MatMul per layer, RoPE "
                        "inside the attention op (CompressedAttention or GroupQueryAttention) and the gate, at KV-index positions (the export's up to rounding when "
                        "position_ids count each row's real tokens, as FastCarSession feeds them; padding only "
                        "before a row's first real token; default on)")
    p.add_argument("--rotary-positions", type=int, default=DEFAULT_ROTARY_POSITIONS, metavar="N",
                   help=f"KV positions the packed attention's rotary table covers (default {DEFAULT_ROTARY_POSITIONS}); "
                        "FastCarSession refuses a longer video")
    kv = p.add_argument_group("compressed KV cache (FAST-AR, in the fastcar attention op; docs/fastar.md)")
    kv.add_argument("--kv-budget", type=int, metavar="C", help="fixed KV slots per layer and KV head (memory stays flat)")
    kv.add_argument("--kv-sinks", type=int, default=0, metavar="S", help="first S tokens always kept (attention sinks)")
    kv.add_argument("--kv-window", type=int, default=0, metavar="W", help="last W tokens always kept (local window)")
    kv.add_argument("--kv-eviction", choices=["mass", "oldest"], default="mass",
                    help="which slot leaves a full cache: least attention mass received (default) or oldest")
    kv.add_argument("--tempcache", type=float, metavar="SIM",
                    help="TempCache: merge a key into the slot of its aligned token (p - L) when their pre-RoPE "
                         "cosine exceeds SIM (mean value, count, +log(count) bias)")
    kv.add_argument("--sparse-attention", metavar="lsh:BITSxTABLES|int8[:DIRSxTABLES]",
                    help="AnnSA: a decode query attends only to slots sharing a bucket (plus sinks, window): sign "
                         "random projections (lsh) or 8-bit quantised projections (int8 = int8:2x4)")
    kv.add_argument("--prune-prompt", type=float, metavar="P",
                    help="AnnCA for decoder-only models: prompt keys (before video_start) that no query of the "
                         "previous frame gave softmax weight >= P are skipped for the current frame")
    kv.add_argument("--kv-diagnostics", type=int, metavar="M",
                    help="also run dense attention on the side (up to M tokens) and output kv_stats.N per layer: "
                         "density and recall against dense, in the run stats (RunStats.kv_diagnostics)")
    kv.add_argument("--kv-layer", action="append", default=[], metavar="LAYERS:SETTINGS", dest="kv_layers",
                    help="per-layer settings instead of the ones above, repeatable: e.g. "
                         "0:budget=129,sinks=4,window=124,eviction=oldest (a window where a layer reads by position) "
                         "1-3:budget=4100,window=64,tempcache=0.95 (TempCache where it reads by content), 2:off (uncompressed); "
                         "settings: budget, sinks, window, eviction, tempcache, sparse (lsh:BxT, int8:DxT), prune (P)")
    p.add_argument("--genai", action=argparse.BooleanOptionalAction, default=None,
                   help="name the state for onnxruntime-genai's generator and write genai_config.json beside "
                        "the output (default: when the input sits beside one)")
    p.add_argument("--required-video-inputs", action="store_true",
                   help="make video_start and fastcar_threshold plain inputs without defaults, fed every run "
                        "(onnxruntime-genai's generator.set_model_input then sets them per video)")
    p.add_argument("--inspect", action="store_true",
                   help="only report what discovery finds per layer (and why a layer does not match)")
    p.add_argument("--verbose", "-v", action="store_true",
                   help="print every anchor found per layer and the compiler's passes, in order")
    p.add_argument("--no-validate", action="store_true",
                   help="skip the onnx.checker + ONNX Runtime check of the result before it is written")
    cal = p.add_argument_group("threshold calibration (needs the runtime)")
    cal.add_argument("--calibrate-replay", type=float, metavar="RATIO",
                     help="pick tau so that the replay ratio on --calib-data reaches RATIO (0-1)")
    cal.add_argument("--calibrate-quality", type=float, metavar="BUDGET",
                     help="pick the largest replay whose mean KL(dense || FastCar) per generated token (nats, "
                          "teacher-forced on the FastCar tokens) stays within BUDGET, e.g. 0.05")
    cal.add_argument("--calib-data", help=".npy int array [prompts, prompt_len] of calibration prompts")
    cal.add_argument("--calib-frames", type=int, default=3,
                     help="frames generated per calibration prompt (default 3; frame 0 never replays)")
    cal.add_argument("--given-video-tokens", type=int, default=0, metavar="N",
                     help="the calibration prompts end with N video tokens (e.g. a given frame 0: N = L), so "
                          "the first generated frame may already replay (default 0)")
    fpga = p.add_argument_group("FPGA backend")
    fpga.add_argument("--target", choices=["onnx", "fpga"], default="onnx",
                      help="onnx (default): write fast.onnx; fpga: compile a fast.onnx into DRS bundles (.fcb)")
    fpga.add_argument("--board", default="kv260", help="board preset (kv260, zcu102, u280)")
    fpga.add_argument("--board-file", help="JSON file overriding board parameters")
    fpga.add_argument("--batch", type=int, default=1, help="batch rows the bundles are scheduled for (<= 32)")
    fpga.add_argument("--context", type=int, help="KV context the attention tiles are sized for (default 2 x L)")
    fpga.add_argument("--weights", choices=["broadcast", "per_core"], default="broadcast",
                      help="weight streaming the DRS decision table is built for: one stream shared by all rows "
                           "(a skipped MLP saves traffic only if every row skips) or one per core")
    fpga.add_argument("--dense", action="store_true",
                      help="compile without FastCar instructions (no TAS, nothing skipped): the dense baseline "
                           "for `sim --baseline`")
    fpga.add_argument("--video-start", type=int,
                      help="KV index of the first video token your runtime uses (run.json's video_start); "
                           "recorded in the bundle (default 0)")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(_join_negative_values(argv))
    import fastcar_compile as fc

    if args.inspect:
        report = fc.inspect(args.model)
        print(report.format(verbose=args.verbose))
        if not report.matched:
            raise FastCarError("no decoder layer matched (see the missing anchors above)")
        return 0
    if args.target == "fpga":
        return _fpga(args)
    if args.frame_tokens is None:
        raise FastCarError("--frame-tokens is required: the number of tokens per video frame (e.g. 256)")
    if args.output is None:
        raise FastCarError("-o/--output is required: where to write the compiled model")
    if args.calibrate_replay is not None or args.calibrate_quality is not None:
        return _calibrate(args)
    start = time.perf_counter()
    _, report = fc.compile(args.model, args.output, **_compile_options(args))
    print(report.format(verbose=args.verbose))
    print(f"wrote {args.output} ({len(report.rewritten)} layers rewritten, {time.perf_counter() - start:.1f} s)")
    if args.tas_query == contract.TAS_ROPE and all(t <= -1.0 for t in args.threshold):
        print(f"note: tau {args.threshold[0]:g} is on the paper's raw-TAS scale; post-RoPE TAS (--tas-query rope) "
              "often replays every eligible MLP there. Calibrate (--calibrate-replay 0.5 --calib-data p.npy) or "
              "use --tas-query raw", file=sys.stderr)
    return 0


def _compile_options(args, **overrides) -> dict:
    """The keywords of `fastcar_compile.compile` the command line sets: every compile, the calibration's probe
    and its final one included, starts from these (a calibrated compile keeps every option)."""
    opts = dict(frame_tokens=args.frame_tokens, tas_query=args.tas_query, max_replay=args.max_replay,
                layers=args.layers, per_layer_threshold=args.per_layer_threshold,
                emit_diagnostics=args.emit_diagnostics, validate=not args.no_validate, genai=args.genai,
                fused_attention=args.fused_attention, kv_budget=args.kv_budget, kv_sinks=args.kv_sinks,
                kv_window=args.kv_window, kv_eviction=args.kv_eviction, tempcache=args.tempcache,
                sparse_attention=args.sparse_attention, kv_diagnostics=args.kv_diagnostics,
                prune_prompt=args.prune_prompt, kv_layers=args.kv_layers,
                required_video_inputs=args.required_video_inputs, fusions=args.fusions == "on",
                native_attention=args.native_attention == "on", pack_qkv=args.pack_qkv == "on",
                rotary_positions=args.rotary_positions,
                threshold=args.threshold if args.per_layer_threshold else _single(args.threshold))
    opts.update(overrides)
    return opts


def _single(values: list[float]) -> float:
    if len(values) != 1:
        raise FastCarError("several thresholds need --per-layer-threshold")
    return values[0]


def _fpga(args) -> int:
    if args.output is None:
        raise FastCarError("-o/--output is required: where to write the .fcb bundle file")
    try:
        from fastcar_compile.fpga_backend import compile_to_bundles
    except ImportError as exc:
        raise FastCarError(f"the FPGA backend is not available: {exc}") from None
    report = compile_to_bundles(args.model, args.output, board=args.board, board_file=args.board_file,
                                batch=args.batch, context=args.context, weights=args.weights,
                                dense=args.dense, video_start=args.video_start)
    print(report.summary())
    return 0


def _calibrate(args) -> int:
    import tempfile

    import fastcar_compile as fc

    if args.calib_data is None:
        raise FastCarError("--calibrate-* needs --calib-data prompts.npy (int array [prompts, prompt_len])")
    from fastcar_compile.api import check_files
    from fastcar_compile.eval_model import load_prompts

    check_files(args.model, args.output, genai=args.genai, reads={args.calib_data: "--calib-data"})
    prompts = load_prompts(args.calib_data, "--calib-data")
    from fastcar_compile.runtime.calibrate import calibrate_threshold

    with tempfile.TemporaryDirectory() as tmp:
        # the probe records TAS (tas.N outputs), so one pass gives the quantile (runtime/calibrate.py)
        probe = Path(tmp) / "probe.onnx"
        # the final model (compressed KV cache, fusions, ...) so the TAS it records is the final model's, with
        # one tau for every layer, the outputs calibration reads, no genai files
        fc.compile(args.model, probe, **_compile_options(args, threshold=args.threshold[0], per_layer_threshold=False,
                                                         emit_diagnostics=True, genai=False, validate=False,
                                                         required_video_inputs=False))
        n_held = max(1, len(prompts) // 4) if len(prompts) > 1 else 0
        calib, held = (prompts[:-n_held], prompts[-n_held:]) if n_held else (prompts, None)
        print(f"calibrating on {len(calib)} prompts x {args.calib_frames} frames, {n_held} held out ...", flush=True)
        result = calibrate_threshold(str(probe), calib, num_frames=args.calib_frames,
                                     target_replay=args.calibrate_replay, quality_budget=args.calibrate_quality,
                                     dense_model_path=args.model, heldout_prompts=held,
                                     given_video_tokens=args.given_video_tokens)
    print(result.summary())
    print(f"calibrated tau = {result.tau:.6g}; compiling {args.output} with it", flush=True)
    _, report = fc.compile(args.model, args.output, **_compile_options(args, threshold=result.tau))
    print(f"wrote {args.output} ({len(report.rewritten)} layers rewritten, tau = {result.tau:.6g})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
