"""Model dimensions the FPGA backend needs, from a dataclass or read off an ONNX decoder without its weights.

A compiled fast.onnx carries them in ``fastcar.*`` metadata (docs/DESIGN.md); a plain exported decoder only
has initializer shapes, from which hidden, intermediate, vocab, layers and the q/kv widths follow (MatMul
weights are ``[in, out]`` after the exporter folds transposes). Head counts are not visible in shapes: they
come from the metadata, from 4-D Reshape targets ``[.., .., heads, head_dim]``, or from the caller.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from fastcar_compile.core import contract
from fastcar_compile.core.errors import FastCarError

from . import isa


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A LLaMA-style decoder: pre-norm, attention with KV cache, SwiGLU MLP, residual adds."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    dtype_bytes: int = 2
    frame_tokens: int | None = None  # L; needed by FastCar layers (TAS, replay cache), None for a dense program
    replay_layers: tuple[int, ...] | None = None  # None: every layer; () : dense model
    threshold: float = -4.0
    video_start: int = 0
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    tas_query: str = contract.TAS_ROPE  # rope: TAS uses q after RoPE (DESIGN default); raw: before (released code)
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3), weights [head_dim]

    def __post_init__(self) -> None:
        for f in ("layers", "hidden", "intermediate", "heads", "kv_heads", "head_dim", "vocab", "dtype_bytes"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise FastCarError(f"model spec: {f}={v!r} must be a positive integer")
        ft = self.frame_tokens
        if ft is not None and (isinstance(ft, bool) or not isinstance(ft, int) or not 1 <= ft <= isa.MAX_FRAME_TOKENS):
            raise FastCarError(f"model spec: frame_tokens={ft!r} must be a positive integer (tokens per frame)")
        if ft is None and self.replay_layers != ():
            raise FastCarError("model spec: FastCar layers need frame_tokens (tokens per video frame, "
                               "--frame-tokens); a dense program (replay_layers=()) does not")
        vs = self.video_start
        if isinstance(vs, bool) or not isinstance(vs, int) or not 0 <= vs <= isa.MAX_VIDEO_START:
            raise FastCarError(f"model spec: video_start={vs!r} must be an integer in 0..{isa.MAX_VIDEO_START}")
        for f in ("threshold", "rms_eps", "rope_theta"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int | float) or v != v:
                raise FastCarError(f"model spec: {f}={v!r} must be a number")
        if not 0 < self.rms_eps < 1 or not 1 < self.rope_theta < float("inf"):
            raise FastCarError(f"model spec: rms_eps {self.rms_eps} must be in (0, 1) and rope_theta "
                               f"{self.rope_theta} a finite number > 1")
        if not isinstance(self.qk_norm, bool):
            raise FastCarError(f"model spec: qk_norm={self.qk_norm!r} must be true or false")
        if self.heads % self.kv_heads:
            raise FastCarError(f"model spec: heads {self.heads} not a multiple of kv_heads {self.kv_heads}")
        if self.tas_query not in contract.TAS_QUERIES:
            raise FastCarError(f"model spec: tas_query {self.tas_query!r} must be one of {contract.TAS_QUERIES}")
        if self.head_dim % 2:
            raise FastCarError(f"model spec: head_dim {self.head_dim} must be even (RoPE pairs)")
        if self.replay_layers is not None:
            bad = [i for i in self.replay_layers if not 0 <= i < self.layers]
            if bad:
                raise FastCarError(f"model spec: replay layers {bad} outside 0..{self.layers - 1}")

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def replayable(self) -> frozenset[int]:
        return frozenset(range(self.layers) if self.replay_layers is None else self.replay_layers)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["replay_layers"] = None if self.replay_layers is None else list(self.replay_layers)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelSpec:
        d = dict(d)
        if d.get("replay_layers") is not None:
            d["replay_layers"] = tuple(d["replay_layers"])
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    # Per-layer analytic totals (one decode step, one row), used by tests and reports.
    def layer_weight_elems(self) -> dict[str, int]:
        h, i = self.hidden, self.intermediate
        return {"q": h * self.q_dim, "k": h * self.kv_dim, "v": h * self.kv_dim, "o": self.q_dim * h,
                "gate": h * i, "up": h * i, "down": i * h}


# Reference decoder sizes.
LLAMA2_7B = ModelSpec(layers=32, hidden=4096, intermediate=11008, heads=32, kv_heads=32, head_dim=128,
                      vocab=32000, dtype_bytes=2, frame_tokens=256)
TINY = ModelSpec(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16, vocab=128,
                 dtype_bytes=2, frame_tokens=4)


def _meta(model: onnx.ModelProto) -> dict[str, str]:
    return {p.key: p.value for p in model.metadata_props}


def _node_tags(node: onnx.NodeProto) -> dict[str, str]:
    return {p.key: p.value for p in node.metadata_props}


def iter_nodes(graph: onnx.GraphProto):
    """Every node of a graph, including nodes of If/Loop subgraphs (the MLP sits inside an If)."""
    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from iter_nodes(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    yield from iter_nodes(g)


def _initializers(graph: onnx.GraphProto, out: dict[str, onnx.TensorProto]) -> dict[str, onnx.TensorProto]:
    for t in graph.initializer:
        out[t.name] = t
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                _initializers(attr.g, out)
    return out


SMALL_TENSOR = 1 << 21  # elements: external tensors up to this size are read (RoPE tables, norms, constants)


def load_onnx_shapes_only(path: str | Path) -> onnx.ModelProto:
    """The graph without its large external weight data (shapes are in the TensorProto dims). Small external
    tensors are read from beside the model, wherever the command runs: the readers of RoPE tables, epsilons and
    reshape targets take their values (a compiled model over 16 MiB keeps its cos/sin tables in fast.onnx.data)."""
    from onnx.external_data_helper import load_external_data_for_tensor, uses_external_data

    try:
        model = onnx.load(str(path), load_external_data=False)
    except FileNotFoundError:
        raise FastCarError(f"model {path} not found") from None
    except Exception as exc:  # onnx raises DecodeError and friends
        raise FastCarError(f"cannot read ONNX model {path}: {exc}") from None
    base = str(Path(path).resolve().parent)
    for t in _initializers(model.graph, {}).values():
        if uses_external_data(t) and int(np.prod(t.dims)) <= SMALL_TENSOR:
            try:
                load_external_data_for_tensor(t, base)
            except Exception as exc:  # noqa: BLE001 - a missing or unreadable data file
                raise FastCarError(f"cannot read the external data of {t.name} beside {path} ({exc}); copy the "
                                   "model with the data files it names") from None
            t.data_location = onnx.TensorProto.DEFAULT
            del t.external_data[:]
    return model


def column_source(name: str, start: int, stop: int) -> str:
    """A weight that is columns [start, stop) of an initializer: a packed q/k/v projection (passes/attention_form.py)
    holds q_proj, k_proj and v_proj side by side."""
    return f"{name}[:, {start}:{stop}]"


def split_source(source: str) -> tuple[str, slice | None]:
    """(initializer name, column slice or None) of a weight source written by column_source or a plain name."""
    if source.endswith("]") and "[:, " in source:
        name, cols = source[:-1].rsplit("[:, ", 1)
        start, stop = (int(x) for x in cols.split(":"))
        return name, slice(start, stop)
    return source, None


def matmul_weights(model: onnx.ModelProto) -> list[dict[str, Any]]:
    """MatMul/Gemm nodes whose second input is a 2-D initializer: name, shape [in, out], layer/part tags."""
    inits = _initializers(model.graph, {})
    out = []
    for node in iter_nodes(model.graph):
        if node.op_type not in ("MatMul", "Gemm") or len(node.input) < 2:
            continue
        t = inits.get(node.input[1])
        if t is None or len(t.dims) != 2:
            continue
        shape = [int(t.dims[0]), int(t.dims[1])]
        if node.op_type == "Gemm":
            trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
            if trans_b:
                shape = shape[::-1]
        tags = _node_tags(node)
        out.append({"name": t.name, "node": node.name, "output": node.output[0], "shape": shape,
                    "layer": int(tags[contract.TAG_LAYER]) if contract.TAG_LAYER in tags else None,
                    "part": tags.get(contract.TAG_PART)})
    return out


def _reshape_heads(model: onnx.ModelProto, q_dim: int, kv_dim: int) -> tuple[int, int, int] | None:
    """(heads, kv_heads, head_dim) from 4-D Reshape targets [.., .., H, D] with H*D == q_dim / kv_dim."""
    consts: dict[str, list[int]] = {}
    for t in _initializers(model.graph, {}).values():
        if t.data_type == onnx.TensorProto.INT64 and len(t.dims) == 1 and t.dims[0] == 4:
            consts[t.name] = [int(x) for x in numpy_helper.to_array(t)]
    for node in iter_nodes(model.graph):
        if node.op_type == "Constant":
            for a in node.attribute:
                if a.name == "value" and a.t.data_type == onnx.TensorProto.INT64 and list(a.t.dims) == [4]:
                    consts[node.output[0]] = [int(x) for x in numpy_helper.to_array(a.t)]
    cand_q, cand_kv = Counter(), Counter()
    for node in iter_nodes(model.graph):
        if node.op_type == "Reshape" and len(node.input) > 1 and node.input[1] in consts:
            shp = consts[node.input[1]]
            h, d = shp[2], shp[3]
            if h > 0 and d > 0:
                if h * d == q_dim:
                    cand_q[(h, d)] += 1
                if h * d == kv_dim:
                    cand_kv[(h, d)] += 1
    for (h, d), _ in cand_q.most_common():
        if any(dd == d for (_, dd) in cand_kv):
            return h, kv_dim // d, d
    # RoPE inverse frequencies [head_dim / 2]: 1, theta^(-2/d), ... (transformers keeps them as a buffer)
    for t in _initializers(model.graph, {}).values():
        if len(t.dims) == 1 and t.dims[0] >= 2 and t.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16):
            d = 2 * int(t.dims[0])
            if q_dim % d or kv_dim % d:
                continue
            v = numpy_helper.to_array(t).astype(float)
            if abs(v[0] - 1.0) < 1e-6 and (np.diff(v) < 0).all() and (v > 0).all():
                return q_dim // d, kv_dim // d, d
    return None


NORM_OPS = ("RMSNormalization", "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization")


def _float_consts(model: onnx.ModelProto) -> dict[str, float]:
    """Scalar (or one-element) float constants by name: initializers and Constant nodes."""
    out: dict[str, float] = {}
    tensors = [(t.name, t) for t in _initializers(model.graph, {}).values()]
    tensors += [(n.output[0], a.t) for n in iter_nodes(model.graph) if n.op_type == "Constant" and n.output
                for a in n.attribute if a.name == "value"]
    for name, t in tensors:
        if t.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE) and \
                int(np.prod(t.dims)) == 1:
            out[name] = float(numpy_helper.to_array(t).reshape(-1)[0])
    return out


def _shortest(v: float) -> float:
    """A float32 value as the decimal it was written as (9.99999997e-07 -> 1e-06)."""
    return float(str(np.float32(v)))


def rms_eps_values(model: onnx.ModelProto) -> Counter[float]:
    """The epsilon of every RMSNorm of the graph: the attribute of the fused norm ops, or the constant added to
    the mean of squares (ReduceMean -> Add eps -> Sqrt) of an unfused one."""
    found: Counter[float] = Counter()
    producer = {o: n for n in iter_nodes(model.graph) for o in n.output}
    consts = _float_consts(model)
    for node in iter_nodes(model.graph):
        if node.op_type in NORM_OPS:
            eps = next((a.f for a in node.attribute if a.name == "epsilon"), 1e-5)  # the ops' documented default
            found[_shortest(eps)] += 1
        elif node.op_type == "Add" and len(node.input) == 2:
            a, b = node.input
            for mean, const in ((a, b), (b, a)):
                src = producer.get(mean)
                if src is not None and src.op_type == "ReduceMean" and const in consts:
                    found[_shortest(consts[const])] += 1
    return found


def rope_theta_from_graph(model: onnx.ModelProto, head_dim: int) -> float | None:
    """RoPE base from the inverse-frequency table [head_dim / 2] (inv[i] = theta^(-2i/d)) or from a cos cache
    [positions, head_dim / 2] (cos[p, i] = cos(p * inv[i])); None when neither is in the graph."""
    for t in _initializers(model.graph, {}).values():
        if t.data_type not in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16) or \
                list(t.dims)[-1:] != [head_dim // 2] or head_dim < 4:
            continue
        v = numpy_helper.to_array(t).astype(np.float64)
        if v.ndim == 1 and abs(v[0] - 1.0) < 1e-6 and (np.diff(v) < 0).all() and (v > 0).all():
            return float(f"{v[1] ** (-head_dim / 2):.6g}")
        if v.ndim == 2 and v.shape[0] > 1 and np.allclose(v[0], 1.0) and "cos" in t.name.lower() and \
                -1 < v[1, 1] < 1:
            return float(f"{np.arccos(v[1, 1]) ** (-head_dim / 2):.6g}")
    return None


def qk_norm_weights(model: onnx.ModelProto, head_dim: int, hidden: int) -> list[str]:
    """Names of the per-head q/k norm scales ([head_dim] initializers multiplied in by a norm), in graph
    order (per layer q then k, as transformers computes them)."""
    if head_dim == hidden:
        return []
    inits = {t.name for t in _initializers(model.graph, {}).values() if list(t.dims) == [head_dim]}
    names: dict[str, None] = {}  # ordered set
    for node in iter_nodes(model.graph):
        if node.op_type in ("Mul", *NORM_OPS):
            names.update((i, None) for i in node.input if i in inits)
    return list(names)


def kv_bounds(model: onnx.ModelProto) -> tuple[dict[int, Any], list[str]]:
    """Layer -> KVBound of the compressed KV cache the compiled model records (fastcar.kv_compress), and notes
    on the settings the accelerator's cost model does not price (it prices the slots read: min(context,
    budget)); ({}, []) for a dense KV cache."""
    from .kvbound import from_settings

    meta = contract.FastCarMetadata.from_props(_meta(model))
    if meta is None:
        return {}, []
    out, notes = {}, []
    unpriced = {"tempcache_sim": "TempCache merging", "lsh_bits": "AnnSA (LSH)", "int8_dirs": "AnnSA (int8)",
                "prune_prompt": "prompt pruning"}
    seen: set[str] = set()
    for layer, settings in sorted(meta.kv_layer_settings().items()):
        bound = from_settings(settings)
        if bound is not None:
            out[layer] = bound
        seen |= {what for key, what in unpriced.items() if settings.get(key) is not None}
    if seen:
        notes.append(f"KV cache: {', '.join(sorted(seen))} not priced; attention reads min(context, budget) slots")
    return out, notes


def spec_from_onnx(path: str | Path, *, num_heads: int | None = None, num_kv_heads: int | None = None,
                   dtype_bytes: int = 2, frame_tokens: int | None = None) -> tuple[ModelSpec, list[str]]:
    """Read model dims from a fast.onnx (metadata) or a plain decoder (shapes). Returns (spec, notes)."""
    model = load_onnx_shapes_only(path)
    return spec_from_model(model, num_heads=num_heads, num_kv_heads=num_kv_heads, dtype_bytes=dtype_bytes,
                           frame_tokens=frame_tokens)


def spec_from_model(model: onnx.ModelProto, *, num_heads: int | None = None, num_kv_heads: int | None = None,
                    dtype_bytes: int = 2, frame_tokens: int | None = None) -> tuple[ModelSpec, list[str]]:
    notes: list[str] = []
    meta = contract.FastCarMetadata.from_props(_meta(model))
    weights = matmul_weights(model)
    if not weights:
        raise FastCarError("no MatMul weights found: is this an exported decoder (MatMul with initializer weights)?")
    shapes = Counter(tuple(w["shape"]) for w in weights)
    in_dims = Counter()
    for (i, _), c in shapes.items():
        in_dims[i] += c
    hidden = meta.hidden_size if meta is not None else in_dims.most_common(1)[0][0]
    downs = [(i, c) for (i, o), c in shapes.items() if o == hidden and i != hidden]
    if not downs:
        raise FastCarError(f"cannot find the MLP down projection ([intermediate, {hidden}]) among MatMul weights")
    intermediate, layers_found = max(downs, key=lambda ic: (ic[1], ic[0]))
    layers = meta.num_layers if meta is not None else layers_found
    # o_proj is [q_dim, hidden] once per layer; k/v are [hidden, kv_dim] twice per layer.
    o_cands = [i for (i, o), c in shapes.items() if o == hidden and i != intermediate and c == layers]
    q_dim = o_cands[0] if o_cands else hidden
    kv_cands = [o for (i, o), c in shapes.items()
                if i == hidden and o not in (q_dim, intermediate) and c == 2 * layers]
    kv_dim = kv_cands[0] if kv_cands else q_dim
    # LM head: [hidden, vocab] beyond the per-layer count; else the embedding table read by Gather.
    per_layer_h = {intermediate: 2 * layers, q_dim: layers, kv_dim: 2 * layers}
    if kv_dim == q_dim:
        per_layer_h[q_dim] = 3 * layers
    vocab_cands = [o for (i, o), c in shapes.items() if i == hidden and c > per_layer_h.get(o, 0)]
    if meta is not None:
        heads, kv_heads, head_dim = meta.num_heads, meta.num_kv_heads, meta.head_dim
    elif num_heads:
        heads = num_heads
        head_dim = q_dim // heads
        kv_heads = num_kv_heads or kv_dim // head_dim
    else:
        found = _reshape_heads(model, q_dim, kv_dim)
        if found is None:
            raise FastCarError("cannot tell the number of attention heads from this graph; pass num_heads")
        heads, kv_heads, head_dim = found
        notes.append(f"heads {heads}, kv heads {kv_heads}, head_dim {head_dim} read from Reshape targets / RoPE table")
    inits = _initializers(model.graph, {})
    gathered = {n.input[0] for n in iter_nodes(model.graph) if n.op_type == "Gather" and n.input}
    emb = [int(inits[g].dims[0]) for g in gathered if g in inits and len(inits[g].dims) == 2
           and inits[g].dims[1] == hidden]
    vocab = max(vocab_cands) if vocab_cands else max(emb, default=0)
    if not vocab:
        raise FastCarError("cannot find the vocabulary size (no LM head [hidden, vocab] or embedding weight)")
    replay_layers: tuple[int, ...] | None = ()
    threshold, tas_query = -4.0, contract.TAS_ROPE
    if meta is None:
        ft = frame_tokens
        notes.append("plain decoder (no fastcar.* metadata): dense program (no TAS, no replay); compile it to "
                     "fast.onnx first for FastCar instructions")
    else:
        if frame_tokens is not None and frame_tokens != meta.frame_tokens:
            raise FastCarError(f"--frame-tokens {frame_tokens} disagrees with the model, compiled with frame_tokens "
                               f"{meta.frame_tokens}; drop --frame-tokens or recompile the model")
        ft = meta.frame_tokens
        replay_layers, threshold, tas_query = tuple(meta.layers), meta.first_threshold, meta.tas_query
        if isinstance(meta.threshold, list):
            notes.append("per-layer thresholds: the TAS unit uses the first one (one tau register)")
        if meta.max_replay:
            notes.append(f"max_replay {meta.max_replay} (drift guard) is not modelled: the TAS unit only "
                         "checks that the cache slot was written")
    details: dict[str, Any] = {}
    if meta is not None:
        start = next((t for t in model.graph.initializer if t.name == contract.VIDEO_START), None)
        if start is not None:  # compiled in (--video-start): the video start every run of the model uses
            details["video_start"] = int(numpy_helper.to_array(start).reshape(-1)[0])
        else:
            notes.append("video_start is an input of the model, fed per run: the bundle records 0 unless "
                         "--video-start N says otherwise; `sim --replay-trace` uses the trace's")
    eps = rms_eps_values(model)
    if eps:
        details["rms_eps"] = eps.most_common(1)[0][0]
        if len(eps) > 1:
            notes.append(f"RMSNorm epsilons differ ({sorted(eps)}): the vector unit uses {details['rms_eps']:g}")
    else:
        notes.append("no RMSNorm epsilon found in the graph: functional mode uses 1e-05")
    theta = rope_theta_from_graph(model, head_dim)
    if theta is not None:
        details["rope_theta"] = theta
    else:
        notes.append("no RoPE frequency table found in the graph: functional mode uses theta 10000")
    qk = qk_norm_weights(model, head_dim, hidden)
    if len(qk) == 2 * layers:
        details["qk_norm"] = True
        notes.append("q/k norm: per-head RMSNorm of q and k (2 VEC RMSNORM instructions per layer)")
    spec = ModelSpec(layers=layers, hidden=hidden, intermediate=intermediate, heads=heads, kv_heads=kv_heads,
                     head_dim=head_dim, vocab=vocab, dtype_bytes=dtype_bytes, frame_tokens=ft,
                     replay_layers=replay_layers, threshold=threshold,
                     tas_query=tas_query, **details)
    return spec, notes
