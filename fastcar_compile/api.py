"""Python API: `compile()` builds the pass pipeline for its options and runs it; `inspect()` runs discovery.

`compile()` never modifies its input (paths are read, in-memory models are copied) and writes its output
atomically: the result is serialised into a temporary folder next to the output, checked with
`onnx.checker` and opened in an ONNX Runtime session (the validation pass), and only then renamed into
place (the save pass). The passes and their order: passes/pipeline.py.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import NamedTuple

import onnx
import onnx_ir as ir

from fastcar_compile.core import contract, fileio
from fastcar_compile.core import options as declared
from fastcar_compile.core.errors import FastCarError
from fastcar_compile.passes import dit_discover, dit_plan, dit_prompt, genai_state, native_gqa, pipeline
from fastcar_compile.passes.analysis import find_layers, parse_layers, plan, select_layers
from fastcar_compile.passes.compile_report import CompileReport, LayerReport
from fastcar_compile.passes.context import CompileContext, CompileOptions, DiTContext
from fastcar_compile.passes.save import SavePass, Staging
from fastcar_compile.passes.threshold import BakeThresholdPass
from fastcar_compile.passes.validate import ValidatePass

__all__ = ["CompileOptions", "CompileReport", "LayerReport", "Loaded", "bake_threshold", "calibrate_dit", "compile",
           "inspect", "load", "parse_layers", "pass_list"]


class Loaded(NamedTuple):
    """A model loaded for the compiler: its own copy, the input's path (None: in memory) and its kind, decided once
    here (contract.model_kind: a decoder, a DiT step graph or a DiT prompt graph)."""

    model: ir.Model
    path: Path | None
    kind: str


def load(model) -> Loaded:
    """An onnx_ir model the caller may modify (a copy of an in-memory input), the input's path and its kind."""
    if isinstance(model, Loaded):
        return model
    if isinstance(model, ir.Model):
        return _kind(ir.from_proto(ir.to_proto(model)), None)
    if isinstance(model, onnx.ModelProto):
        return _kind(ir.from_proto(model), None)
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
    return _kind(loaded, path)


def _kind(model: ir.Model, path: Path | None) -> Loaded:
    return Loaded(model, path, contract.model_kind(model.metadata_props))


def refuse_prompt_graph(loaded: Loaded) -> None:
    """A DiT's prompt graph runs as exported: the step graph beside it is what compiles."""
    if loaded.kind == contract.DIT_PROMPT:
        raise FastCarError("this is a DiT prompt graph (text embeddings -> cross-attention K/V), run as it is; "
                           "compile the step graph written beside it")


def inspect(model, **options) -> CompileReport:
    """Discovery and the plan, without compiling: what was found in each layer, why a layer did not match, and what
    a compile with these `options` (compile()'s keywords; `frame_tokens` 1 when absent) would build per layer."""
    declared.unknown(options, "inspect")
    options = {k: v for k, v in options.items() if not (k == "frame_tokens" and v is None)}
    loaded = load(model)
    refuse_prompt_graph(loaded)
    if loaded.kind == contract.DIT_STEP:
        return _inspect_dit(loaded, options)
    _refuse_dit_only(options)
    opts = CompileOptions(**{"frame_tokens": 1, **options})
    ctx = CompileContext(opts)
    fusions = pipeline.exporter_fusions(ctx)
    if fusions:  # (none with fusions=False: a PassManager takes at least one pass)
        pipeline.run(ir.passes.PassManager(fusions), loaded.model)
    notes = ctx.notes
    matches = find_layers(loaded.model, notes)
    report = CompileReport.from_matches(matches)
    rewritten = [m.layer for m in select_layers(matches, opts)]
    report.plan = plan(loaded.model, matches, rewritten, opts, notes).lines()
    report.notes.extend(notes)
    report.notes.extend(native_gqa.inspect_notes(loaded.model))
    return report


inspect.__signature__ = declared.signature(inspect, 1)  # the declared options, for help() and editors


def _inspect_dit(loaded: Loaded, options: dict) -> CompileReport:
    """A DiT step graph's blocks and the plan of a compile with these options (the modes each block would be built
    with, AnnSA's cost-model verdict included)."""
    opts = {**options, **declared.check_all({k: v for k, v in options.items() if v is not None})}
    matches = dit_discover.discover(loaded.model)
    report = CompileReport.from_dit_matches(matches)
    props = loaded.model.metadata_props
    if contract.DIT_CACHE_FORM_KEY in props:
        report.plan = dit_plan.plan(matches, contract.DiTModes()).lines()
        report.notes.append(f"already compiled (cache {props[contract.DIT_CACHE_FORM_KEY]}): compile the export")
        return report
    cfg = contract.dit_config_of(props, "the step graph")
    notes, modes = dit_plan.check_options(opts, cfg.tokens_per_frame)
    report.plan = dit_plan.plan(matches, modes, cfg=cfg, ann_always=bool(opts.get("ann_always"))).lines()
    report.notes.extend(notes)
    return report


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
    """Compile `model` (path, ModelProto, onnx_ir.Model or a `load()` result) for FastCar; save to `output` when given.

    The keywords are the options declared in fastcar_compile/core/options.py (their help there; `frame_tokens` is
    required for a decoder, a DiT step graph knows its own), e.g. `compile("model.onnx", "fast.onnx",
    frame_tokens=256, tas_query="raw", threshold=-4)`. The model's kind (load()) picks the target the pipeline runs
    (passes/pipeline.py): a decoder's, or a DiT step graph's, whose options are its modes (threshold: one tau,
    tempcache, annsa, annca and their bucket settings). genai=None: name the state for onnxruntime-genai's
    generator when the input sits beside a genai_config.json and the output goes to another folder. kv_layers:
    ["LAYERS:SETTINGS", ...] (passes/context.py parse_kv_layer). shared_mlp=False keeps the older nested MLP
    layout (docs/memory.md).
    """
    declared.unknown(options, "compile")
    declared.check_all({k: v for k, v in options.items() if v is not None})  # each in its range, before any work
    loaded = load(model)
    refuse_prompt_graph(loaded)
    out_path = fileio.check_output_path(output) if output is not None else None
    t0 = time.perf_counter()
    if loaded.kind == contract.DIT_STEP:
        ctx, staging = _dit_context(loaded, options, out_path)
        validate = ctx.options.get("validate", True)
    else:
        ctx, staging = _decoder_context(loaded, options, out_path)
        validate = ctx.options.validate
    manager = pipeline.build(ctx, staging, validate)
    try:
        with fileio.os_errors(str(out_path or "")):
            compiled = pipeline.run(manager, loaded.model).model  # a functional pass may hand on a new model
    finally:
        if staging is not None:
            staging.cleanup()
    report = _report(ctx)
    report.passes = pipeline.describe(manager)
    if isinstance(ctx, DiTContext) and out_path is not None:
        report.notes.append(f"cache read in place: past.N.* are the runtime's buffers, past_length the tokens they "
                            f"hold; prompt graph copied to {ctx.prompt_name} ({time.perf_counter() - t0:.1f} s)")
    return compiled, report


compile.__signature__ = declared.signature(compile, 2)  # the declared options, for help() and editors


def _decoder_context(loaded: Loaded, options: dict, out_path: Path | None
                     ) -> tuple[CompileContext, Staging | None]:
    """The decoder target's context (its options checked by CompileOptions) and the staging of its files."""
    opts = CompileOptions(**options)
    _refuse_dit_only(options)
    genai_config = _genai_config(opts.genai, loaded.path, out_path)
    staging = Staging(out_path, source=loaded.path) if out_path is not None else None
    if staging is not None:
        _check_files(loaded.path, staging, genai_config)
    return CompileContext(opts, genai_config=genai_config), staging


def _dit_context(loaded: Loaded, options: dict, out_path: Path | None) -> tuple[DiTContext, Staging | None]:
    """The DiT target's context (the options checked into its modes) and the staging of the step graph and the
    prompt graph copied beside it, every file it writes checked against every file it reads."""
    opts = {**options, **declared.check_all({k: v for k, v in options.items() if v is not None})}
    dit_plan.check_compilable(loaded.model)
    cfg = contract.dit_config_of(loaded.model.metadata_props, "the step graph")
    notes, modes = dit_plan.check_options(opts, cfg.tokens_per_frame)
    ctx = DiTContext(opts, modes, cfg, notes=notes)
    if loaded.path is not None:
        ctx.prompt_source = dit_prompt.prompt_source(loaded.path, loaded.model)
    if out_path is None:
        return ctx, None
    text_out = contract.text_graph_path(out_path)
    ctx.prompt_name = text_out.name
    staging = Staging(out_path, source=loaded.path)
    reads = dict(fileio.model_reads(loaded.path)) if loaded.path is not None else {}
    if ctx.prompt_source is not None:
        reads.update(fileio.model_reads(ctx.prompt_source, "the prompt graph"))
    fileio.check_outputs({**{f: "output" for f in staging.files()}, text_out: "the prompt graph's copy",
                          text_out.with_name(text_out.name + ".data"): "the prompt graph's data"}, reads)
    return ctx, staging


def _report(ctx: CompileContext | DiTContext) -> CompileReport:
    """What discovery found per layer, which were rewritten, the notes, the metadata and the plan."""
    if isinstance(ctx, DiTContext):
        report = CompileReport.from_dit_matches(ctx.matches)
    else:
        report = CompileReport.from_matches(ctx.matches)
    done = set(ctx.rewritten)
    for r in report.layers:
        r.rewritten = r.layer in done
    report.notes = ctx.notes
    report.metadata = ctx.metadata
    report.plan = ctx.plan.lines()
    return report


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
    model = load(src).model
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
    loaded = load(src).model
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


DIT_PROBE_TAU = 3e38  # above any TAS: the calibration probe computes and outputs TAS but replays nothing


def calibrate_dit(path: str | os.PathLike, ratio: float, *, text=None, frames: int = 3, **options) -> float:
    """`--calibrate-replay` on a DiT step graph: the tau giving FFN replay ratio `ratio` over the eligible rows (the
    decoders' one-pass calibration, for the DiT target). A probe compiled with FastCar on and a tau no TAS exceeds
    streams `frames` frames (at least two chunks; the prompt `text` [L, text_dim] or a seeded random one) and the
    quantile of the TAS it outputs is the tau. `options`: the compile's other options (TempCache, AnnSA and AnnCA
    change the rollout whose TAS sets tau: the probe has them)."""
    import tempfile

    import numpy as np

    from fastcar_compile.dit.stream import OrtDiT, StreamSettings, rollout
    from fastcar_compile.runtime.calib_stats import tau_for_share

    options = {k: v for k, v in options.items() if k not in ("threshold", "validate")}
    with tempfile.TemporaryDirectory() as tmp:
        probe = Path(tmp) / "probe.onnx"
        compile(path, probe, **{**options, "threshold": (DIT_PROBE_TAU,), "validate": False, "provider": "cpu"})
        runtime = OrtDiT(probe)
        runtime.tas_log = []
        for _ in rollout(runtime, StreamSettings(frames=max(frames, 2 * runtime.cfg.chunk_frames)), text):
            pass
    return tau_for_share(np.concatenate(runtime.tas_log), ratio)
