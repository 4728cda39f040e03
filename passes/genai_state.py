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
written" (age -1). The graph converts on the way in (`- 1`) and out (`+ 1`); `fastcar.state` records the new
names with fill 0, so FastCarSession runs the same file. The output folder gets the input's
genai_config.json (model file name replaced) and its tokenizer files.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx_ir as ir

from fastcar_compile.atomic import write_bytes, write_text

CONFIG = "genai_config.json"
CACHE_IN, CACHE_OUT = "past_key_values.{n}.conv_state", "present.{n}.conv_state"
AGE_IN, AGE_OUT = "past_key_values.{n}.recurrent_state", "present.{n}.recurrent_state"


def beside(model_path: Path | None) -> Path | None:
    """The genai_config.json next to the input model, if there is one."""
    if model_path is None:
        return None
    cfg = Path(model_path).parent / CONFIG
    return cfg if cfg.is_file() else None


def rename_state(model: ir.Model, records: list[dict]) -> list[dict]:
    """Rename each layer's FastCar state to genai's recurrent-state names, age stored + 1; returns new records."""
    graph = model.graph
    one = ir.Value(name="fastcar.genai.one", const_value=ir.tensor(np.array(1, np.int64), name="fastcar.genai.one"))
    one.type, one.shape = ir.TensorType(ir.DataType.INT64), ir.Shape([])
    graph.register_initializer(one)
    inputs = {v.name: v for v in graph.inputs}
    outputs = {v.name: v for v in graph.outputs}
    out_records = []
    for rec in records:
        n = rec["layer"]
        cache_spec, age_spec = rec["state"]
        inputs[cache_spec["input"]].name = CACHE_IN.format(n=n)
        outputs[cache_spec["output"]].name = CACHE_OUT.format(n=n)

        old_in = inputs[age_spec["input"]]
        new_in = ir.Value(name=AGE_IN.format(n=n), type=old_in.type, shape=old_in.shape)
        old_in.name = f"fastcar.{n}.age_in"
        sub = ir.node("Sub", [new_in, one], name=f"fastcar/{n}/genai_age_in",
                      metadata_props={"fastcar.layer": str(n), "fastcar.part": "cache"})
        ir.convenience.replace_all_uses_with(old_in, sub.outputs[0])
        sub.outputs[0].name, sub.outputs[0].type = f"fastcar.{n}.age", old_in.type
        graph.inputs[graph.inputs.index(old_in)] = new_in
        graph.insert_before(graph[0], sub)

        old_out = outputs[age_spec["output"]]
        add = ir.node("Add", [old_out, one], name=f"fastcar/{n}/genai_age_out",
                      metadata_props={"fastcar.layer": str(n), "fastcar.part": "cache"})
        graph.outputs[graph.outputs.index(old_out)] = add.outputs[0]
        old_out.name = f"fastcar.{n}.age_out"
        add.outputs[0].name, add.outputs[0].type, add.outputs[0].shape = AGE_OUT.format(n=n), old_out.type, \
            old_out.shape
        graph.append(add)
        out_records.append({**rec, "state": [
            {**cache_spec, "input": CACHE_IN.format(n=n), "output": CACHE_OUT.format(n=n)},
            {**age_spec, "input": AGE_IN.format(n=n), "output": AGE_OUT.format(n=n), "fill": 0,
             "encoding": "age + 1 (0 = slot never written)"},
        ]})
    return out_records


def write_config(config: Path, output: Path) -> Path:
    """genai_config.json (decoder file name = the output's) and the tokenizer files, beside the output."""
    cfg = json.loads(config.read_text())
    cfg["model"]["decoder"]["filename"] = output.name
    src_dir, out_dir = config.parent, output.parent
    old_model = src_dir / str(json.loads(config.read_text())["model"]["decoder"].get("filename", "model.onnx"))
    for f in src_dir.iterdir():  # tokenizer and processing files; not the model or its weights
        if f.is_file() and f.name != CONFIG and not f.name.startswith(old_model.name) and f.suffix != ".onnx" \
                and not (out_dir / f.name).exists():
            write_bytes(out_dir / f.name, f.read_bytes())
    return write_text(out_dir / CONFIG, json.dumps(cfg, indent=4))
