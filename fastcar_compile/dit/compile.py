"""`fastcar-compile dit.onnx -o fast.onnx` on a DiT step graph: discovery of its blocks (dit/discover.py) and
the dense rewrite that reads the KV cache in place.

The export's self-attention is `softmax(q [past; k]^T) [past; v]` with `[past; k] = Concat(past.N.key, k)`: per
denoising step and layer, ONNX Runtime copies the whole cache twice (the concats) plus the key transpose and
scale, and the runtime concatenates the resident frames into the step's inputs once per chunk. The rewrite
computes the same attention without touching the cache's bytes except to read them:

    scores = Concat(q' past^T + (0 if slot < past_length else -inf), q k^T)   (q' past^T: FusedMatMul, transB)
    out    = Slice(softmax(scores), :C) past_v + Slice(softmax(scores), C:) v

`past.N.key|value` become the runtime's preallocated buffers [B, heads, C, d] (C slots: sink frames, then a
ring of window frames, stream.RingCache) of which the first `past_length` tokens hold K/V; the chunk's own K/V
stay the `present.N.*` outputs, which the runtime writes into the ring after the chunk's cache pass (the
chunk's bytes only). Keys are stored rotated at their absolute positions and attention is a sum over the
keys, so their order in the buffer does not matter. `--threshold TAU` adds FastCar's FFN replay on every
block (dit/replay.py); `--tempcache SIM` adds each slot's log(count) (`past_bias.N`) to the cache's scores and
outputs the pre-RoPE keys (`present_pre.N.key`) for the runtime's merge at write time (stream.RingCache), with
the correspondent `--tempcache-match` names (aligned, or the top-1 match in a bucket: dit/tempcache.py);
`--annca` keeps, per frame, the prompt tokens sharing a bucket with a query of the frame (dit/annca_graph.py);
`--annsa lsh|quant` replaces the cache's part by AnnSA's block-sparse attention over buckets (dit/annsa_graph.py).
FAST-AR's other compressed caches are not compiled for DiT blocks yet: asked for, they are refused in one line.
The modes compiled in are recorded in the metadata (config.MODES_KEY) for the runtime.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from pathlib import Path

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from fastcar_compile.core import contract, options
from fastcar_compile.core.errors import FastCarError
from fastcar_compile.dit import annsa_graph, tempcache
from fastcar_compile.dit import modes as dit_modes
from fastcar_compile.dit.annca_graph import ANNCA_OP, add_annca, prompt_codes
from fastcar_compile.dit.config import (
    ANNSA_GRAPH,
    ANNSA_NATIVE,
    CACHE_FORM_KEY,
    CACHE_IN_PLACE,
    METADATA_KEY,
    MODES_KEY,
    PAST_LENGTH,
    TEXT_GRAPH_KEY,
    tempcache_io,
)
from fastcar_compile.dit.discover import DiTBlockMatch, SelfAttention, discover
from fastcar_compile.dit.replay import REPLAY_OP, add_replay
from fastcar_compile.passes.build import Builder, const
from fastcar_compile.passes.compile_report import CompileReport, LayerReport
from fastcar_compile.passes.plan import DiTBlockPlan, KvPlan, Plan

REPLAY_FEATURE = "FastCar FFN replay on DiT blocks"
KV_FEATURE = "the decoders' compressed KV cache (a fixed budget, eviction, their AnnSA and prompt pruning) on DiT blocks"
IN_PLACE_OP = "FusedMatMul over the cache buffer (transB, past_length mask) + MatMul over the chunk, one softmax"
IN_PLACE_KV = "dense, read in place (the runtime's buffers: sink frames + a ring of window frames)"
# Options that ask for those features (any value but the default), and options that do not apply to a DiT.
_REPLAY_OPTIONS = ("tas_query", "max_replay", "per_layer_threshold", "emit_diagnostics", "required_video_inputs")  # refused
_KV_OPTIONS = ("kv_budget", "kv_sinks", "kv_window", "kv_eviction", "sparse_attention", "prune_prompt",
               "kv_diagnostics", "kv_layers")
_IGNORED = ("frame_tokens", "threshold", "tempcache", "validate", "native_attention", *options.DIT_ONLY)  # checked on their own below


def is_dit_step(model: ir.Model) -> bool:
    """A step graph written by `export --dit` (or compiled from one): its config in the metadata."""
    return METADATA_KEY in model.metadata_props and TEXT_GRAPH_KEY in model.metadata_props


def is_dit_graph(model: ir.Model) -> bool:
    """Either graph `export --dit` writes (the step graph, or its prompt graph: the config only)."""
    return METADATA_KEY in model.metadata_props


def check_options(opts: dict, frame_tokens: int) -> tuple[list[str], dict]:
    """Refuse (one line, naming the feature) what a DiT step graph cannot be compiled with yet; returns notes
    and the modes to build (config.MODES_KEY: the FastCar tau, TempCache's SIM; None = off). The decoders'
    default tau compiles dense: a DiT takes an explicit one."""
    by_name = {o.name: o for o in options.OPTIONS}
    for name, value in opts.items():
        o = by_name.get(name)
        if o is None or name in _IGNORED or value == o.default or (value is None and o.default is None):
            continue
        if isinstance(value, (list, tuple)) and tuple(value) == tuple(o.default or ()):
            continue
        flag = o.flag or name
        if name in _REPLAY_OPTIONS:
            raise FastCarError(f"{flag}: {flag} is not supported with {REPLAY_FEATURE} yet; leave {flag} out (one "
                               "--threshold for every block, TAS from the query as attention uses it)")
        if name in _KV_OPTIONS:
            raise FastCarError(f"{flag}: {KV_FEATURE} is not supported yet; leave {flag} out (a DiT's own modes: "
                               "--annsa, --annca, --tempcache, --threshold)")
        raise FastCarError(f"{flag} does not apply to a DiT step graph (it compiles dense, with the cache read in "
                           f"place); leave {flag} out")
    notes = []
    given = opts.get("frame_tokens")
    if given is not None and given != frame_tokens:
        raise FastCarError(f"--frame-tokens {given}: this DiT has {frame_tokens} tokens per latent frame (its "
                           "config); leave --frame-tokens out")
    sim = opts.get("tempcache")
    match = _given(opts, "tempcache_match")
    if sim is None and match != "aligned":
        raise FastCarError(f"--tempcache-match {match} needs --tempcache SIM (the cosine above which keys merge)")
    modes = {"threshold": None, "tempcache": None if sim is None else float(sim),
             **tempcache.record(match if sim is not None else None, opts), "annca": annca_mode(opts),
             "annsa": annsa_mode(opts)}
    if modes["annsa"] is not None and sim is not None:
        raise FastCarError(f"--annsa with --tempcache: {annsa_graph.FEATURE} over merged slots is not compiled yet; "
                           "give one of them")
    annsa_only = ("annsa_local", "native_attention")  # on a DiT, native_attention picks --annsa's form only
    for name in (*annsa_only, *dit_modes.BUCKET_SETTINGS):  # a setting no mode reads would change nothing
        used = modes["annsa"] is not None or (name not in annsa_only and (
            modes["annca"] is not None or modes["tempcache_buckets"] is not None))
        if not used and name in opts and opts[name] != by_name[name].default:
            flag = by_name[name].flag
            modes_of = "--annsa" if name in annsa_only else "--annsa / --annca / --tempcache-match lsh|quant"
            raise FastCarError(f"{flag} is a setting of {modes_of}: give one of them with it, or leave {flag} out")
    taus = [float(t) for t in np.atleast_1d(opts.get("threshold", (np.inf,)))]
    default = tuple(by_name["threshold"].default)
    if tuple(taus) == default:
        done = "compiled dense" if all(modes[k] is None for k in ("tempcache", "annca", "annsa")) else "no FFN replay"
        notes.append(f"the decoders' default tau ({default[0]:g}) does not apply to DiT blocks: {done}; "
                     f"give --threshold TAU for {REPLAY_FEATURE}")
        return notes, modes
    if len(taus) != 1:
        raise FastCarError(f"--threshold gives {len(taus)} values: {REPLAY_FEATURE} takes one tau for every block")
    modes["threshold"] = None if taus[0] == np.inf else taus[0]
    return notes, modes


def _given(opts: dict, name: str):
    """Option `name`'s checked value in `opts`, its declared default (core/options.py) where not given."""
    o = options.BY_NAME[name]
    return o.check(opts.get(name, o.default))


def annca_mode(opts: dict) -> dict | None:
    """What the metadata records of `--annca` (None: off): its buckets, as the eager runtime draws them
    (dit/fastar.FastARDiT: --annsa's bucketing, lsh without it)."""
    return dit_modes.bucket_record(opts.get("annsa") or "lsh", opts) if opts.get("annca") else None


def annsa_mode(opts: dict) -> dict | None:
    """What the metadata records of `--annsa lsh|quant` (None: off): its buckets and the local frames."""
    kind = options.BY_NAME["annsa"].check(opts.get("annsa"))
    if kind is None:
        return None
    return dit_modes.bucket_record(kind, opts) | {"annsa_local": _given(opts, "annsa_local"),
                                                  "annsa_kernel": annsa_kernel(opts)}


def annsa_kernel(opts: dict) -> str:
    """AnnSA's compiled form (config.ANNSA_KERNELS): the native op where `--native-attention` is on (default) and
    the native library builds here, else the ONNX-op graph."""
    if not _given(opts, "native_attention"):
        return ANNSA_GRAPH
    from fastcar_compile.runtime.native import library_path

    return ANNSA_NATIVE if library_path() is not None else ANNSA_GRAPH


def plan(matches: list[DiTBlockMatch], rewrite: bool, tau: float | None = None, sim: float | None = None,
         annca: dict | None = None, match: str = "aligned", annsa: dict | None = None) -> Plan:
    """The DiT blocks' plan (passes/plan.py): what discovery found and what the compile builds from it."""
    blocks = []
    for m in matches:
        if not m.ok:
            blocks.append(DiTBlockPlan(m.layer, False, False))
            continue
        a = m.attention
        blocks.append(DiTBlockPlan(
            m.layer, True, rewrite,
            self_attention=f"Concat(past.{m.layer}.*, chunk) -> MatMul -> Softmax -> MatMul, heads {a.heads}x{a.head_dim}",
            attention_op=IN_PLACE_OP if annsa is None else f"{annsa_graph.op_line(annsa)}; {annsa['kind']} buckets x "
            f"{annsa['ann_tables']} tables, {annsa['annsa_local']} local frames", rotary=m.rope, qk_norm=m.qk_norm, cross_attention=m.cross if annca is None else
            f"{m.cross}; AnnCA ({annca['kind']} buckets x {annca['ann_tables']} tables): {ANNCA_OP}", ffn=m.ffn,
            modulation=m.modulation,
            kv=KvPlan(IN_PLACE_KV if sim is None else f"{IN_PLACE_KV}; TempCache {match} at SIM {sim:g} (the runtime "
                      "merges on write, the graph adds log(count) per slot: past_bias.N)"),
            replay="none (--threshold TAU replays FFN rows)" if tau is None else f"tau {tau:g}: {REPLAY_OP}"))
    return Plan(tuple(blocks))


def inspect_dit(model: ir.Model) -> CompileReport:
    """What discovery found per DiT block (the report `--inspect` prints)."""
    matches = discover(model)
    report = CompileReport([_layer_report(m) for m in matches], unit="DiT blocks")
    report.plan = plan(matches, rewrite=True).lines()
    if is_dit_step(model) and CACHE_FORM_KEY in model.metadata_props:
        report.notes.append(f"already compiled (cache {model.metadata_props[CACHE_FORM_KEY]}): compile the export")
    return report


def _layer_report(m: DiTBlockMatch) -> LayerReport:
    return LayerReport(m.layer, m.ok, False, m.summary(), m.trace)


def _rewrite_block(graph: ir.Graph, m: DiTBlockMatch, bias: ir.Value, capacity: ir.Value, ids,
                   slot_bias: ir.Value | None = None, annsa: dict | None = None) -> list[ir.Node]:
    """The block's attention over (buffer, chunk) as in the module docstring, plus `slot_bias` [B, heads, C]
    (TempCache's log(count) per slot) on the cache's scores when given; with `annsa` the cache's part is
    AnnSA's (dit/annsa_graph.py) instead of the whole buffer; returns the new nodes."""
    a: SelfAttention = m.attention
    nodes: list[ir.Node] = []
    b = Builder(m.layer, nodes, ids, graph=graph)
    pkey, key = a.key_concat.inputs
    pvalue, value = a.value_concat.inputs
    # the chunk's own scores: the export's key path, fed the chunk's keys instead of the concat
    ir.convenience.replace_all_uses_with(a.key_concat.outputs[0], key)
    q = a.query
    for f in a.key_factors:  # the scale the export applied to the keys, applied to the query instead
        q = b("Mul", [q, f], part="attention")
    if annsa is not None and annsa["annsa_kernel"] == ANNSA_NATIVE:  # one node: the whole context
        ab = Builder(m.layer, nodes, ids, graph=graph, namespace="annsa")
        ctx = annsa_graph.native_context(ab, graph, m.layer, a, q, key, value, pkey, pvalue, annsa, a.head_dim)
        ir.convenience.replace_all_uses_with(a.context.outputs[0], ctx)
        graph.insert_before(a.softmax, nodes)
        return nodes
    if annsa is not None:
        ab = Builder(m.layer, nodes, ids, graph=graph, namespace="annsa")  # AnnSA's nodes (and its bucket codes)
        masked, annsa_context = annsa_graph.cache_scores(ab, graph, m.layer, a, q, pkey, pvalue, annsa, a.head_dim)

        def past_context(_, probs):
            return annsa_context(ab, probs)
        width = b("Shape", [masked], {"start": 3, "end": 4}, part="attention")
    else:
        past_scores = b("FusedMatMul", [q, pkey], {"transB": 1, "alpha": 1.0}, domain=contract.MS_DOMAIN,
                        part="attention")
        masked = b("Add", [past_scores, bias], part="attention")  # (ORT's broadcasting Where is 5x slower)
        if slot_bias is not None:
            axis2 = const(graph, "fastcar.dit.axis2", np.array([2], np.int64))
            masked = b("Add", [masked, b("Unsqueeze", [slot_bias, axis2], part="cache")], part="attention")
        width = capacity

        def past_context(b2, probs):
            return b2("MatMul", [probs, pvalue], part="attention")
    self_scores = a.softmax.inputs[0]
    joined = b("Concat", [masked, self_scores], {"axis": -1}, part="attention")
    a.softmax.replace_input_with(0, joined)
    before = len(nodes)
    probs = a.softmax.outputs[0]
    zero = const(graph, "fastcar.dit.zero", np.array([0], np.int64))
    end = const(graph, "fastcar.dit.end", np.array([np.iinfo(np.int64).max], np.int64))
    last = const(graph, "fastcar.dit.last_axis", np.array([-1], np.int64))
    p_past = b("Slice", [probs, zero, width, last], part="attention")
    p_self = b("Slice", [probs, width, end, last], part="attention")
    ctx = b("Add", [past_context(b, p_past), b("MatMul", [p_self, value], part="attention")], part="attention")
    old = a.context.outputs[0]
    ir.convenience.replace_all_uses_with(old, ctx)
    graph.insert_before(a.softmax, nodes[:before])  # the scores, before the softmax reads them
    graph.insert_after(a.softmax, nodes[before:])  # the two slices, the products and their sum
    return nodes


def rewrite(model: ir.Model, matches: list[DiTBlockMatch], tempcache: bool = False, annsa: dict | None = None
            ) -> None:
    """Every block's attention reads `past.N.*` in place (module docstring); adds the `past_length` input. With
    `tempcache`, each block also takes its slots' log(count) (`past_bias.N`) on the cache's scores and outputs
    the chunk's pre-RoPE keys (`present_pre.N.key`) for the runtime's merge."""
    graph = model.graph
    if any(v.name == PAST_LENGTH for v in graph.inputs):
        raise FastCarError(f"the step graph already has a {PAST_LENGTH} input: it is compiled; compile the export")
    length = ir.Value(name=PAST_LENGTH, type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([1]))
    graph.inputs.append(length)
    model.opset_imports.setdefault(contract.MS_DOMAIN, 1)  # FusedMatMul
    ids = itertools.count()
    shared: list[ir.Node] = []
    b = Builder(-1, shared, ids, graph=graph)
    first = matches[0].attention.key_concat.inputs[0]
    two = const(graph, "fastcar.dit.two", np.array([2], np.int64))
    three = const(graph, "fastcar.dit.three", np.array([3], np.int64))
    capacity = b("Slice", [b("Shape", [first], part="cache"), two, three], part="cache")  # [1]: C
    slots = b("Range", [const(graph, "fastcar.dit.zero_s", np.array(0, np.int64)),
                        b("Squeeze", [capacity], part="cache"),
                        const(graph, "fastcar.dit.one_s", np.array(1, np.int64))], part="cache")
    mask = b("Less", [slots, length], part="cache")  # [C]: slots holding K/V
    bias = b("Where", [mask, const(graph, "fastcar.dit.zero_f", np.array(0.0, np.float32)),
                       const(graph, "fastcar.dit.minus_inf", np.array(-np.inf, np.float32))], part="cache")
    graph.insert_before(graph[0], shared)
    if annsa is not None:
        annsa_graph.add_dense_input(graph)
    for m in matches:
        slot_bias = _tempcache_io(graph, m, ids) if tempcache else None
        _rewrite_block(graph, m, bias, capacity, ids, slot_bias, annsa)
    if annsa is not None and annsa["annsa_kernel"] == ANNSA_NATIVE:
        from fastcar_compile.passes import fastcar_ops

        fastcar_ops.add_functions(model, model.opset_imports.get("", 17))  # the op's body: runs without the library
    RemoveUnusedNodesPass()(model)
    for m in matches:
        i = m.layer
        for kind in ("key", "value"):
            v = next(x for x in graph.inputs if x.name == f"past.{i}.{kind}")
            dims = list(v.shape) if v.shape is not None else [None] * 4
            v.shape = ir.Shape([dims[0], dims[1], "capacity", dims[3]])


def _tempcache_io(graph: ir.Graph, m: DiTBlockMatch, ids) -> ir.Value:
    """Block m's `past_bias.N` input [B, heads, capacity] and `present_pre.N.key` output [B, heads, S, d] (the
    pre-RoPE key as [B, S, heads * d] reshaped and transposed, after its producer)."""
    a = m.attention
    name_in, name_out = tempcache_io(m.layer)
    slot_bias = ir.Value(name=name_in, type=ir.TensorType(ir.DataType.FLOAT),
                         shape=ir.Shape(["batch", a.heads, "capacity"]))
    graph.inputs.append(slot_bias)
    nodes: list[ir.Node] = []
    b = Builder(m.layer, nodes, ids, graph=graph)
    split = const(graph, "fastcar.dit.heads_shape", np.array([0, 0, a.heads, a.head_dim], np.int64))
    pre = b("Transpose", [b("Reshape", [m.key_pre, split], part="cache")], {"perm": [0, 2, 1, 3]}, part="cache",
            names=[name_out])
    pre.type, pre.shape = ir.TensorType(ir.DataType.FLOAT), ir.Shape(["batch", a.heads, None, a.head_dim])
    graph.insert_after(m.key_pre.producer(), nodes)
    graph.outputs.append(pre)
    return slot_bias


def compile_dit(model, output: str | os.PathLike | None = None, *, source: Path | None = None,
                validate: bool = True, **opts) -> tuple[ir.Model, CompileReport]:
    """Compile a DiT step graph (a path, or an onnx_ir.Model loaded from `source`, which this modifies) to the
    in-place cache form; with `output`, written atomically beside a copy of its prompt graph. `opts`: the
    compiler's options, of which a DiT takes `threshold` (one tau: FastCar replay) only (check_options)."""
    from fastcar_compile import api
    from fastcar_compile.core import fileio
    from fastcar_compile.dit.config import from_dict
    from fastcar_compile.dit.export import text_graph_path
    from fastcar_compile.passes.save import SavePass, Staging
    from fastcar_compile.passes.validate import ValidatePass

    options.unknown(opts, "compile")
    opts = {**opts, **options.check_all({k: v for k, v in opts.items() if v is not None})}  # by declaration
    out_path = fileio.check_output_path(output) if output is not None else None
    loaded, in_path = (model, source) if isinstance(model, ir.Model) and source is not None else api.load(model)
    if not is_dit_step(loaded):
        if is_dit_graph(loaded):
            raise FastCarError("this is a DiT prompt graph (text embeddings -> cross-attention K/V), run as it is; "
                               "compile the step graph written beside it")
        raise FastCarError("not a DiT step graph (no fastcar.dit_config metadata); export it with "
                           "`fastcar-compile export --dit`")
    if CACHE_FORM_KEY in loaded.metadata_props:
        raise FastCarError("the DiT step graph is already compiled (its cache is read in place); compile the "
                           "export")
    cfg = from_dict(json.loads(loaded.metadata_props[METADATA_KEY]), "the step graph's fastcar.dit_config")
    notes, modes = check_options(opts, cfg.tokens_per_frame)
    tau = modes["threshold"]
    t0 = time.perf_counter()
    matches = discover(loaded)
    report = CompileReport([_layer_report(m) for m in matches], notes=notes, unit="DiT blocks")
    failed = [m for m in matches if not m.ok]
    if not matches or failed:
        head = (f"DiT block {failed[0].layer} did not match ({failed[0].summary()})" if failed
                else "no DiT block found (no past.N.key inputs)")
        raise FastCarError(f"{head}; every block must match, since the cache inputs change for all of them "
                           "(run with --inspect to see each block)")
    report.plan = plan(matches, rewrite=True, tau=tau, sim=modes["tempcache"], annca=modes["annca"],
                       match=modes["tempcache_match"], annsa=modes["annsa"]).lines()
    rewrite(loaded, matches, tempcache=modes["tempcache"] is not None, annsa=modes["annsa"])
    if tau is not None:
        add_replay(loaded, matches, cfg, tau)
    if modes["annca"] is not None:
        add_annca(loaded, matches, cfg, dit_modes.bucket_hasher(modes["annca"], cfg.head_dim))
    loaded.metadata_props[MODES_KEY] = json.dumps(modes)
    for r in report.layers:
        r.rewritten = True
    text_src = None
    if in_path is not None:
        text_src = in_path.with_name(loaded.metadata_props[TEXT_GRAPH_KEY])
        if not text_src.is_file():
            raise FastCarError(f"{in_path}: its prompt graph {text_src} is missing; keep the export's two graphs "
                               "together")
    loaded.metadata_props[CACHE_FORM_KEY] = CACHE_IN_PLACE
    if out_path is None:
        return loaded, report
    text_out = text_graph_path(out_path)
    loaded.metadata_props[TEXT_GRAPH_KEY] = text_out.name
    staging = Staging(out_path, source=in_path)
    reads = dict(fileio.model_reads(in_path)) if in_path is not None else {}
    if text_src is not None:
        reads.update(fileio.model_reads(text_src, "the prompt graph"))
    fileio.check_outputs({**{f: "output" for f in staging.files()}, text_out: "the prompt graph's copy",
                          text_out.with_name(text_out.name + ".data"): "the prompt graph's data"}, reads)
    passes: list[ir.passes.PassBase] = [ValidatePass(staging)] if validate else []
    extra = (prompt_codes(cfg, dit_modes.bucket_hasher(modes["annca"], cfg.head_dim)) if modes["annca"] is not None
             else None)  # AnnCA hashes the prompt keys once per prompt, in the prompt graph
    passes += [_StagePromptGraph(staging, text_src, text_out.name, extra), SavePass(staging)]
    from fastcar_compile import pipeline

    try:
        with fileio.os_errors(str(out_path)):
            pipeline.run(ir.passes.PassManager(passes), loaded)
    finally:
        staging.cleanup()
    report.notes.append(f"cache read in place: past.N.* are the runtime's buffers, past_length the tokens they "
                        f"hold; prompt graph copied to {text_out.name} ({time.perf_counter() - t0:.1f} s)")
    return loaded, report


def calibrate_threshold(path: str | os.PathLike, ratio: float, *, text: np.ndarray | None = None, frames: int = 3,
                        tempcache: float | None = None, tempcache_match: str = "aligned", **buckets) -> float:
    """The tau giving FFN replay ratio `ratio` over the eligible rows (the decoders' one-pass calibration): a
    probe compiled with FastCar on and a tau no TAS exceeds streams `frames` frames (at least two chunks; the
    prompt `text` [L, text_dim] or a seeded random one) and the quantile of the TAS it outputs is the tau.
    TempCache (its SIM, match and `buckets`: dit/modes.BUCKET_SETTINGS), AnnSA and AnnCA (`buckets` also takes
    annsa, annsa_local, annca) change the rollout: the probe has them."""
    import tempfile

    from fastcar_compile.dit.stream import OrtDiT, StreamSettings, rollout
    from fastcar_compile.runtime.calib_stats import tau_for_share

    with tempfile.TemporaryDirectory() as tmp:
        probe = Path(tmp) / "probe.onnx"
        compile_dit(path, probe, threshold=(3e38,), tempcache=tempcache, tempcache_match=tempcache_match,
                    validate=False, **buckets)
        runtime = OrtDiT(probe)
        runtime.tas_log = []
        for _ in rollout(runtime, StreamSettings(frames=max(frames, 2 * runtime.cfg.chunk_frames)), text):
            pass
    return tau_for_share(np.concatenate(runtime.tas_log), ratio)


class _StagePromptGraph(ir.passes.InPlacePass):
    """Stage the prompt graph (and its external data, holes kept) beside the model under the output's name;
    `extra` (a graph reading the prompt graph's outputs: AnnCA's key codes) appended to it."""

    def __init__(self, staging, source: Path | None, name: str, extra: ir.Model | None = None):
        super().__init__()
        self.staging, self.source, self.name, self.extra = staging, source, name, extra

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        import onnx

        from fastcar_compile.core.fileio import copy_file

        if self.source is None:
            raise FastCarError("an in-memory DiT step graph has no prompt graph to write beside it; compile the "
                               "exported file")
        self.staging.write(model)
        proto = onnx.load(str(self.source), load_external_data=False)
        data_name = self.name + ".data"
        old = set()
        for t in proto.graph.initializer:
            if t.data_location == onnx.TensorProto.EXTERNAL:
                for e in t.external_data:
                    if e.key == "location":
                        old.add(e.value)
                        e.value = data_name
        if len(old) > 1:
            raise FastCarError(f"{self.source}: its weights are in {len(old)} files; keep them in one")
        if old:
            copy_file(self.source.with_name(old.pop()), self.staging.add(data_name))
        if self.extra is not None:
            more = ir.to_proto(self.extra).graph
            proto.graph.node.extend(more.node)
            proto.graph.initializer.extend(more.initializer)
            proto.graph.output.extend(more.output)
        onnx.save(proto, str(self.staging.add(self.name)))
        return ir.passes.PassResult(model, modified=False)
