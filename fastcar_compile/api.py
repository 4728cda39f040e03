"""Python API: load -> analyse -> rewrite -> validate -> save.

`compile()` never modifies its input (paths are read, in-memory models are copied) and writes its output
atomically: the result is serialised into a temporary folder next to the output, checked with
`onnx.checker` and opened in an ONNX Runtime session, and only then renamed into place.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import onnx
import onnx_ir as ir
from onnx_ir.passes.common import ShapeInferencePass

from fastcar_compile import fileio, limits
from fastcar_compile._version import __version__
from fastcar_compile.errors import FastCarError
from fastcar_compile.passes import discover as disc
from fastcar_compile.passes.rewrite import TAS_QUERIES, RewriteOptions, rewrite

# Above this many bytes of weights the ORT check is skipped (opening the session would load them all).
ORT_VALIDATE_LIMIT = 2 << 30


@dataclass
class LayerReport:
    layer: int
    matched: bool
    rewritten: bool
    summary: str
    trace: list[str] = field(default_factory=list)


@dataclass
class CompileReport:
    """What discovery found, per layer, and what the rewrite did (what `--inspect` prints)."""

    layers: list[LayerReport]
    notes: list[str] = field(default_factory=list)
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def rewritten(self) -> list[int]:
        return [r.layer for r in self.layers if r.rewritten]

    @property
    def matched(self) -> list[int]:
        return [r.layer for r in self.layers if r.matched]

    def format(self, verbose: bool = False) -> str:
        lines = [f"{len(self.matched)}/{len(self.layers)} decoder layers matched"]
        for r in self.layers:
            state = "rewritten" if r.rewritten else ("matched" if r.matched else "NOT MATCHED")
            lines.append(f"  layer {r.layer:>3}: {state:<11} {r.summary}")
            if verbose or not r.matched:
                lines.extend(f"               {t}" for t in r.trace)
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)


def _load(model) -> tuple[ir.Model, Path | None]:
    if isinstance(model, ir.Model):
        return ir.from_proto(ir.to_proto(model)), None
    if isinstance(model, onnx.ModelProto):
        return ir.from_proto(model), None
    path = Path(model)
    if path.is_dir():
        raise FastCarError(f"{path} is a directory; pass the path of an exported .onnx decoder file in it")
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


def _discover(model: ir.Model) -> list[disc.LayerMatch]:
    if "fastcar.version" in model.metadata_props or any(n.domain == "ai.fastcar" for n in model.graph):
        raise FastCarError("the model is already compiled by fastcar-compile (fastcar.version "
                           f"{model.metadata_props.get('fastcar.version', '?')}); compile the original export, "
                           "or change the threshold with fastcar_compile.runtime.calibrate.bake_threshold")
    if not disc.kv_outputs(model.graph):
        outs = ", ".join(o.name for o in model.graph.outputs[:6])
        raise FastCarError("the model has no KV-cache outputs (present.N.key / present.N.value; found: "
                           f"{outs}); export the decoder with use_cache=True and name its outputs present.N.key|value")
    matches = disc.discover(model)
    if not all(m.ok for m in matches) and _weight_bytes(model) <= ORT_VALIDATE_LIMIT:
        # Some exporters (TorchScript) leave intermediate shapes unknown: infer them and look again.
        model_inferred = ShapeInferencePass()(model).model
        if model_inferred is not model:
            model.graph = model_inferred.graph  # pragma: no cover - the pass works in place
        matches = disc.discover(model)
    return matches


def _weight_bytes(model: ir.Model) -> int:
    total = 0
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if tensor is not None:
            total += math.prod(tensor.shape) * tensor.dtype.itemsize
    return total


def parse_layers(spec: str | list[int] | None, available: list[int]) -> list[int] | None:
    """'0,2-5' -> [0, 2, 3, 4, 5], checked against the layers the model has."""
    if spec is None:
        return None
    if isinstance(spec, str):
        out: list[int] = []
        for part in spec.split(","):
            part = part.strip()
            try:
                if "-" in part:
                    lo, hi = (int(x) for x in part.split("-", 1))
                    if hi < lo:
                        raise ValueError
                    top = max(available, default=-1)
                    if lo < 0 or hi > top:  # checked before expanding: 0-1000000000 must not allocate
                        raise FastCarError(f"--layers: range {part} goes beyond the model's layers "
                                           f"(0-{top}); use indices and ranges within them")
                    out.extend(range(lo, hi + 1))
                else:
                    out.append(int(part))
            except ValueError:
                raise FastCarError(f"--layers: cannot read '{part}' in '{spec}'; use indices and ranges like 0,2-5") from None
    else:
        out = [int(x) for x in spec]
    missing = sorted(set(out) - set(available))
    if missing:
        raise FastCarError(f"--layers: the model has no decoder layer {missing}; it has layers "
                           f"{available[0]}-{available[-1]}" if available else "--layers: the model has no layers")
    return sorted(set(out))


def _summary(m: disc.LayerMatch) -> str:
    if m.failure is not None:
        where = f" (search stopped at {m.failure.where})" if m.failure.where else ""
        return f"missing anchor '{m.failure.anchor}': {m.failure.reason}{where}"
    a, b = m.attention, m.mlp
    return (f"heads {a.num_heads}/{a.num_kv_heads}x{a.head_dim}, rotary {a.rope}, "
            f"MLP {len(b.nodes)} nodes {b.weights}{' (fused norm)' if b.fused_norm else ''}")


def inspect(model) -> CompileReport:
    """Discovery only: what was found in each layer, and why a layer did not match."""
    loaded, _ = _load(model)
    matches = _discover(loaded)
    return CompileReport([LayerReport(m.layer, m.ok, False, _summary(m), m.trace) for m in matches])


def compile(  # noqa: A001 - the natural name of the entry point
    model,
    output: str | os.PathLike | None = None,
    *,
    frame_tokens: int,
    threshold: float | list[float] = -4.0,
    tas_query: str = "rope",
    max_replay: int = 0,
    layers: str | list[int] | None = None,
    per_layer_threshold: bool = False,
    emit_diagnostics: bool = False,
    validate: bool = True,
) -> tuple[ir.Model, CompileReport]:
    """Compile `model` (path, ModelProto or onnx_ir.Model) for FastCar; save to `output` when given."""
    limits.check_int("--frame-tokens", frame_tokens, 1, limits.MAX_FRAME_TOKENS, "tokens per video frame")
    taus = limits.thresholds(threshold)
    if tas_query not in TAS_QUERIES:
        raise FastCarError(f"--tas-query must be one of {TAS_QUERIES}, got {tas_query!r}")
    limits.check_int("--max-replay", max_replay, 0, limits.MAX_REPLAY, "0 = unlimited")
    out_path = Path(output) if output is not None else None
    if out_path is not None:
        fileio.check_output_path(out_path)
    loaded, in_path = _load(model)
    if out_path is not None and in_path is not None:
        if fileio.same_file(in_path, out_path):
            raise FastCarError(f"output {out_path} is the input model; choose another -o path (the input is "
                               "never overwritten)")
        fileio.refuse_collisions(fileio.model_files(in_path), output_files(out_path))

    matches = _discover(loaded)
    report = CompileReport([LayerReport(m.layer, m.ok, False, _summary(m), m.trace) for m in matches])
    if not any(m.ok for m in matches):
        raise FastCarError("no decoder layer matched; run with --inspect to see which anchor is missing per layer\n"
                           + report.format())
    chosen = parse_layers(layers, [m.layer for m in matches])
    selected = [m for m in matches if m.ok and (chosen is None or m.layer in chosen)]
    unmatched = [m.layer for m in matches if not m.ok and (chosen is None or m.layer in chosen)]
    if chosen is not None and unmatched:
        raise FastCarError(f"--layers asks for layers {unmatched} that did not match:\n" + report.format())
    if unmatched:
        report.notes.append(f"layers {unmatched} left dense (not matched)")
    if per_layer_threshold and len(taus) not in (1, len(selected)):
        raise FastCarError(f"--threshold gives {len(taus)} values for {len(selected)} rewritten layers")
    if not per_layer_threshold and len(taus) != 1:
        raise FastCarError("several thresholds need --per-layer-threshold")

    limits.check_state_size(frame_tokens, selected[0].mlp.hidden, len(selected))
    opts = RewriteOptions(frame_tokens, tuple(taus) if per_layer_threshold else taus[0], tas_query, max_replay,
                          per_layer_threshold, emit_diagnostics)
    records = rewrite(loaded, selected, opts)
    if loaded.ir_version < 8:
        report.notes.append(f"IR version raised from {loaded.ir_version} to 8 (model-local functions)")
        loaded.ir_version = 8
    done = {r["layer"] for r in records}
    for r in report.layers:
        r.rewritten = r.layer in done
    first = selected[0]
    meta = {
        "fastcar.version": __version__,
        "fastcar.frame_tokens": str(frame_tokens),
        "fastcar.threshold": json.dumps(list(opts.threshold) if per_layer_threshold else opts.threshold),
        "fastcar.per_layer_threshold": json.dumps(per_layer_threshold),
        "fastcar.layers": json.dumps(sorted(done)),
        "fastcar.num_layers": str(len(matches)),
        "fastcar.tas_query": tas_query,
        "fastcar.max_replay": str(max_replay),
        "fastcar.hidden_size": str(first.mlp.hidden),
        "fastcar.num_heads": str(first.attention.num_heads),
        "fastcar.num_kv_heads": str(first.attention.num_kv_heads),
        "fastcar.head_dim": str(first.attention.head_dim),
        "fastcar.state": json.dumps([s for r in records for s in r["state"]]),
        "fastcar.kv": json.dumps([{"input": f"past_key_values.{m.layer}.{k}", "output": f"present.{m.layer}.{k}"}
                                  for m in matches for k in ("key", "value")]),
        "fastcar.diagnostics": json.dumps(emit_diagnostics),
    }
    loaded.metadata_props.update(meta)
    report.metadata = meta
    if out_path is not None:
        save(loaded, out_path, validate=validate, external=_has_external(loaded),
             source=in_path)
    return loaded, report


def output_files(output: str | os.PathLike) -> list[Path]:
    """Every file `save` may write for `output`: the model and its external-data file."""
    output = Path(output)
    return [output, output.parent / (output.name + ".data")]


def _has_external(model: ir.Model) -> bool:
    """Were the input's weights in an external-data file? (Read off the loaded model: no second parse.)"""
    return any(isinstance(v.const_value, ir.ExternalTensor) for v in model.graph.initializers.values())


def _unknown_contrib_op(exc: Exception, model: ir.Model) -> bool:
    """onnx.checker rejects ORT contrib ops registered in the ONNX domain (SimplifiedLayerNormalization,
    which onnxscript's ort_fusions emits); the input had them too, so ORT alone is the judge there."""
    text = str(exc)
    if "No Op registered for" not in text:
        return False
    op = text.split("No Op registered for", 1)[1].split()[0]
    return any(node.op_type == op for node in model.graph)


def _save_linked(model: ir.Model, tmp_model: Path, data_name: str, source: Path | None) -> bool:
    """Save without parsing the weights: the input's external-data file is copied (a reflink or a sparse
    copy where possible, fileio.copy_file; never a hard link, which onnx refuses to load and which would tie
    both models' weights) next to the output under the output's name, at unchanged offsets; the few new
    tensors are stored inline. Returns False when the weights live in several files (ir.save copies them)."""
    if source is None:
        return False
    locations = {v.const_value.location for v in model.graph.initializers.values()
                 if isinstance(v.const_value, ir.ExternalTensor)}
    if len(locations) != 1:
        return False
    (location,) = locations
    src = source.parent / location
    if not src.is_file():
        return False
    proto = ir.to_proto(model)
    for tensor in proto.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            for entry in tensor.external_data:
                if entry.key == "location":
                    entry.value = data_name
    fileio.copy_file(src, tmp_model.parent / data_name)
    with open(tmp_model, "wb") as f:
        f.write(proto.SerializeToString())
    return True


def _without_external_weights(proto: onnx.ModelProto) -> onnx.ModelProto:
    """The same graph with external weights turned into typed graph inputs, for a structural check."""
    keep = []
    for tensor in proto.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            proto.graph.input.append(onnx.helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims)))
        else:
            keep.append(tensor)
    del proto.graph.initializer[:]
    proto.graph.initializer.extend(keep)
    return proto


def _ort_loads(path: Path) -> bool:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 4
    try:
        ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    except Exception:  # noqa: BLE001
        return False
    return True


def save(model: ir.Model, output: Path, *, validate: bool = True, external: bool = False,
         source: Path | None = None) -> None:
    """Validate and write atomically: temp folder beside `output`, checker + ORT, then rename into place."""
    output = fileio.check_output_path(output)
    with fileio.os_errors(str(output)):
        _save(model, output, validate=validate, external=external, source=source)


def _save(model: ir.Model, output: Path, *, validate: bool, external: bool, source: Path | None) -> None:
    big = _weight_bytes(model) > ORT_VALIDATE_LIMIT
    data_name = output.name + ".data"
    created = fileio._first_missing(output.parent)
    ok = False
    tmp = None
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".fastcar-", dir=output.parent))
        tmp_model = tmp / output.name
        if not (external or big):
            ir.save(model, tmp_model)
        elif not _save_linked(model, tmp_model, data_name, source):
            ir.save(model, tmp_model, external_data=data_name)
        if validate:
            try:
                if external or big:
                    # Structure only: the weights are the input's, unchanged (and possibly hard-linked, which
                    # the checker's external-data check refuses); the proto without them is small.
                    onnx.checker.check_model(
                        _without_external_weights(onnx.load(str(tmp_model), load_external_data=False)))
                else:  # inline weights: let the checker read the file itself (no Python copy of the proto)
                    onnx.checker.check_model(str(tmp_model))
            except Exception as exc:  # noqa: BLE001
                if not _unknown_contrib_op(exc, model):
                    raise FastCarError(f"internal error: the compiled model fails onnx.checker: {exc}") from None
            if not big:
                import onnxruntime as ort

                so = ort.SessionOptions()
                so.intra_op_num_threads = 1
                so.log_severity_level = 3  # the overridable-initializer warning is by design
                try:
                    ort.InferenceSession(str(tmp_model), so, providers=["CPUExecutionProvider"])
                except Exception as exc:  # noqa: BLE001
                    if source is not None and not _ort_loads(source):
                        raise FastCarError(f"the input model {source} does not load in ONNX Runtime either "
                                           f"({str(exc)[:300]}); fix or re-export it first") from None
                    raise FastCarError(f"internal error: ONNX Runtime rejects the compiled model: {exc}") from None
        if (tmp / data_name).exists():
            if (output.parent / data_name).is_dir():
                raise FastCarError(f"{output.parent / data_name} is a directory; the output's data file "
                                   "goes there: remove it or choose another -o")
            os.replace(tmp / data_name, output.parent / data_name)
        os.replace(tmp_model, output)
        ok = True
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if not ok and created is not None:
            shutil.rmtree(created, ignore_errors=True)
