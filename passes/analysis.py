"""Discovery as passes: find the decoder layers (an analysis), select the ones to rewrite, plan each layer.

`DiscoverPass` wraps `passes.discover.discover` (the matchers) and attaches its `LayerMatch` list to the
context; it only changes the model when a first look fails and ONNX shape inference is run to fill in
shapes some exporters leave unknown. `SelectLayersPass` applies `--layers` and checks the thresholds.
`PlanPass` decides, from the matches and the options, what each layer becomes (passes/plan.py).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import NamedTuple

import onnx_ir as ir
from onnx_ir.passes.common import ShapeInferencePass

from fastcar_compile.core import contract
from fastcar_compile.core.errors import FastCarError
from fastcar_compile.core.limits import check_state_size
from fastcar_compile.core.options import parse_layer_ranges
from fastcar_compile.passes import attention_form, fused_attention, native_gqa
from fastcar_compile.passes import discover as disc
from fastcar_compile.passes.compile_report import CompileReport
from fastcar_compile.passes.context import CompileContext, CompileOptions, weight_bytes
from fastcar_compile.passes.plan import Plan, plan_blocks

# Above this many bytes of weights shape inference is not tried (it would serialise every weight).
SHAPE_INFERENCE_LIMIT = 2 << 30
_SHAPE_LOGGER = "onnx_ir.passes.common.shape_inference"


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        exc = record.exc_info[1] if record.exc_info else None
        self.messages.append(f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}" if exc else record.getMessage())


@contextmanager
def _quiet_shape_inference():
    """onnx-ir logs a failed shape inference with a full traceback; collect it as one line instead."""
    log = logging.getLogger(_SHAPE_LOGGER)
    handler, propagate = _Collect(), log.propagate
    log.addHandler(handler)
    log.propagate = False
    try:
        yield handler.messages
    finally:
        log.removeHandler(handler)
        log.propagate = propagate


def infer_shapes(model: ir.Model) -> str | None:
    """Run ONNX shape inference in place; returns a one-line reason when it failed (model unchanged)."""
    with _quiet_shape_inference() as messages:
        result = ShapeInferencePass()(model)
    if result.model is not model:  # pragma: no cover - the pass works in place
        model.graph = result.model.graph
    return messages[0] if messages else None


def find_layers(model: ir.Model, notes: list[str] | None = None) -> list[disc.LayerMatch]:
    """Discovery, retried after shape inference when a layer does not match (TorchScript leaves shapes out)."""
    if "fastcar.version" in model.metadata_props or any(n.domain == contract.DOMAIN for n in model.graph):
        raise FastCarError("the model is already compiled by fastcar-compile (fastcar.version "
                           f"{model.metadata_props.get('fastcar.version', '?')}); compile the original export "
                           "(to change tau, use fastcar_compile.api.bake_threshold)")
    if not disc.kv_outputs(model.graph):
        outs = ", ".join(o.name for o in model.graph.outputs[:6])
        raise FastCarError("the model has no KV-cache outputs (present.N.key / present.N.value; found: "
                           f"{outs}); export the decoder with use_cache=True and name its outputs present.N.key|value")
    matches = disc.discover(model)
    if not all(m.ok for m in matches) and weight_bytes(model) <= SHAPE_INFERENCE_LIMIT:
        failed = infer_shapes(model)
        if failed and notes is not None:
            notes.append(f"ONNX shape inference failed ({failed}); discovery used the exporter's shapes")
        matches = disc.discover(model)
    return matches


class DiscoverPass(ir.passes.InPlacePass):
    """Analysis: one `LayerMatch` per KV-cache layer, attached to the context as `ctx.matches`."""

    def __init__(self, ctx: CompileContext):
        super().__init__()
        self.ctx = ctx

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        before = len(self.ctx.notes)
        self.ctx.matches = find_layers(model, self.ctx.notes)
        if not any(m.ok for m in self.ctx.matches):
            raise FastCarError("no decoder layer matched; run with --inspect to see which anchor is missing per "
                               "layer\n" + CompileReport.from_matches(self.ctx.matches).format())
        return ir.passes.PassResult(model, modified=len(self.ctx.notes) != before)


def parse_layers(spec: str | list[int] | tuple[int, ...] | None, available: list[int]) -> list[int] | None:
    """'0,2-5' -> [0, 2, 3, 4, 5] (options.parse_layer_ranges), checked against the layers the model has."""
    if spec is None:
        return None
    if isinstance(spec, str):
        out: list[int] = []
        top = max(available, default=-1)
        for lo, hi in parse_layer_ranges(spec, "--layers"):
            if hi > top and hi > lo:  # checked before expanding: 0-1000000000 must not allocate
                raise FastCarError(f"--layers: range {lo}-{hi} goes beyond the model's decoder layers "
                                   f"(0-{top}); use indices and ranges within them")
            out.extend(range(lo, hi + 1))
    else:
        out = [int(x) for x in spec]
    missing = sorted(set(out) - set(available))
    if missing:
        raise FastCarError(f"--layers: the model has no decoder layer {missing}; it has layers "
                           f"{available[0]}-{available[-1]}" if available else "--layers: the model has no layers")
    return sorted(set(out))


def select_layers(matches: list[disc.LayerMatch], opts: CompileOptions) -> list[disc.LayerMatch]:
    """The matched layers to rewrite (`--layers`; every matched one by default). Refuses --layers naming a layer
    that did not match and per-layer thresholds that do not fit the layers."""
    chosen = parse_layers(opts.layers, [m.layer for m in matches])
    selected = [m for m in matches if m.ok and (chosen is None or m.layer in chosen)]
    unmatched = [m.layer for m in matches if not m.ok and (chosen is None or m.layer in chosen)]
    if chosen is not None and unmatched:
        raise FastCarError(f"--layers asks for layers {unmatched} that did not match:\n"
                           + CompileReport.from_matches(matches).format())
    if opts.per_layer_threshold and len(opts.threshold) not in (1, len(selected)):
        raise FastCarError(f"--threshold gives {len(opts.threshold)} values for {len(selected)} rewritten layers")
    return selected


class SelectLayersPass(ir.passes.InPlacePass):
    """Analysis: the matched layers to rewrite (`--layers`), checked against the thresholds given."""

    def __init__(self, ctx: CompileContext):
        super().__init__()
        self.ctx = ctx

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        ctx, opts = self.ctx, self.ctx.options
        ctx.selected = select_layers(ctx.matches, opts)
        unmatched = [m.layer for m in ctx.matches if not m.ok] if opts.layers is None else []  # (else refused)
        if unmatched:
            ctx.notes.append(f"layers {unmatched} left dense (not matched)")
        refused = {m.layer: m.attention.rope_refusal for m in ctx.selected
                   if opts.tas_query == contract.TAS_ROPE and m.attention.rope_refusal is not None}
        if refused:
            first = next(iter(refused))
            others = [m.layer for m in ctx.selected if m.layer not in refused]
            leave = f", or rewrite only the other layers with --layers {','.join(map(str, others))}" if others else ""
            raise FastCarError(f"--tas-query rope: the rotary of layer{'s' if len(refused) > 1 else ''} "
                               f"{sorted(refused)} cannot be reproduced by the gate (layer {first}: {refused[first]}); "
                               f"compile with --tas-query raw{leave}")
        if ctx.selected and ctx.selected[0].mlp is not None:
            check_state_size(opts.frame_tokens, ctx.selected[0].mlp.hidden, len(ctx.selected))
        return ir.passes.PassResult(model, modified=False)


class PlanPass(ir.passes.InPlacePass):
    """Analysis: the per-layer plan (attention op and form, KV mode, gate form, packing, rows) the emission builds."""

    def __init__(self, ctx: CompileContext):
        super().__init__()
        self.ctx = ctx

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        ctx = self.ctx
        ctx.fusions, ctx.kv_configs, ctx.forms, ctx.plan = plan(model, ctx.matches, [m.layer for m in ctx.selected],
                                                                ctx.options, ctx.notes)
        ctx.exported_gqa = [n for n in model.graph if native_gqa.is_ms_gqa(n)]  # before any op is emitted
        return ir.passes.PassResult(model, modified=False)


class Planned(NamedTuple):
    fusions: dict[int, dict]  # layer -> what its fused attention reads (fused_attention.fusable)
    kv_configs: dict[int, object]  # layer -> its compressed cache's fastar.KVCompressConfig
    forms: attention_form.Forms  # how each fused attention is built
    plan: Plan


def plan(model: ir.Model, matches: list[disc.LayerMatch], rewritten: list[int], opts: CompileOptions,
         notes: list[str]) -> Planned:
    """The plan for `opts` from discovery's matches (`rewritten`: the selected layers), on the export: what PlanPass
    hands the emission and what `--inspect` prints for the same options."""
    fusions = fused_attention.fusable(model, matches, opts, notes)
    kv_configs = fused_attention.kv_configs(opts, fusions)
    kv = {n: fused_attention.describe(c) for n, c in kv_configs.items()}
    forms = attention_form.decide(model, fusions, opts, set(kv), set(rewritten), notes)
    return Planned(fusions, kv_configs, forms, plan_blocks(matches, rewritten, opts, fusions, kv, forms))
