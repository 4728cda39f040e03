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
genai_config.json (model file name replaced) and its tokenizer files.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import onnx_ir as ir

from fastcar_compile import contract
from fastcar_compile.atomic import write_bytes, write_text
from fastcar_compile.passes.context import CompileContext

CONFIG = "genai_config.json"
CACHE_IN, CACHE_OUT = "past_key_values.{n}.conv_state", "present.{n}.conv_state"
AGE_IN, AGE_OUT = "past_key_values.{n}.recurrent_state", "present.{n}.recurrent_state"
GENAI_AGE_FILL = 0  # genai zero-fills; stored age = age + 1


def beside(model_path: Path | None) -> Path | None:
    """The genai_config.json next to the input model, if there is one."""
    if model_path is None:
        return None
    cfg = Path(model_path).parent / CONFIG
    return cfg if cfg.is_file() else None


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
            age_in, age_out = inputs[age.input], outputs[age.output]
            # every reader and the writer of the age are ai.fastcar ops: they take the encoding as an attribute
            # (no Sub/Add launches per layer and step)
            for node in {node for node, _ in age_in.uses()} | {age_out.producer()}:
                if node is None or node.domain != contract.DOMAIN \
                        or "age_offset" not in contract.OP_ATTRIBUTES.get(node.op_type, ()):
                    raise RuntimeError(f"internal: the age of layer {n} is read or written by {node}, not an "
                                       "ai.fastcar op taking age_offset")
                node.attributes["age_offset"] = ir.AttrInt64("age_offset", GENAI_AGE_FILL - contract.AGE_FILL)
            age_in.name, age_out.name = AGE_IN.format(n=n), AGE_OUT.format(n=n)
            lr.state = [dataclasses.replace(cache, input=CACHE_IN.format(n=n), output=CACHE_OUT.format(n=n)),
                        dataclasses.replace(age, input=AGE_IN.format(n=n), output=AGE_OUT.format(n=n),
                                            fill=GENAI_AGE_FILL)]
        self.ctx.notes.append("state named for onnxruntime-genai's generator (conv_state = MLP cache, "
                              "recurrent_state = age + 1)")
        return ir.passes.PassResult(model, modified=True)


def native_library(cfg: dict, out_dir: Path) -> str | None:
    """Copy the native ai.fastcar kernels beside the model and name them in `cfg` (genai's session_options
    `custom_ops_library`); returns the file name, or None (FASTCAR_NATIVE=0 or no compiler: genai then runs the
    ops' function bodies). genai 0.18 loads a custom-op library only from inside the model folder, the working
    directory or an EP's folder, and resolves a relative name against the model folder first: a relative name
    keeps the output folder self-contained and movable (docs/genai.md)."""
    from fastcar_compile.runtime.native import library_path

    lib = library_path()
    if lib is None:
        return None
    write_bytes(out_dir / lib.name, lib.read_bytes())
    cfg["model"]["decoder"].setdefault("session_options", {})["custom_ops_library"] = lib.name
    return lib.name


class GenaiConfigPass(ir.passes.InPlacePass):
    """onnxruntime-genai: genai_config.json (model file = the output) and tokenizer files beside the output."""

    def __init__(self, ctx: CompileContext, output: Path):
        super().__init__()
        self.ctx, self.output = ctx, Path(output)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        config = self.ctx.genai_config
        if config is None:
            return ir.passes.PassResult(model, modified=False)
        cfg = json.loads(config.read_text())
        old_name = str(cfg["model"]["decoder"].get("filename", "model.onnx"))
        cfg["model"]["decoder"]["filename"] = self.output.name
        out_dir = self.output.parent
        for f in config.parent.iterdir():  # tokenizer and processing files; not the model or its weights
            if f.is_file() and f.name != CONFIG and not f.name.startswith(old_name) and f.suffix != ".onnx" \
                    and not (out_dir / f.name).exists():
                write_bytes(out_dir / f.name, f.read_bytes())
        self._native_library(cfg, out_dir)
        self.ctx.notes.append(f"onnxruntime-genai: {write_text(out_dir / CONFIG, json.dumps(cfg, indent=4))}")
        return ir.passes.PassResult(model, modified=False)

    def _native_library(self, cfg: dict, out_dir: Path) -> None:
        if (name := native_library(cfg, out_dir)) is not None:
            self.ctx.notes.append(f"onnxruntime-genai: native ai.fastcar kernels {out_dir / name} "
                                  "(genai_config.json custom_ops_library)")
