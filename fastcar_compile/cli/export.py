"""`fastcar-compile export MODEL_DIR -o model.onnx`: a transformers causal LM -> the ONNX decoder with KV
cache that the compiler reads (docs/export.md)."""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

from fastcar_compile.core.errors import FastCarError
from fastcar_compile.core.limits import check_int
from fastcar_compile.core.options import ascii_int

CHECK_TOLERANCE = 1e-3
DIT_CHECK_TOLERANCE = 1e-4


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="fastcar-compile export", description="Export a transformers causal LM (a save_pretrained folder, or a "
        "config.json for random weights) to ONNX with past_key_values.N.key|value -> present.N.key|value.")
    ap.add_argument("source", nargs="?", help="transformers model folder (config.json + weights) or a config.json")
    ap.add_argument("--dit", metavar="CONFIG_OR_DIR_OR_PRESET",
                    help="export a chunk-causal video DiT instead: a preset (tiny, wan2.1-1.3b), a DiT config .json "
                    "or a folder with config.json (+ model.safetensors); writes the step graph and OUT.text.onnx")
    ck = ap.add_argument_group("--dit checkpoints without our config (diffusers' WanTransformer3DModel folder, or Wan's "
                               "original layout: Self-Forcing, CausVid .pt / .safetensors; docs/dit.md)")
    ck.add_argument("--dit-settings", metavar="JSON", help="a small JSON of the fields a checkpoint does not fix: heads, "
                    "latent_h, latent_w, chunk_frames, sink_frames, window_frames, text_len, eps, rope_theta")
    ck.add_argument("--heads", type=ascii_int, help="attention heads (default: the checkpoint config's, or hidden / 128)")
    ck.add_argument("--latent", metavar="HxW", help="latent frame size (default 60x104: Wan2.1 at 480x832)")
    ck.add_argument("--chunk-frames", type=ascii_int, help="latent frames denoised together (default 3)")
    ck.add_argument("--sink-frames", type=ascii_int, help="first frames the cache keeps for ever (default 3)")
    ck.add_argument("--window-frames", type=ascii_int, help="most recent frames the cache keeps, 0 = all (default 18)")
    ck.add_argument("--state-key", metavar="KEY", help="the entry of a .pt checkpoint holding the weights (default: "
                    "the top level, else 'generator', 'model', 'state_dict'; e.g. generator_ema)")
    ap.add_argument("-o", "--output", required=True, help="output .onnx (written atomically)")
    ap.add_argument("--opset", type=ascii_int, help="ONNX opset (default 20 with dynamo, 17 with --torchscript)")
    ap.add_argument("--torchscript", action="store_true",
                    help="use the TorchScript exporter (dynamo=False) instead of dynamo (the default)")
    ap.add_argument("--seed", type=ascii_int, default=0, help="seed of the random weights when given a config only")
    ap.add_argument("--random-weights", action="store_true", help="--dit: a config or folder without "
                    "model.safetensors exports random weights (seeded) to try the tool chain; without this flag it "
                    "is refused (a preset such as tiny always has random weights)")
    ap.add_argument("--no-check", action="store_true",
                    help="skip the check that ONNX Runtime's logits equal the eager model's (prompt + 2 steps)")
    return ap


def main(argv: list[str]) -> int:
    a = build_parser().parse_args(argv)
    if a.dit is not None:
        if a.source is not None:
            raise FastCarError(f"give either a transformers model ({a.source}) or --dit {a.dit}, not both")
        return _export_dit(a)
    if a.source is None:
        raise FastCarError("give a transformers model folder (or config.json), or --dit PRESET_OR_CONFIG")
    if a.opset is not None and not 7 <= a.opset <= 24:
        raise FastCarError(f"--opset {a.opset} is outside 7..24 (20 is the tested default)")
    out = Path(a.output)
    if out.suffix != ".onnx":
        raise FastCarError(f"-o {out}: give a path ending in .onnx")
    _check_files(Path(a.source), out)
    from fastcar_compile.export import check_logits, export_decoder, load_model

    t0 = time.perf_counter()
    model, weights = load_model(a.source, seed=a.seed)
    if not weights:
        print(f"note: {a.source} has no weights; exporting random weights (seed {a.seed}) to try the tool chain")
    exporter = "TorchScript" if a.torchscript else "dynamo"
    n = sum(p.numel() for p in model.parameters())
    print(f"exporting {type(model).__name__} ({n / 1e6:.1f} M parameters) with the {exporter} exporter ...",
          flush=True)
    try:
        export_decoder(model, out, opset=a.opset, dynamo=not a.torchscript)
    except (FastCarError, OSError):  # OSError: a file-system problem, said as one (cli)
        raise
    except Exception as exc:  # noqa: BLE001 - torch.onnx raises many types; say which exporter and what to try
        other = "dynamo (drop --torchscript)" if a.torchscript else "--torchscript"
        raise FastCarError(f"the {exporter} exporter failed: {type(exc).__name__}: "
                           f"{str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}; try {other}") \
            from None
    msg = f"wrote {out} ({time.perf_counter() - t0:.0f} s)"
    if not a.no_check:
        err = check_logits(model, out)
        if not err <= CHECK_TOLERANCE:  # NaN fails too
            raise FastCarError(f"{out}: ONNX Runtime logits differ from the eager model by {err:.3g} "
                               f"(> {CHECK_TOLERANCE}); try the other exporter")
        msg += f"; logits match the eager model (max abs diff {err:.1e} over a prompt + 2 decode steps)"
    print(msg)
    print(f"next: fastcar-compile {out} --inspect")
    return 0


def _check_files(source: Path, out: Path) -> None:
    """Before any work: the output (and the data file a large export writes beside it) is a regular file or a
    new path, and none is a file of the checkpoint folder (config, weights, tokenizer)."""
    from fastcar_compile.core.fileio import check_output_path, check_outputs

    check_output_path(out, "-o")
    folder = source if source.is_dir() else source.parent
    reads = {f: "a file of the checkpoint" for f in folder.iterdir()  # not earlier exports into the folder
             if f.is_file() and ".onnx" not in f.name and f.suffix != ".data"} if folder.is_dir() else {}
    if source.is_file():
        reads[source] = "the config"
    check_outputs({out: "-o", out.parent / f"{out.name}.data": "the output's external data"}, reads)


def _export_dit(a: argparse.Namespace) -> int:
    """The `--dit` branch: a chunk-causal video DiT (preset, config or folder) -> its step and prompt graphs."""
    from fastcar_compile.core.contract import text_graph_path
    from fastcar_compile.core.fileio import check_output_path, check_outputs
    from fastcar_compile.dit.checkpoints import load_config
    from fastcar_compile.dit.config import RANDOM_WEIGHTS_MAX_BYTES

    if a.torchscript or a.opset is not None:
        raise FastCarError("--dit exports with the dynamo exporter at opset 20; drop --torchscript / --opset")
    out = Path(a.output)
    if out.suffix != ".onnx":
        raise FastCarError(f"-o {out}: give a path ending in .onnx")
    check_output_path(out, "-o")
    check_int("--seed", a.seed, 0, 2**32 - 1)
    cfg, weights = load_config(a.dit, _checkpoint_overrides(a), a.state_key)
    text_out = text_graph_path(out)
    src = Path(a.dit)
    reads = {}
    if src.exists():
        reads = {f: "a file of the DiT folder" for f in (src.iterdir() if src.is_dir() else [src]) if f.is_file()}
    check_outputs({out: "-o", text_out: "the prompt graph", out.parent / f"{out.name}.data": "the output's data",
                   out.parent / f"{text_out.name}.data": "the prompt graph's data"}, reads)
    from fastcar_compile.dit.export import check_step, export_dit
    from fastcar_compile.dit.model import build

    meta = weights is None and 4 * cfg.params > RANDOM_WEIGHTS_MAX_BYTES
    if not meta:  # random weights only when asked (a large config without weights exports zeros, said below)
        from fastcar_compile.dit.checkpoints import refuse_random
        from fastcar_compile.dit.config import check_model_memory

        refuse_random(a.dit, weights, a.random_weights)
        check_model_memory(cfg, str(a.dit))
    t0 = time.perf_counter()
    if weights is None and meta:
        print(f"note: {a.dit} has no weights and {cfg.params / 1e9:.2f} B parameters; exporting the graph without "
              "weights (zero-filled external data, never in memory)")
    elif weights is None:
        print(f"note: {a.dit} has no weights; exporting random weights (seed {a.seed}) to try the tool chain")
    if weights is not None and not isinstance(weights, Path):
        print(f"reading {a.dit}: {weights.describe()}, mapped onto a {cfg.layers}-layer chunk-causal DiT ({cfg.heads} "
              f"heads, latent {cfg.latent_h}x{cfg.latent_w}, chunk {cfg.chunk_frames}, sinks {cfg.sink_frames}, "
              f"window {cfg.window_frames})")
    model = build(cfg, weights, seed=a.seed, device="meta" if meta else None)
    print(f"exporting a {cfg.layers}-layer chunk-causal DiT ({cfg.params / 1e6:.1f} M parameters, "
          f"{cfg.tokens_per_frame} tokens per frame) ...", flush=True)
    try:
        export_dit(model, out, weights="zeros" if meta else "checkpoint" if weights else "random")
    except (FastCarError, OSError):
        raise
    except Exception as exc:  # noqa: BLE001 - torch.onnx raises many types
        raise FastCarError(f"the dynamo exporter failed: {type(exc).__name__}: "
                           f"{str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}") from None
    msg = f"wrote {out} and {text_out} ({time.perf_counter() - t0:.0f} s)"
    if meta:
        msg += "; not checked against eager PyTorch (no weights)"
    elif not a.no_check:
        err = check_step(model, out, text_out)
        if not err <= DIT_CHECK_TOLERANCE:
            raise FastCarError(f"{out}: ONNX Runtime differs from the eager model by {err:.3g} "
                               f"(> {DIT_CHECK_TOLERANCE})")
        msg += (f"; matches the eager model (max abs diff {err:.1e} over the prompt K/V and a step with an empty "
                "and a non-empty cache)")
    print(msg)
    print(f"next: fastcar-compile stream {out} --frames 24 -o stream_out")
    return 0


def _checkpoint_overrides(a: argparse.Namespace) -> dict:
    """The geometry given on export's command line (--dit-settings, then the flags): DiTConfig fields."""
    from fastcar_compile.dit.checkpoints import read_overrides

    flags = {"heads": a.heads, "chunk_frames": a.chunk_frames, "sink_frames": a.sink_frames,
             "window_frames": a.window_frames}
    if a.latent is not None:
        m = re.fullmatch(r"([0-9]+)x([0-9]+)", a.latent)
        if not m:
            raise FastCarError(f"--latent {a.latent!r}: give the latent frame size as HxW, e.g. 60x104")
        flags.update(latent_h=int(m.group(1)), latent_w=int(m.group(2)))
    return read_overrides(a.dit_settings, flags)
