"""Partitioner: model -> per-layer task graphs (networkx), each task on a unit and tiled to the board.

Units: ``matrix`` (the MAC array of a core: projections, attention QK/PV, LM head), ``vector`` (norms,
residual adds, RoPE, TAS), ``sfu`` (softmax, SiLU), ``dma`` (KV append, replay cache exchange, embedding).
Weight GEMMs are tiled so one tile fills half of a core's weight buffer (the other half is the double
buffer), rounded to whole array passes; attention is one macro-task per row whose extent is the run-time
context (K/V streamed through the KV buffer with an online softmax, so scores never fill the act buffer).
A row's live activations (residual stream, a GEMM's input and output, the gate while up runs:
``live_activations``) stay in the act buffer; when a core's rows do not fit, the scheduler flags that GEMM's
tiles SPILL (each tile then re-reads its input slice and writes its output slice through DRAM).

Input: a :class:`ModelSpec`, or an ONNX decoder (compiled fast.onnx or plain export) read without its weights.
ONNX ops the accelerator cannot run are reported by name in ``Partition.unsupported``, never dropped.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path
from typing import Any

import networkx as nx
import numpy as np
import onnx

from fastcar_compile.core import contract
from fastcar_compile.core.errors import FastCarError
from fastcar_compile.passes.graph_utils import LAYOUT_OPS

from . import isa
from .hwspec import BoardConfig
from .kvbound import KVBound
from .modelspec import (
    ModelSpec,
    column_source,
    iter_nodes,
    kv_bounds,
    load_onnx_shapes_only,
    matmul_weights,
    qk_norm_weights,
    spec_from_model,
)

B = isa.BUF

# ONNX ops that map onto the accelerator's units (compute) or vanish into DMA address generation (layout).
COMPUTE_OPS = frozenset({
    "MatMul", "Gemm", "Softmax", "Add", "Sub", "Mul", "Div", "Sqrt", "Reciprocal", "Pow", "ReduceMean", "Neg",
    "Sigmoid", "Silu", "Exp", "Max", "Min", "Gather", "Cos", "Sin", "RMSNormalization", "SimplifiedLayerNormalization",
    "SkipSimplifiedLayerNormalization", "Attention", "MultiHeadAttention", "GroupQueryAttention",
    "RotaryEmbedding", "ReduceSum", "Erf", "Tanh",
    # ai.fastcar ops (docs/DESIGN.md): TAS + gate on the vector unit, cache ops on the DMA engine, the fused
    # attention core (CompressedAttention, --fused-attention fastcar, the default); the gate's old per-form names
    # too (models compiled before the one TemporalGate op)
    *contract.OP_NAMES, *contract.LEGACY_GATE_OPS,
})
# Ops the accelerator runs without compute cost: the layout ops discovery walks through (one definition,
# passes/graph_utils.py) plus shape, index and control ops.
NO_COST_OPS = LAYOUT_OPS | frozenset({
    "Concat", "Slice", "Shape", "CastLike", "Constant", "ConstantOfShape", "Range", "Split", "Where", "Equal",
    "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "And", "Or", "Not", "If", "ScatterND", "ScatterElements",
    "NonZero", "Compress", "GatherND", "GatherElements", "Trilu", "Size", "Mod", "Floor", "ReduceMax",
    "ReduceMin", "ArgMax", "IsNaN", "Abs", "Sign",
})


@dataclasses.dataclass
class Task:
    """One node of a layer's task graph; fields mirror the instruction it becomes."""

    name: str
    unit: str
    op: isa.Op
    sub: int = 0
    dst: int = 0
    src: int = 0
    src2: int = 0  # second source buffer (ADD, SILU_MUL), encoded in the tensor field
    weight: int | None = None  # tensor id (GEMM WEIGHT, RMSNORM)
    m: int = 0
    k: int = 0
    n: int = 1
    flags: int = 0
    off_m: int = 0
    off_k: int = 0
    tiles: list[tuple[int, int, int, int]] = dataclasses.field(default_factory=list)  # (off_m, m, off_k, k)

    @property
    def replayable(self) -> bool:
        return bool(self.flags & isa.Flag.SKIP_ON_REPLAY)


@dataclasses.dataclass
class Partition:
    spec: ModelSpec
    board: BoardConfig
    graphs: list[nx.DiGraph]  # one per decoder layer, then the head ("layer" NO_LAYER)
    tensors: list[dict[str, Any]]  # id -> {name, layer, shape, source}
    unsupported: list[str]
    notes: list[str]
    op_counts: dict[str, int] = dataclasses.field(default_factory=dict)
    kv: dict[int, KVBound] = dataclasses.field(default_factory=dict)  # bounded KV layers of the compiled model
    video_start_known: bool = False  # the video start was given (--video-start) or compiled into the model

    def tasks(self, g: nx.DiGraph) -> list[Task]:
        return [g.nodes[n]["task"] for n in g.graph["order"]]


def _round_down(x: int, step: int) -> int:
    return max(step, (x // step) * step)


def tile_gemm(m_total: int, k_total: int, board: BoardConfig) -> list[tuple[int, int, int, int]]:
    """Split a [k_total, m_total] weight into tiles that fit half a weight buffer, in whole array passes."""
    tile_elems = board.weight_tile_bytes // board.dtype_bytes
    k = min(k_total, _round_down(tile_elems // board.array_cols, board.array_rows))
    m = min(m_total, _round_down(tile_elems // k, board.array_cols))
    tiles = []
    for om in range(0, m_total, m):
        for ok in range(0, k_total, k):
            tiles.append((om, min(m, m_total - om), ok, min(k, k_total - ok)))
    return tiles


def _layer_tasks(spec: ModelSpec, layer: int, wid: dict[str, int], board: BoardConfig) -> list[Task]:
    h, i, qd, kvd = spec.hidden, spec.intermediate, spec.q_dim, spec.kv_dim
    group = spec.heads // spec.kv_heads
    W, KVK, KVV = isa.Space.WEIGHT, isa.Space.KV_K, isa.Space.KV_V
    replay = layer in spec.replayable
    skip = int(isa.Flag.SKIP_ON_REPLAY) if replay else 0
    ctx = int(isa.Flag.CTX)

    def gemm(name: str, dst: int, src: int, m: int, k: int, flags: int = 0) -> Task:
        return Task(name, "matrix", isa.Op.GEMM, W, dst, src, weight=wid[name], m=m, k=k, flags=flags,
                    tiles=tile_gemm(m, k, board))

    tas = Task("tas", "vector", isa.Op.TAS, 0, 0, B["q"], m=spec.head_dim, k=spec.frame_tokens, n=spec.heads,
               off_m=isa.tau_bits(spec.threshold), off_k=spec.video_start)
    tasks = [
        Task("attn_norm", "vector", isa.Op.VEC, isa.Vec.RMSNORM, B["xn"], B["x"], weight=wid["attn_norm"], m=h),
        gemm("q_proj", B["q"], B["xn"], qd, h),
        gemm("k_proj", B["k"], B["xn"], kvd, h),
        gemm("v_proj", B["v"], B["xn"], kvd, h),
        # per-head RMSNorm of q and k (Qwen3): n groups of head_dim, one [head_dim] scale
        *([Task("q_norm", "vector", isa.Op.VEC, isa.Vec.RMSNORM, B["q"], B["q"], weight=wid["q_norm"], m=qd,
                n=spec.heads),
           Task("k_norm", "vector", isa.Op.VEC, isa.Vec.RMSNORM, B["k"], B["k"], weight=wid["k_norm"], m=kvd,
                n=spec.kv_heads)] if spec.qk_norm else []),
        # tas_query "raw": TAS reads q before RoPE (K[p - L] is already in the cache from an earlier step)
        *([tas] if replay and spec.tas_query == "raw" else []),
        Task("rope_q", "vector", isa.Op.VEC, isa.Vec.ROPE, B["q"], B["q"], m=qd, n=spec.heads),
        Task("rope_k", "vector", isa.Op.VEC, isa.Vec.ROPE, B["k"], B["k"], m=kvd, n=spec.kv_heads),
        Task("kv_store_k", "dma", isa.Op.STORE, KVK, 0, B["k"], m=kvd),
        Task("kv_store_v", "dma", isa.Op.STORE, KVV, 0, B["v"], m=kvd),
        Task("attn_qk", "matrix", isa.Op.GEMM, KVK, B["scores"], B["q"], m=0, k=kvd, n=group, flags=ctx),
        *([tas] if replay and spec.tas_query == contract.TAS_ROPE else []),
    ]
    tasks += [
        Task("softmax", "sfu", isa.Op.VEC, isa.Vec.SOFTMAX, B["scores"], B["scores"], m=0, n=spec.heads, flags=ctx),
        Task("attn_pv", "matrix", isa.Op.GEMM, KVV, B["attn"], B["scores"], m=0, k=kvd, n=group, flags=ctx),
        gemm("o_proj", B["o"], B["attn"], h, qd),
        Task("attn_residual", "vector", isa.Op.VEC, isa.Vec.ADD, B["x"], B["x"], src2=B["o"], m=h),
        Task("mlp_norm", "vector", isa.Op.VEC, isa.Vec.RMSNORM, B["xn"], B["x"], weight=wid["mlp_norm"], m=h,
             flags=skip),
        gemm("gate_proj", B["gate"], B["xn"], i, h, skip),
        gemm("up_proj", B["up"], B["xn"], i, h, skip),
        Task("act", "sfu", isa.Op.VEC, isa.Vec.SILU_MUL, B["h"], B["gate"], src2=B["up"], m=i, flags=skip),
        gemm("down_proj", B["mlp"], B["h"], h, i, skip),
    ]
    if replay:
        tasks.append(Task("replay_xchg", "dma", isa.Op.XCHG, isa.Space.REPLAY, B["mlp"], B["mlp"], m=h,
                          k=spec.frame_tokens, off_k=spec.video_start))
    tasks.append(Task("mlp_residual", "vector", isa.Op.VEC, isa.Vec.ADD, B["x"], B["x"], src2=B["mlp"], m=h))
    return tasks


def _graph(tasks: list[Task], layer: int) -> nx.DiGraph:
    """Dependency graph from buffer reads/writes (and KV stores before KV reads)."""
    g = nx.DiGraph(layer=layer, order=[t.name for t in tasks])
    last_writer: dict[Any, str] = {}
    for t in tasks:
        g.add_node(t.name, task=t, unit=t.unit, replayable=t.replayable)
        reads: list[Any] = [t.src]
        if t.op == isa.Op.VEC and t.sub in (isa.Vec.ADD, isa.Vec.SILU_MUL):
            reads.append(t.src2)
        if t.op == isa.Op.GEMM and t.sub in (isa.Space.KV_K, isa.Space.KV_V):
            reads.append(("kv", t.sub))
        if t.op == isa.Op.TAS:
            reads.append(("kv", isa.Space.KV_K))
        for r in reads:
            if r in last_writer and last_writer[r] != t.name:
                g.add_edge(last_writer[r], t.name)
        if t.op == isa.Op.STORE:
            last_writer[("kv", t.sub)] = t.name
        elif t.op != isa.Op.TAS:
            last_writer[t.dst] = t.name
    return g


def partition_spec(spec: ModelSpec, board: BoardConfig, sources: dict[str, str] | None = None,
                   unsupported: list[str] | None = None, notes: list[str] | None = None) -> Partition:
    if spec.dtype_bytes != board.dtype_bytes:
        raise FastCarError(
            f"model dtype is {spec.dtype_bytes} bytes but board {board.name!r} computes in {board.dtype_bytes}-byte "
            "values; pick a matching board file (dtype_bytes)"
        )
    tensors: list[dict[str, Any]] = []

    def add(name: str, layer: int, shape: list[int]) -> int:
        key = f"L{layer}.{name}" if layer != isa.NO_LAYER else name
        tensors.append({"id": len(tensors), "name": key, "layer": layer, "shape": shape,
                        "source": (sources or {}).get(key)})
        return len(tensors) - 1

    graphs = []
    h, i = spec.hidden, spec.intermediate
    for layer in range(spec.layers):
        wid = {
            "attn_norm": add("attn_norm", layer, [h]),
            "q_proj": add("q_proj", layer, [h, spec.q_dim]),
            "k_proj": add("k_proj", layer, [h, spec.kv_dim]),
            "v_proj": add("v_proj", layer, [h, spec.kv_dim]),
            **({"q_norm": add("q_norm", layer, [spec.head_dim]), "k_norm": add("k_norm", layer, [spec.head_dim])}
               if spec.qk_norm else {}),
            "o_proj": add("o_proj", layer, [spec.q_dim, h]),
            "mlp_norm": add("mlp_norm", layer, [h]),
            "gate_proj": add("gate_proj", layer, [h, i]),
            "up_proj": add("up_proj", layer, [h, i]),
            "down_proj": add("down_proj", layer, [i, h]),
        }
        graphs.append(_graph(_layer_tasks(spec, layer, wid, board), layer))
    if len(tensors) + 2 > np.iinfo(np.uint16).max:
        raise FastCarError(f"{len(tensors)} weight tensors exceed the 16-bit tensor field")
    fn = add("final_norm", isa.NO_LAYER, [h])
    lm = add("lm_head", isa.NO_LAYER, [h, spec.vocab])
    head = [
        Task("final_norm", "vector", isa.Op.VEC, isa.Vec.RMSNORM, B["xn"], B["x"], weight=fn, m=h),
        Task("lm_head", "matrix", isa.Op.GEMM, isa.Space.WEIGHT, B["logits"], B["xn"], weight=lm, m=spec.vocab,
             k=h, tiles=tile_gemm(spec.vocab, h, board)),
        Task("logits_store", "dma", isa.Op.STORE, isa.Space.ACT, 0, B["logits"], m=spec.vocab),
    ]
    graphs.append(_graph(head, isa.NO_LAYER))
    return Partition(spec, board, graphs, tensors, list(unsupported or []), list(notes or []))


def weight_sources(proto: onnx.ModelProto, spec: ModelSpec) -> dict[str, str]:
    """Initializer name of every weight of the task graphs, matched by node tags and shapes (never by name).

    Tagged MatMuls (``fastcar.layer``) go to their layer; untagged ones (layers the compiler did not rewrite,
    plain exports) fill the remaining layers in graph order q, k, v, o, gate, up, down. RMSNorm scales are
    the 1-D [hidden] initializers multiplied in: per layer first attn_norm then mlp_norm (by layer tag, else
    in graph order: fused Skip*Norm nodes join two layers and carry no tag); the last untagged one is the final
    norm.
    """
    h = spec.hidden

    def wanted() -> dict[str, list[int]]:
        return {"q_proj": [h, spec.q_dim], "k_proj": [h, spec.kv_dim], "v_proj": [h, spec.kv_dim],
                "o_proj": [spec.q_dim, h], "gate_proj": [h, spec.intermediate], "up_proj": [h, spec.intermediate],
                "down_proj": [spec.intermediate, h]}

    want = {layer: wanted() for layer in range(spec.layers)}
    sources: dict[str, str] = {}
    seen: set[str] = set()

    qkv = ("q_proj", "k_proj", "v_proj")
    q, kv = spec.q_dim, spec.kv_dim

    def take(layer: int, w: dict[str, Any]) -> bool:
        if w["shape"] == [h, q + 2 * kv] and w.get("part") in (None, "attention") and \
                all(n in want[layer] for n in qkv):  # one packed q/k/v projection (passes/attention_form.py)
            for n, (a, b) in zip(qkv, ((0, q), (q, q + kv), (q + kv, q + 2 * kv)), strict=True):
                sources[f"L{layer}.{n}"] = column_source(w["name"], a, b)
                del want[layer][n]
            return True
        name = next((n for n, s in want[layer].items() if s == w["shape"]), None)
        if name is None:
            return False
        sources[f"L{layer}.{name}"] = w["name"]
        del want[layer][name]
        return True

    untagged = []
    for w in matmul_weights(proto):
        if w["name"] in seen:  # the same weight used again (If branches)
            continue
        seen.add(w["name"])
        if w["layer"] is not None and 0 <= w["layer"] < spec.layers:
            take(w["layer"], w)
        else:
            untagged.append(w)
    free = [layer for layer in range(spec.layers) if len(want[layer]) == 7]
    cur = 0
    for w in untagged:
        if w["shape"] == [h, spec.vocab] and "lm_head" not in sources and (cur >= len(free) or not want[free[cur]]):
            sources["lm_head"] = w["name"]
            continue
        while cur < len(free) and not take(free[cur], w):
            cur += 1
        if cur >= len(free) and w["shape"] == [h, spec.vocab]:
            sources["lm_head"] = w["name"]
    # gate vs up share a shape: the gate's product goes through the SiLU (Sigmoid / Silu node)
    consumers: dict[str, set[str]] = {}
    for node in iter_nodes(proto.graph):
        for name in node.input:
            consumers.setdefault(name, set()).add(node.op_type)
    out_of = {w["name"]: w["output"] for w in matmul_weights(proto)}
    for layer in range(spec.layers):
        g, u = sources.get(f"L{layer}.gate_proj"), sources.get(f"L{layer}.up_proj")
        act = {"Sigmoid", "Silu"}
        if g and u and not consumers.get(out_of[g], set()) & act and consumers.get(out_of[u], set()) & act:
            sources[f"L{layer}.gate_proj"], sources[f"L{layer}.up_proj"] = u, g
    if spec.qk_norm:
        qk = qk_norm_weights(proto, spec.head_dim, h)
        for layer in range(spec.layers):
            sources[f"L{layer}.q_norm"], sources[f"L{layer}.k_norm"] = qk[2 * layer : 2 * layer + 2]
    inits = {}
    for t in proto.graph.initializer:
        if list(t.dims) == [h]:
            inits[t.name] = t
    norms: dict[int | None, list[str]] = {}
    ordered: list[str] = []  # every norm scale in graph order, tagged or not
    for node in iter_nodes(proto.graph):
        if node.op_type not in ("Mul", "RMSNormalization", "SimplifiedLayerNormalization",
                                "SkipSimplifiedLayerNormalization"):
            continue
        tags = {p.key: p.value for p in node.metadata_props}
        layer = int(tags[contract.TAG_LAYER]) if contract.TAG_LAYER in tags else None
        for name in node.input:
            if name in inits and name not in norms.setdefault(layer, []):
                norms[layer].append(name)
            if name in inits and name not in ordered:
                ordered.append(name)
    for layer, names in norms.items():
        if layer is not None and len(names) >= 2:
            sources[f"L{layer}.attn_norm"], sources[f"L{layer}.mlp_norm"] = names[0], names[1]
    untagged_norms = norms.get(None, [])
    missing = [layer for layer in range(spec.layers) if f"L{layer}.attn_norm" not in sources]
    if len(untagged_norms) == 2 * len(missing) + 1:  # plain export: pairs per layer in order, then final
        for i, layer in enumerate(missing):
            sources[f"L{layer}.attn_norm"], sources[f"L{layer}.mlp_norm"] = untagged_norms[2 * i : 2 * i + 2]
    elif missing and len(ordered) == 2 * spec.layers + 1:
        # fused Skip*Norm nodes sit between two layers and carry no layer tag (the exporter fusions run before
        # discovery): the graph order still reads attn_norm, mlp_norm per layer, then the final norm
        for layer in range(spec.layers):
            sources[f"L{layer}.attn_norm"], sources[f"L{layer}.mlp_norm"] = ordered[2 * layer : 2 * layer + 2]
    if untagged_norms:
        sources["final_norm"] = untagged_norms[-1]
    return sources


def scan_onnx_ops(model: onnx.ModelProto) -> tuple[list[str], dict[str, int]]:
    """Ops of every node (subgraphs included): the unsupported ones by name, and a count per op type."""
    bad: list[str] = []
    counts: Counter[str] = Counter()
    for node in iter_nodes(model.graph):
        counts[node.op_type] += 1
        if node.op_type not in COMPUTE_OPS and node.op_type not in NO_COST_OPS:
            bad.append(f"{node.op_type} ({node.name or 'unnamed'}, domain {node.domain or 'ai.onnx'})")
    return bad, dict(counts)


def partition(model: ModelSpec | str | Path | onnx.ModelProto, board: BoardConfig, *,
              num_heads: int | None = None, frame_tokens: int | None = None, strict: bool = True,
              overrides: dict | None = None) -> Partition:
    """Build the task graphs from a ModelSpec or an ONNX decoder.

    With ``strict`` (default) an ONNX model holding ops the accelerator cannot run raises FastCarError listing
    them; otherwise they are kept in ``Partition.unsupported`` for the report. ``overrides`` replaces
    ModelSpec fields (e.g. ``replay_layers=()`` for the dense baseline, ``video_start``).
    """
    if isinstance(model, ModelSpec):
        part = partition_spec(dataclasses.replace(model, **(overrides or {})), board)
        part.video_start_known = True
        return part
    proto = model if isinstance(model, onnx.ModelProto) else load_onnx_shapes_only(model)
    bad, counts = scan_onnx_ops(proto)
    if bad and strict:
        shown = "; ".join(bad[:10]) + (f"; ... {len(bad) - 10} more" if len(bad) > 10 else "")
        raise FastCarError(f"the accelerator cannot run {len(bad)} op(s) of this model: {shown}. "
                           "Remove them before export, or pass strict=False to list them in the report")
    spec, notes = spec_from_model(proto, num_heads=num_heads, dtype_bytes=board.dtype_bytes,
                                  frame_tokens=frame_tokens)
    spec = dataclasses.replace(spec, **(overrides or {}))
    qk = qk_norm_weights(proto, spec.head_dim, spec.hidden)
    if qk and not spec.qk_norm:  # neither dropped silently nor guessed: listed with what it would cost
        cyc = 2 * (spec.q_dim + spec.kv_dim) // board.vector_lanes * spec.layers
        bad.append(f"q/k norm ({len(qk)} [head_dim] norm scales, not 2 per layer: not modelled; about {cyc} "
                   "vector cycles per row and step uncounted)")
    sources = weight_sources(proto, spec)
    kv, kv_notes = kv_bounds(proto)
    part = partition_spec(spec, board, sources=sources, unsupported=bad, notes=notes + kv_notes)
    part.op_counts = counts
    part.kv = kv
    part.video_start_known = "video_start" in (overrides or {}) or any(
        t.name == "video_start" for t in proto.graph.initializer)
    return part


def live_activations(spec: ModelSpec, task: Task) -> int:
    """Values per row a weight GEMM keeps on chip: residual stream, its input, its output (+ gate for up)."""
    extra = spec.intermediate if task.name == "up_proj" else 0
    return spec.hidden + task.k + task.m + extra


def total_tiles(part: Partition) -> int:
    return sum(max(1, len(t.tiles)) for g in part.graphs for t in part.tasks(g))



