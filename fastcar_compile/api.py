"""Python API: `compile()` builds the pass pipeline for its options and runs it; `inspect()` runs discovery.

`compile()` never modifies its input (paths are read, in-memory models are copied) and writes its output
atomically: the result is serialised into a temporary folder next to the output, checked with
`onnx.checker` and opened in an ONNX Runtime session (the validation pass), and only then renamed into
place (the save pass). The passes and their order: fastcar_compile/pipeline.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import onnx
import onnx_ir as ir

from fastcar_compile import pipeline
from fastcar_compile.core import fileio
from fastcar_compile.core import options as declared
from fastcar_compile.core.errors import FastCarError
from fastcar_compile.passes import genai_state, native_gqa
from fastcar_compile.passes.analysis import find_layers, parse_layers, plan, select_layers
from fastcar_compile.passes.compile_report import CompileReport, LayerReport
from fastcar_compile.passes.context import CompileContext, CompileOptions
from fastcar_compile.passes.save import SavePass, Staging
from fastcar_compile.passes.threshold import BakeThresholdPass
from fastcar_compile.passes.validate import ValidatePass

__all__ = ["CompileOptions", "CompileReport", "LayerReport", "bake_threshold", "compile", "inspect", "load",
           "parse_layers", "pass_list"]


def load(model) -> tuple[ir.Model, Path | None]:
    """An onnx_ir model the caller may modify (a copy of an in-memory input) and the input's path."""
    if isinstance(model, ir.Model):
        return ir.from_proto(ir.to_proto(model)), None
    if isinstance(model, onnx.ModelProto):
        return ir.from_proto(model), None
    path = Path(model)
    if path.is_dir():
        raise FastCarError(f"{path} is a directory; pass the path of an exported .onnx decoder file in it")
    fileio.refuse_special_input(path, "model")
    if not path.is_file():
        raise FastCarError(f"{path}: no such file; pass the path of an exported .onnx decoder")
    missing = fileio.missing_external_data(path)
    if missing:
        raise FastCarError(f"{path}: its external-data file {missing[0]} is missing; keep the .onnx and its "
                           "data file(s) together in one folder")
    try:
        loaded = ir.load(path)
    except Exception as exc:  # noqa: BLE001 - protobuf raises many types for a non-ONNX/truncated file
        raise FastCarError(f"{path}: not a readable ONNX model ({type(exc).__name__}: {str(exc)[:200]}); "
                           "check that the file is a complete .onnx export") from None
    if len(loaded.graph) == 0:
        raise FastCarError(f"{path}: the ONNX graph has no nodes; is this a complete .onnx export?")
    return loaded, path


def _dit():
    """The DiT compiler (fastcar_compile/dit, the layer above: imported by name, commands.DIT_API)."""
    import importlib

    from fastcar_compile.commands import DIT_API

    return importlib.import_module(DIT_API)


def _dit_step(model) -> tuple[ir.Model, Path | None] | None:
    """`model` loaded (load()'s result) when it is a DiT step graph, else None. Asked only when its options fail a
    decoder's rules, which a DiT's differ from; the compile then goes on with this load rather than a second one."""
    try:
        loaded = load(model)
        return loaded if _dit().is_dit_step(loaded[0]) else None
    except FastCarError:
        return None


def inspect(model, **options) -> CompileReport:
    """Discovery and the plan, without compiling: what was found in each layer, why a layer did not match, and what
    a compile with these `options` (compile()'s keywords; `frame_tokens` 1 when absent) would build per layer."""
    declared.unknown(options, "inspect")
    options = {k: v for k, v in options.items() if not (k == "frame_tokens" and v is None)}
    loaded, _ = load(model)
    if _dit().is_dit_step(loaded):
        given = [o.flag or o.name for k, v in options.items() if (o := declared.BY_NAME[k]).name != "frame_tokens"
                 and o.check(v) != o.check(o.default)]
        if given:
            raise FastCarError(f"--inspect plans a video DiT step graph with the default options; leave "
                               f"{', '.join(given)} out (compile to apply them)")
        return _dit().inspect_dit(loaded)
    _refuse_dit_only(options)
    opts = CompileOptions(**{"frame_tokens": 1, **options})
    ctx = CompileContext(opts)
    pipeline.run(ir.passes.PassManager(pipeline.exporter_fusions(ctx)), loaded)
    notes = ctx.notes
    matches = find_layers(loaded, notes)
    report = CompileReport.from_matches(matches)
    rewritten = [m.layer for m in select_layers(matches, opts)]
    report.plan = plan(loaded, matches, rewritten, opts, notes).plan.lines()
    report.notes.extend(notes)
    report.notes.extend(native_gqa.inspect_notes(loaded))
    return report


inspect.__signature__ = declared.signature(inspect, 1)  # the declared options, for help() and editors


def _refuse_dit_only(options: dict) -> None:
    """A decoder takes no option of video DiT step graphs."""
    for name in declared.DIT_ONLY:
        if name in options and options[name] != declared.BY_NAME[name].default:
            flag = declared.BY_NAME[name].flag
            raise FastCarError(f"{flag} applies to video DiT step graphs (fastcar-compile export --dit) only; "
                               f"leave {flag} out")


def pass_list(output: bool = True, validate: bool = True) -> list[str]:
    """The passes `compile()` runs (what `--verbose` prints)."""
    staging = Staging("out.onnx") if output else None
    return pipeline.describe(pipeline.build(CompileContext(CompileOptions(frame_tokens=1)), staging, validate))


def compile(model, output: str | os.PathLike | None = None, **options) -> tuple[ir.Model, CompileReport]:  # noqa: A001
    """Compile `model` (path, ModelProto or onnx_ir.Model) for FastCar; save to `output` when given.

    The keywords are the options declared in fastcar_compile/core/options.py (their help there; `frame_tokens` is
    required), e.g. `compile("model.onnx", "fast.onnx", frame_tokens=256, tas_query="raw", threshold=-4)`.
    genai=None: name the state for onnxruntime-genai's generator when the input sits beside a genai_config.json
    and the output goes to another folder. kv_layers: ["LAYERS:SETTINGS", ...] (passes/context.py
    parse_kv_layer). shared_mlp=False keeps the older nested MLP layout (docs/memory.md).
    """
    declared.unknown(options, "compile")
    dit = None
    try:
        opts = CompileOptions(**options)
    except (FastCarError, TypeError):  # a decoder's rules (--tempcache needs --kv-budget, frame_tokens required)
        opts, dit = None, _dit_step(model)
        if dit is None:
            raise
    out_path = fileio.check_output_path(output) if output is not None else None
    loaded, in_path = dit or load(model)
    if _dit().is_dit_step(loaded):  # a video DiT's step graph (export --dit): its own rewrite and option checks
        return _dit().compile_dit(loaded, out_path, source=in_path, **options)
    _refuse_dit_only(options)
    genai_config = _genai_config(opts.genai, in_path, out_path)
    staging = Staging(out_path, source=in_path) if out_path is not None else None
    if staging is not None:
        _check_files(in_path, staging, genai_config)
    ctx = CompileContext(opts, genai_config=genai_config)
    manager = pipeline.build(ctx, staging, opts.validate)
    try:
        with fileio.os_errors(str(out_path or "")):
            pipeline.run(manager, loaded)
    finally:
        if staging is not None:
            staging.cleanup()
    report = CompileReport.from_matches(ctx.matches)
    done = set(ctx.rewritten)
    for r in report.layers:
        r.rewritten = r.layer in done
    report.notes = ctx.notes
    report.metadata = ctx.metadata
    report.passes = pipeline.describe(manager)
    report.plan = ctx.plan.lines()
    return loaded, report


compile.__signature__ = declared.signature(compile, 2)  # the declared options, for help() and editors


def check_files(model: str | os.PathLike, output: str | os.PathLike, *, genai: bool | None = None,
                reads: dict[str | os.PathLike, str] | None = None) -> None:
    """What `compile(model, output)` checks before any work (fileio.check_outputs over the model, its
    external data, a genai folder and its outputs), with `reads`: other files the caller reads (calibration
    data) that no output may replace. For a caller with work to do before it compiles."""
    in_path, out_path = Path(model), fileio.check_output_path(output)
    _check_files(in_path, Staging(out_path, source=in_path), _genai_config(genai, in_path, out_path), reads)


def _check_files(in_path: Path | None, staging: Staging, genai_config: Path | None,
                 reads: dict[str | os.PathLike, str] | None = None) -> None:
    """Every file the save writes (model, external data, genai folder files) against every file it reads."""
    files = staging.files()
    writes: dict[Path, str] = {files[0]: "output", **{f: "the output's external data" for f in files[1:]}}
    ins: dict[str | os.PathLike, str] = dict(fileio.model_reads(in_path)) if in_path is not None else {}
    if genai_config is not None:
        w, r = genai_state.planned_files(genai_config, staging.output)
        writes.update(w)
        ins.update(r)
    ins.update(reads or {})
    fileio.check_outputs(writes, ins)


def _genai_config(genai: bool | None, in_path: Path | None, out_path: Path | None) -> Path | None:
    """The input's genai_config.json when the output should run in onnxruntime-genai's generator."""
    cfg = genai_state.beside(in_path) if genai is not False and out_path is not None else None
    if cfg is not None and out_path.resolve().parent == cfg.resolve().parent:
        if genai:
            raise FastCarError(f"--genai: write the output into another folder than {cfg.parent} (genai reads "
                               "one genai_config.json per folder; the input's is never modified)")
        return None
    if genai and cfg is None:
        raise FastCarError("--genai needs an input model beside its genai_config.json and an output path")
    return cfg


def _input_output(model: str | os.PathLike, output: str | os.PathLike) -> tuple[Path, Staging]:
    """The input model (must exist) and the staging of a writable output path that neither is it nor overwrites
    its files."""
    src, dst = Path(model), fileio.check_output_path(output)
    fileio.refuse_special_input(src, "model")
    if not src.is_file():
        raise FastCarError(f"{src} does not exist")
    staging = Staging(dst, source=src)
    _check_files(src, staging, None)
    return src, staging


def bake_threshold(in_path: str | os.PathLike, out_path: str | os.PathLike, tau) -> Path:
    """Write a copy of fast.onnx whose default `fastcar_threshold` (and metadata `fastcar.threshold`) is tau.

    A scalar tau fills every layer of a per-layer-threshold model. Written atomically (temp folder, rename);
    the weights of an external-data model are linked, not read.
    """
    src, staging = _input_output(in_path, out_path)
    dst = staging.output
    model, _ = load(src)
    try:
        with fileio.os_errors(str(dst)):
            pipeline.run(ir.passes.PassManager([BakeThresholdPass(tau, str(src)), SavePass(staging)]), model)
    finally:
        staging.cleanup()
    return dst


def native_attention(model: str | os.PathLike, output: str | os.PathLike, validate: bool = True) -> list[str]:
    """Write `model` with only its com.microsoft.GroupQueryAttention nodes swapped for the native ai.fastcar op
    (passes/native_gqa.py): the dense model at its fastest, the baseline FastCar's speed-ups are measured
    against. Beside a genai_config.json the output folder gets one too (with the native library). Returns notes."""
    src, staging = _input_output(model, output)
    dst = staging.output
    loaded, _ = load(src)
    ctx = CompileContext(CompileOptions(frame_tokens=1), genai_config=_genai_config(None, src, dst))
    if ctx.genai_config is not None:
        _check_files(src, staging, ctx.genai_config)
    passes: list[ir.passes.PassBase] = [native_gqa.NativeGqaPass(ctx.notes)]
    if validate:
        passes.append(ValidatePass(staging))
    if ctx.genai_config is not None:
        passes.append(genai_state.GenaiConfigPass(ctx, staging))
    passes.append(SavePass(staging))
    try:
        with fileio.os_errors(str(dst)):
            pipeline.run(ir.passes.PassManager(passes), loaded)
    finally:
        staging.cleanup()
    return ctx.notes
