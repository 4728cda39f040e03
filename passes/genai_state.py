"""Carry FastCar's state through onnxruntime-genai's own decode loop (`og.Generator`), unpatched.

genai recycles exactly these per-layer tensors from step to step (its RecurrentState, src/models/
recurrent_state.cpp, engaged for any decoder whose inputs match the names derived from the KV template
`past_key_values.%d.key`): `past_key_values.N.conv_state` -> `present.N.conv_state` and
`past_key_values.N.recurrent_state` -> `present.N.recurrent_state`. It allocates them from the input's
static shape (only batch may be symbolic), zero-fills them for a new sequence and binds each present to
its past buffer (updated in place). Everything else (extra inputs, unmanaged outputs) is set once or
dropped.

So a compiled model that should run in genai names its MLP cache `conv_state` ([batch, L, hidden]) and its
age `recurrent_state` ([batch, L]) and stores the age shifted by one: genai's zero fill must mean "slot never
written" (age -1). The ops that read and write the age (the gate, MLPCacheUpdate) take that encoding as their
`age_offset` attribute; the state metadata records the new names with fill 0, so FastCarSession runs the same
file. The output folder gets the input's
genai_config.json (model file name replaced) and its tokenizer files: read and checked before compiling
(`read_config`, `companions`), written into the model's staging folder and committed with the model as one
unit (save.Staging.add), so a broken folder or a full disk never leaves a model without its config.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import onnx_ir as ir

from fastcar_compile.core.errors import FastCarError
from fastcar_compile.core.fileio import copy_file, read_json
from fastcar_compile.passes.context import GENAI_AGE_FILL, CompileContext

if TYPE_CHECKING:
    from fastcar_compile.passes.save import Staging

CONFIG = "genai_config.json"
CACHE_IN, CACHE_OUT = "past_key_values.{n}.conv_state", "present.{n}.conv_state"
AGE_IN, AGE_OUT = "past_key_values.{n}.recurrent_state", "present.{n}.recurrent_state"
MAX_CONFIG_BYTES = 16 << 20  # genai_config.json is a few KB
MAX_COMPANION_BYTES = 1 << 30  # a tokenizer or processor file is MBs (Llama 3's tokenizer.json: 9 MB)


def beside(model_path: Path | None) -> Path | None:
    """The genai_config.json next to the input model, if there is one."""
    if model_path is None:
        return None
    cfg = Path(model_path).parent / CONFIG
    return cfg if cfg.is_file() else None


def read_config(config: Path) -> dict[str, Any]:
    """The input's genai_config.json, checked before anything is compiled: a JSON object (bounded size and
    depth, fileio.read_json) with a `model.decoder` object whose `filename` is a string."""
    cfg = read_json(config, CONFIG, max_bytes=MAX_CONFIG_BYTES)
    model = cfg.get("model")
    decoder = model.get("decoder") if isinstance(model, dict) else None
    if not isinstance(decoder, dict):
        raise FastCarError(f"{CONFIG} {config} has no \"model\": {{\"decoder\": {{...}}}} object; fix it, or compile "
                           "with --no-genai")
    if not isinstance(decoder.get("filename", "model.onnx"), str):
        raise FastCarError(f"{CONFIG} {config}: model.decoder.filename must be a file name string; fix it, or "
                           "compile with --no-genai")
    return cfg


def companions(config: Path, cfg: dict[str, Any]) -> list[Path]:
    """The tokenizer and processing files beside the config that the output folder gets a copy of: not the
    config, not a model or its weights (`*.onnx*`, `*.data`, the config's model file name)."""
    model = str(cfg["model"]["decoder"].get("filename", "model.onnx"))
    out = []
    for f in sorted(config.parent.iterdir()):
        if f.name == CONFIG or ".onnx" in f.name or f.suffix == ".data" or f.name.startswith(model) \
                or not f.is_file():
            continue
        if (size := f.stat().st_size) > MAX_COMPANION_BYTES:
            raise FastCarError(f"{f} beside {CONFIG} is {size / 2**30:.1f} GiB, too large for a tokenizer or "
                               "processing file; move it out of the folder, or compile with --no-genai")
        out.append(f)
    return out


def _library_name() -> str | None:
    """The file name the native kernels will have beside the model (no build)."""
    from fastcar_compile.runtime.native import ENV
    from fastcar_compile.runtime.native.build import lib_path

    env = os.environ.get(ENV)
    return None if env == "0" else Path(env).name if env and env != "1" else lib_path().name


def planned_files(config: Path, output: Path) -> tuple[dict[Path, str], dict[Path, str]]:
    """(files the genai output writes, files it reads), labelled, for fileio.check_outputs before compiling;
    validates the config and its companions on the way."""
    cfg = read_config(config)
    files = companions(config, cfg)
    out_dir = output.parent
    writes = {out_dir / CONFIG: f"the output's {CONFIG}"}
    writes.update({out_dir / f.name: f"the output's copy of {f.name}" for f in files})
    if (lib := _library_name()) is not None:
        writes[out_dir / lib] = "the output's native kernel library"
    reads = {config: f"the input's {CONFIG}", **{f: "a tokenizer file beside the input" for f in files}}
    return writes, reads


class GenaiStatePass(ir.passes.InPlacePass):
    """onnxruntime-genai: state renamed to the recurrent-state names genai recycles; age stored + 1."""

    def __init__(self, ctx: CompileContext):
        super().__init__()
        self.ctx = ctx

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        if self.ctx.genai_config is None:
            return ir.passes.PassResult(model, modified=False)
        graph = model.graph
        inputs = {v.name: v for v in graph.inputs}
        outputs = {v.name: v for v in graph.outputs}
        for lr in self.ctx.layers:
            n = lr.layer
            cache, age = lr.state
            inputs[cache.input].name = CACHE_IN.format(n=n)
            outputs[cache.output].name = CACHE_OUT.format(n=n)
            # every reader and the writer of the age are ai.fastcar ops built with the encoding as an attribute
            # (CompileContext.age_attrs: no Sub/Add launches per layer and step)
            age_in, age_out = inputs[age.input], outputs[age.output]
            age_in.name, age_out.name = AGE_IN.format(n=n), AGE_OUT.format(n=n)
            lr.state = [dataclasses.replace(cache, input=CACHE_IN.format(n=n), output=CACHE_OUT.format(n=n)),
                        dataclasses.replace(age, input=AGE_IN.format(n=n), output=AGE_OUT.format(n=n),
                                            fill=GENAI_AGE_FILL)]
        self.ctx.notes.append("state named for onnxruntime-genai's generator (conv_state = MLP cache, "
                              "recurrent_state = age + 1)")
        return ir.passes.PassResult(model, modified=True)


def native_library(cfg: dict, staging: Staging) -> str | None:
    """Copy the native ai.fastcar kernels beside the model and name them in `cfg` (genai's session_options
    `custom_ops_library`); returns the file name, or None (FASTCAR_NATIVE=0 or no compiler: genai then runs the
    ops' function bodies). genai 0.18 loads a custom-op library only from inside the model folder, the working
    directory or an EP's folder, and resolves a relative name against the model folder first: a relative name
    keeps the output folder self-contained and movable (docs/genai.md)."""
    from fastcar_compile.runtime.native import library_path

    lib = library_path()
    if lib is None:
        return None
    copy_file(lib, staging.add(lib.name))
    cfg["model"]["decoder"].setdefault("session_options", {})["custom_ops_library"] = lib.name
    return lib.name


class GenaiConfigPass(ir.passes.InPlacePass):
    """onnxruntime-genai: genai_config.json (model file = the output) and tokenizer files, staged with the model."""

    def __init__(self, ctx: CompileContext, staging: Staging):
        super().__init__()
        self.ctx, self.staging = ctx, staging

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        config = self.ctx.genai_config
        if config is None:
            return ir.passes.PassResult(model, modified=False)
        cfg = read_config(config)
        output = self.staging.output
        self.staging.write(model)  # the staging folder (a no-op when validation already wrote it)
        for f in companions(config, cfg):
            if not (output.parent / f.name).exists():  # a file the user put in the output folder stays theirs
                copy_file(f, self.staging.add(f.name))
        cfg["model"]["decoder"]["filename"] = output.name
        if (name := native_library(cfg, self.staging)) is not None:
            self.ctx.notes.append(f"onnxruntime-genai: native ai.fastcar kernels {output.parent / name} "
                                  "(genai_config.json custom_ops_library)")
        self.staging.add(CONFIG).write_text(json.dumps(cfg, indent=4))
        self.ctx.notes.append(f"onnxruntime-genai: {output.parent / CONFIG}")
        return ir.passes.PassResult(model, modified=False)
