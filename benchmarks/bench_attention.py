"""One attention layer at real shapes: the fastest dense attention against AnnSA and TempCache at their density.

A chunk's queries attend to a cache of C earlier frames (a full context: every frame kept) and to the chunk itself.
Keys and queries have a trained model's structure (attention_data.py): the causal DiT trained here, recorded over a
rollout, at its own shape (`dit`), and tiled to Wan2.1-1.3B's (`wan`: 1560 tokens per frame, 12 heads x 128,
chunks of 3 frames; each head the 4 heads of one DiT layer side by side, each frame's 64 tokens repeated).

Per (shape, context), every variant runs on the same inputs, interleaved call by call, 1 thread, lower quartile:
- dense: PyTorch's scaled_dot_product_attention, ONNX Runtime's com.microsoft MultiHeadAttention and ONNX
  Attention (opset 23) over [cache; chunk], and the compiled step graph's in-place form (FusedMatMul over the
  cache buffer, the chunk apart, one softmax: passes/dit_cache.py) where its score matrix fits in memory;
  `ms_dense` is the fastest of them;
- AnnSA (sign LSH 4 bits x 2 tables, int8 2 directions x 2 tables; the sink frames, 1 local frame and the chunk
  dense): ai.fastcar AnnSAAttention, its inputs as the stream runtime builds them (dit/annsa_index.py);
- TempCache (aligned, SIM 0.9 and 0.95): the cache the stream runtime's merge leaves after writing the C frames
  (dit/stream.RingCache), attended through ai.fastcar SlotAttention over the resident slots with log(count).

Per row: density (executed q.k pairs / dense pairs), recall (the dense softmax mass the mode keeps: selected keys'
mass, or for merged slots each member's min(dense, slot / count), exact for `dit`, over sampled queries for
`wan`), ms and ms_dense (thread CPU time: the machine is shared, so wall time mostly measures other jobs; wall
lower quartiles are kept too), pair_cost = time per executed pair / time per dense pair (ms / (ms_dense x
density)), bound = 1 / density (the speed-up if a pair cost what a dense one does), and the index's cost: the
query codes per step (`codes_ms`, the NumPy hasher) and per chunk the keys' codes and the sorted slot lists or
TempCache's merge (`index_ms`; a chunk is 5 steps: 4 denoising + the clean pass).

    python benchmarks/bench_attention.py --shapes dit --contexts 16,64 --out out.json
    python -m benchmarks attention --size quick
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DEFAULT_CACHE, interleave_cpu_wall, make_session, save_results  # noqa: E402
from attention_data import ANNSA_ROWS, Capture, capture_dit, capture_tokens  # noqa: E402

STEPS_PER_CHUNK = 5  # 4 denoising steps + the clean pass share a chunk's index
SCORES_LIMIT = 1 << 30  # bytes of score matrix an ONNX Runtime attention may form at once (the machine's memory)
RECALL_QUERIES = 64  # per (row, head) where recall is sampled
WAN_ROUNDS = 3  # at Wan's shape a call takes seconds to minutes: the lower quartile of 3 is stable
CAPTURED_FRAMES = 202  # one capture serves every context up to 200 frames (cached once)


@dataclass(frozen=True)
class Shape:
    name: str
    about: str
    rows: int
    heads: int
    head_dim: int
    tokens: int  # per frame
    chunk: int  # frames per chunk
    sinks: int


SHAPES = {
    "token": Shape("token", "the token world model (4 heads x 64, 65-token frames), one decode step; the bundled long-"
                   "video decoder's q/k tiled", 1, 4, 64, 65, 0, 1),
    "dit": Shape("dit", "the causal DiT trained here (2 CFG rows, 4 heads x 32, 64 tokens/frame, chunk 2)", 2, 4, 32,
                 64, 2, 2),
    "wan": Shape("wan", "Wan2.1-1.3B (12 heads x 128, 1560 tokens/frame, chunk 3), the DiT's q/k tiled", 1, 12, 128,
                 1560, 3, 3),
}


@dataclass
class Problem:
    """One layer's attention at context C: q (scaled) / k / v of the chunk [B, H, Q, d], the cache [B, H, S, d]
    (frame-major, S = C T) with its pre-RoPE keys, and the unscaled q for the bucket codes."""

    q: np.ndarray
    q_raw: np.ndarray
    k: np.ndarray
    v: np.ndarray
    pk: np.ndarray
    pv: np.ndarray
    pk_pre: np.ndarray


def _frames_to_tokens(x: np.ndarray) -> np.ndarray:
    """[F, B, H, T, d] -> [B, H, F T, d]."""
    F, B, H, T, d = x.shape
    return np.ascontiguousarray(x.transpose(1, 2, 0, 3, 4).reshape(B, H, F * T, d))


def dit_problem(cap: Capture, layer: int, context: int) -> Problem:
    if context % cap.chunk or context // cap.chunk >= cap.q.shape[1]:
        raise SystemExit(f"context {context}: needs a multiple of {cap.chunk} below the {cap.ck.shape[1]} frames "
                         "captured")
    c = context // cap.chunk
    d = cap.q.shape[-1]
    q = cap.q[layer, c]
    return Problem(np.ascontiguousarray(q * d ** -0.5), q, cap.k[layer, c], cap.v[layer, c],
                   _frames_to_tokens(cap.ck[layer, :context]), _frames_to_tokens(cap.cv[layer, :context]),
                   _frames_to_tokens(cap.ck_pre[layer, :context]))


def wan_problem(cap: Capture, shape: Shape, context: int) -> Problem:
    """The DiT's tensors tiled to `shape`: head h = the 4 heads of layer h % layers side by side (4 x 32 = 128
    dims), its frames' tokens = a permutation (seeded by h // layers) of the DiT frame's 64 tokens, repeated."""
    L, _, _, Hc, Tc, dc = cap.ck.shape
    if shape.head_dim != Hc * dc or context + shape.chunk > cap.ck.shape[1]:
        raise SystemExit(f"context {context}: the capture has {cap.ck.shape[1]} frames of {Hc} x {dc} heads")
    T = shape.tokens
    maps = [np.random.default_rng(v).permutation(Tc)[np.arange(T) % Tc] for v in range(-(-shape.heads // L))]
    # the chunk's frames: a DiT chunk's tokens are [frame, token]; the recorded step covers cap.chunk frames
    step_frames = {}
    for f in range(context, context + shape.chunk):
        c, j = divmod(f, cap.chunk)
        step_frames[f] = (c, j)

    def head_frames(src, layer, frames, mp):  # src [L, F, B, H, T, d] -> [len(frames) T, H d]
        x = src[layer, frames, 0][:, :, mp]  # [F, Hc, T, dc]
        return x.transpose(0, 2, 1, 3).reshape(len(frames) * T, Hc * dc)

    def chunk_head(src, layer, mp):  # the step's tensors [L, chunks, B, H, chunk T, d] -> [chunk T, H d]
        parts = []
        for f in range(context, context + shape.chunk):
            c, j = step_frames[f]
            x = src[layer, c, 0][:, j * Tc:(j + 1) * Tc][:, mp]  # [Hc, T, dc]
            parts.append(x.transpose(1, 0, 2).reshape(T, Hc * dc))
        return np.concatenate(parts)

    frames = list(range(context))
    out = {n: np.empty((1, shape.heads, n_tok, shape.head_dim), np.float32) for n, n_tok in
           (("q", shape.chunk * T), ("k", shape.chunk * T), ("v", shape.chunk * T), ("pk", context * T),
            ("pv", context * T), ("pk_pre", context * T))}
    for h in range(shape.heads):
        layer, mp = h % L, maps[h // L]
        out["q"][0, h] = chunk_head(cap.q, layer, mp)
        out["k"][0, h] = chunk_head(cap.k, layer, mp)
        out["v"][0, h] = chunk_head(cap.v, layer, mp)
        out["pk"][0, h] = head_frames(cap.ck, layer, frames, mp)
        out["pv"][0, h] = head_frames(cap.cv, layer, frames, mp)
        out["pk_pre"][0, h] = head_frames(cap.ck_pre, layer, frames, mp)
    d = shape.head_dim
    return Problem(out["q"] * np.float32(d ** -0.5), out["q"], out["k"], out["v"], out["pk"], out["pv"],
                   out["pk_pre"])


# ------------------------------------------------------------------------------------------------ the variants
def _node_model(op: str, inputs: list[tuple[str, int]], domain: str = "", opset: int = 17, **attrs) -> bytes:
    from onnx import TensorProto, helper

    from fastcar_compile.core import contract
    from fastcar_compile.passes.fastcar_ops import function_proto

    node = helper.make_node(op, [n for n, _ in inputs], ["out"], domain=domain, **attrs)
    ins = [helper.make_tensor_value_info(n, t, None) for n, t in inputs]
    graph = helper.make_graph([node], op, ins, [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)])
    opsets = [helper.make_opsetid("", opset)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    model = helper.make_model(graph, opset_imports=opsets, ir_version=10)
    if domain == contract.DOMAIN:
        model.functions.append(function_proto(op, opset))
    return model.SerializeToString()


def _inplace_model() -> bytes:
    """The compiled step graph's attention (passes/dit_cache.py): scores over the cache buffer by FusedMatMul
    (transB) plus the past_length mask, the chunk's scores apart, one softmax, both products, their sum."""
    from onnx import TensorProto, helper

    from fastcar_compile.core import contract

    f = TensorProto.FLOAT
    c = lambda name, v: helper.make_node("Constant", [], [name], value=helper.make_tensor(  # noqa: E731
        name, TensorProto.INT64 if isinstance(v[0], int) else f, [len(v)] if len(v) > 1 or name.endswith("_1") else [],
        v))
    nodes = [c("two_1", [2]), c("three_1", [3]), c("zero_s", [0]), c("one_s", [1]), c("zero_f", [0.0]),
             c("ninf", [float("-inf")]), c("last_1", [-1]), c("zero_1", [0]), c("end_1", [2 ** 63 - 1]),
             helper.make_node("Shape", ["past_key"], ["shape"]),
             helper.make_node("Slice", ["shape", "two_1", "three_1"], ["cap_1"]),
             helper.make_node("Squeeze", ["cap_1"], ["cap"]),
             helper.make_node("Range", ["zero_s", "cap", "one_s"], ["slots"]),
             helper.make_node("Less", ["slots", "past_length"], ["live"]),
             helper.make_node("Where", ["live", "zero_f", "ninf"], ["bias"]),
             helper.make_node("FusedMatMul", ["q", "past_key"], ["ps"], domain=contract.MS_DOMAIN, transB=1, alpha=1.0),
             helper.make_node("Add", ["ps", "bias"], ["masked"]),
             helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["ss"]),
             helper.make_node("Concat", ["masked", "ss"], ["joined"], axis=-1),
             helper.make_node("Softmax", ["joined"], ["probs"], axis=-1),
             helper.make_node("Slice", ["probs", "zero_1", "cap_1", "last_1"], ["pp"]),
             helper.make_node("Slice", ["probs", "cap_1", "end_1", "last_1"], ["pc"]),
             helper.make_node("MatMul", ["pp", "past_value"], ["op"]),
             helper.make_node("MatMul", ["pc", "v"], ["oc"]),
             helper.make_node("Add", ["op", "oc"], ["out"])]
    ins = [helper.make_tensor_value_info(n, f, None) for n in ("q", "k", "v", "past_key", "past_value")]
    ins.append(helper.make_tensor_value_info("past_length", TensorProto.INT64, [1]))
    graph = helper.make_graph(nodes, "inplace", ins, [helper.make_tensor_value_info("out", f, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(contract.MS_DOMAIN,
                                                                                                     1)],
                             ir_version=10).SerializeToString()


def dense_variants(p: Problem, threads: int) -> tuple[dict[str, callable], list[str]]:
    """The dense attentions, each a callable over inputs prepared in its preferred layout (not timed), and notes on
    those run per (row, head) or not at all. ONNX Runtime's CPU attention ops form the [Q, S] score matrix (ORT's
    MultiHeadAttention and Attention-23 as the in-place graph does): where all heads' would exceed SCORES_LIMIT they
    run one (row, head) at a time (the same work: 1 thread either way), and not at all where one head's would."""
    import torch
    from onnx import TensorProto

    F = TensorProto.FLOAT
    B, H, Q, d = p.q.shape
    S = p.pk.shape[2]
    K = np.concatenate([p.pk, p.k], 2)
    V = np.concatenate([p.pv, p.v], 2)
    out: dict[str, callable] = {}
    notes: list[str] = []
    tq, tk, tv = torch.from_numpy(p.q_raw), torch.from_numpy(K), torch.from_numpy(V)
    out["torch sdpa"] = lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv)
    per_head = Q * (S + Q) * 4
    if per_head > SCORES_LIMIT:
        notes.append(f"ONNX Runtime's attention ops not run: one head's score matrix is {per_head / 2**30:.1f} GiB")
        return out, notes
    split = B * H * per_head > SCORES_LIMIT
    if split:
        notes.append(f"ONNX Runtime's attention ops run one (row, head) at a time ({B * H} calls): all heads' score "
                     f"matrices would take {B * H * per_head / 2**30:.1f} GiB")
    heads = [(b, h) for b in range(B) for h in range(H)] if split else [(slice(None), slice(None))]

    def sl(a, b, h):  # a [B, H, ...] -> the (row, head) slice, 4-D
        return a if not split else np.ascontiguousarray(a[b:b + 1, h:h + 1])

    def runner(sess, feeds):
        return lambda: [sess.run(None, f) for f in feeds]

    nh = 1 if split else H
    mha = make_session(_node_model("MultiHeadAttention", [("q", F), ("k", F), ("v", F)], "com.microsoft",
                                   num_heads=nh), threads)
    feeds = []
    for b, h in heads:
        qq = sl(p.q_raw, b, h)
        feeds.append({"q": np.ascontiguousarray(qq.transpose(0, 2, 1, 3).reshape(qq.shape[0], Q, nh * d)),
                      "k": sl(K, b, h), "v": sl(V, b, h)})
    out["ort MultiHeadAttention"] = runner(mha, feeds)
    att = make_session(_node_model("Attention", [("q", F), ("k", F), ("v", F)], opset=23), threads)
    out["ort Attention-23"] = runner(att, [{"q": sl(p.q_raw, b, h), "k": sl(K, b, h), "v": sl(V, b, h)}
                                           for b, h in heads])
    inplace = make_session(_inplace_model(), threads)
    out["ort in-place (compiled graph)"] = runner(inplace, [
        {"q": sl(p.q, b, h), "k": sl(p.k, b, h), "v": sl(p.v, b, h), "past_key": sl(p.pk, b, h),
         "past_value": sl(p.pv, b, h), "past_length": np.array([S], np.int64)} for b, h in heads])
    return out, notes


def annsa_inputs(p: Problem, shape: Shape, context: int, kind: str) -> tuple[dict, dict]:
    """AnnSAAttention's feed as the stream runtime builds it (sinks + 1 local frame dense, the rest bucketed) and
    the index's timings / counts."""
    from fastcar_compile.core.contract import ANNSA_NATIVE, AnnSARecord
    from fastcar_compile.dit.annsa_index import shared_pairs, slot_lists
    from fastcar_compile.fastar.config import hasher_of

    rec = AnnSARecord(kind, 4, 2, 2, 0, annsa_local=1, annsa_kernel=ANNSA_NATIVE)
    hasher = hasher_of(rec, shape.head_dim)
    T = shape.tokens
    B, H, Q, _ = p.q.shape
    S = p.pk.shape[2]
    t0 = time.thread_time()
    codes = hasher.codes(p.pk)  # [B, H, S, tables]: each key once, when its frame is written
    key_ms = (time.thread_time() - t0) * 1e3 * shape.chunk / context  # one chunk's frames
    frame = np.arange(S) // T
    dense = np.flatnonzero((frame < shape.sinks) | (frame >= context - rec.annsa_local)).astype(np.int64)
    sparse = np.flatnonzero((frame >= shape.sinks) & (frame < context - rec.annsa_local)).astype(np.int64)
    t0 = time.thread_time()
    key_codes, sorted_codes, sorted_slots = slot_lists(codes, sparse)
    lists_ms = (time.thread_time() - t0) * 1e3
    t0 = time.thread_time()
    qcodes = hasher.codes(p.q_raw)
    codes_ms = (time.thread_time() - t0) * 1e3
    feed = {"q": p.q, "k": p.k, "v": p.v, "past_key": p.pk, "past_value": p.pv, "dense": dense, "query_codes": qcodes,
            "key_codes": key_codes, "sorted_codes": sorted_codes, "sorted_slots": sorted_slots}
    pairs = B * H * Q * (dense.size + Q) + shared_pairs(qcodes, codes[:, :, sparse])
    return feed, {"pairs": pairs, "codes_ms": codes_ms, "index_ms": key_ms + lists_ms,
                  "selected": (dense, codes, qcodes, sparse)}


def tempcache_inputs(p: Problem, shape: Shape, context: int, sim: float) -> tuple[dict, dict]:
    """SlotAttention's feed over the cache the stream runtime's aligned TempCache leaves after writing the C
    frames one chunk at a time (sink frames never merge): each (row, head)'s resident slots and log(count)."""
    from fastcar_compile.dit.cache import resident_slots
    from fastcar_compile.dit.stream import RingCache

    T, ch = shape.tokens, shape.chunk
    B, H, Q, d = p.q.shape
    ring = RingCache(1, T, shape.sinks, 0, grow_from=context, tempcache=sim)
    seconds = []
    for f0 in range(0, context, ch):
        sl = slice(f0 * T, min(context, f0 + ch) * T)
        t0 = time.thread_time()
        ring.write(f0, [p.pk[:, :, sl], p.pv[:, :, sl], p.pk_pre[:, :, sl]])
        seconds.append(time.thread_time() - t0)
    counts = ring.counts[0][:, :, :ring.length]
    resident = counts > 0
    slots = resident_slots(counts)
    S = ring.length
    feed = {"q": p.q, "k": p.k, "v": p.v, "past_key": np.ascontiguousarray(ring.buffers[0][:, :, :S]),
            "past_value": np.ascontiguousarray(ring.buffers[1][:, :, :S]), "slots": slots,
            "slot_bias": np.ascontiguousarray(ring.bias[0][:, :, :S])}
    pairs = int(Q * (resident.sum() + B * H * Q))
    return feed, {"pairs": pairs, "codes_ms": 0.0, "index_ms": float(np.median(seconds)) * 1e3,
                  "resident": float(resident.mean()), "counts": counts, "merges": ring.merges}


# ------------------------------------------------------------------------------------------------ recall
def _dense_probs(q: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Softmax of q [n, d] (scaled) over keys [m, d] in float64: [n, m]."""
    s = q.astype(np.float64) @ keys.astype(np.float64).T
    s -= s.max(1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(1, keepdims=True)
    return s


def _sampled(Q: int, exact: bool, seed: int) -> np.ndarray:
    return np.arange(Q) if exact else np.sort(np.random.default_rng(seed).choice(Q, min(Q, RECALL_QUERIES), False))


def annsa_recall(p: Problem, selected, exact: bool) -> float:
    """Mean over queries of the dense softmax mass on the keys AnnSA attends (the dense slots, the chunk, and the
    bucketed slots sharing a bucket in some table)."""
    dense, codes, qcodes, sparse = selected
    B, H, Q, _ = p.q.shape
    S = p.pk.shape[2]
    total, n = 0.0, 0
    is_dense = np.zeros(S, bool)
    is_dense[dense] = True
    is_sparse = np.zeros(S, bool)
    is_sparse[sparse] = True
    for b in range(B):
        for h in range(H):
            qi = _sampled(Q, exact, b * H + h)
            probs = _dense_probs(p.q[b, h, qi], np.concatenate([p.pk[b, h], p.k[b, h]]))
            share = ((codes[b, h][None] == qcodes[b, h, qi][:, None]).any(-1) & is_sparse[None])  # [n, S]
            keep = np.concatenate([share | is_dense[None], np.ones((qi.size, Q), bool)], 1)
            total += float((probs * keep).sum())
            n += qi.size
    return total / n


def tempcache_recall(p: Problem, shape: Shape, feed: dict, counts: np.ndarray, exact: bool) -> float:
    """Mean over queries of sum over tokens of min(p_dense(t), p_slot / count) (fastar/attention.py's recall): an
    aligned slot at frame f, position s with count c holds the tokens at s of frames f - c + 1 .. f."""
    B, H, Q, _ = p.q.shape
    T = shape.tokens
    S = counts.shape[-1]
    total, n = 0.0, 0
    for b in range(B):
        for h in range(H):
            qi = _sampled(Q, exact, b * H + h)
            pd = _dense_probs(p.q[b, h, qi], np.concatenate([p.pk[b, h], p.k[b, h]]))
            c = counts[b, h]
            live = np.flatnonzero(c > 0)
            keys = np.concatenate([feed["past_key"][b, h, live], p.k[b, h]])
            bias = np.concatenate([np.log(c[live]), np.zeros(Q)])
            s = p.q[b, h, qi].astype(np.float64) @ keys.astype(np.float64).T + bias
            s -= s.max(1, keepdims=True)
            ps = np.exp(s)
            ps /= ps.sum(1, keepdims=True)
            got = np.minimum(pd[:, S:], ps[:, live.size:]).sum()  # the chunk's own keys
            share = ps[:, :live.size] / c[live]
            for j in range(int(c.max(initial=0))):  # member j frames back of every slot with count > j
                has = c[live] > j
                member = live[has] - j * T
                got += np.minimum(pd[:, member], share[:, has]).sum()
            total += float(got)
            n += qi.size
    return total / n


def measure(shape: Shape, context: int, p: Problem, rounds: int, threads: int, sims: list[float],
            kinds: list[str]) -> list[dict]:
    from fastcar_compile.runtime.native import library_path

    lib = library_path()
    if lib is None:
        raise SystemExit("the native ai.fastcar kernels are not built here (a C++ compiler and ONNX Runtime's "
                         "headers are needed: python -m fastcar_compile.runtime.native.build)")
    from onnx import TensorProto

    from fastcar_compile.core import contract

    I64, F = TensorProto.INT64, TensorProto.FLOAT
    B, H, Q, _ = p.q.shape
    S = p.pk.shape[2]
    dense_pairs = B * H * Q * (S + Q)
    exact = shape.name == "dit"
    steps, notes = dense_variants(p, threads)
    modes: dict[str, dict] = {}
    annsa_sess = make_session(_node_model(contract.ANNSA_ATTENTION, [(n, I64 if n in (
        "dense", "query_codes", "key_codes", "sorted_codes", "sorted_slots") else F) for n in (
        "q", "k", "v", "past_key", "past_value", "dense", "query_codes", "key_codes", "sorted_codes", "sorted_slots")],
        contract.DOMAIN), threads, library=lib)
    slot_sess = make_session(_node_model(contract.SLOT_ATTENTION, [(n, I64 if n == "slots" else F) for n in (
        "q", "k", "v", "past_key", "past_value", "slots", "slot_bias")], contract.DOMAIN), threads, library=lib)
    for kind in kinds:
        feed, info = annsa_inputs(p, shape, context, kind)
        name = ANNSA_ROWS[kind]
        steps[name] = lambda feed=feed: annsa_sess.run(None, feed)
        info["recall"] = annsa_recall(p, info.pop("selected"), exact)
        modes[name] = info
    for sim in sims:
        feed, info = tempcache_inputs(p, shape, context, sim)
        name = f"TempCache SIM {sim:g}"
        steps[name] = lambda feed=feed: slot_sess.run(None, feed)
        info["recall"] = tempcache_recall(p, shape, feed, info.pop("counts"), exact)
        modes[name] = info
    cpu, wall = interleave_cpu_wall(steps, rounds)
    return table_rows(shape.name, context, S, Q, dense_pairs, cpu, wall, modes, notes)


def table_rows(shape: str, context: int, keys: int, queries: int, dense_pairs: int, cpu: dict, wall: dict,
               modes: dict[str, dict], notes: list[str]) -> list[dict]:
    """One row per variant timed (cpu / wall ms per name): the dense ones against the fastest of them, the modes
    (`modes`: name -> executed pairs, recall, index costs) with their density, pair cost and bound."""
    dense_names = [n for n in cpu if n not in modes]
    fastest = min(dense_names, key=lambda n: cpu[n])
    base = {"shape": shape, "context_frames": context, "keys": keys, "queries": queries, "ms_dense": cpu[fastest],
            "dense_variant": fastest, "wall_ms_dense": wall[fastest], "notes": notes}
    rows = [{**base, "mode": "dense", "variant": n, "density": 1.0, "recall": 1.0, "ms": cpu[n], "wall_ms": wall[n],
             "pair_cost": cpu[n] / cpu[fastest], "speedup": cpu[fastest] / cpu[n], "bound": 1.0}
            for n in dense_names]
    for name, info in modes.items():
        density = info["pairs"] / dense_pairs
        ms = cpu[name]
        with_index = ms + info["codes_ms"] + info["index_ms"] / STEPS_PER_CHUNK
        row = {**base, "mode": name, "variant": name, "density": density, "recall": info["recall"], "ms": ms,
               "wall_ms": wall[name], "pair_cost": ms / (cpu[fastest] * density), "speedup": cpu[fastest] / ms,
               "bound": 1.0 / density, "codes_ms": info["codes_ms"], "index_ms": info["index_ms"],
               "speedup_with_index": cpu[fastest] / with_index}
        if "resident" in info:
            row["resident"] = info["resident"]
        rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="dit", help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--contexts", default="16,64", help="cached frames, comma-separated (per shape: shape:C,C;...)")
    ap.add_argument("--layer", type=int, default=3, help="the DiT layer whose attention the `dit` shape times (default the "
                    "last; block 1's keys are bias-dominated: at SIM 0.9 nearly every key merges)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sims", default="0.9,0.95", help="TempCache similarity thresholds")
    ap.add_argument("--annsa", default="lsh,int8", help="AnnSA bucketings")
    ap.add_argument("--capture-frames", type=int, default=CAPTURED_FRAMES,
                    help=f"frames of the DiT rollout recorded (cached once; default {CAPTURED_FRAMES})")
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    if a.threads != 1:
        raise SystemExit("--threads: the timings read the calling thread's CPU time, which is one thread's")
    import torch

    torch.set_num_threads(a.threads)
    shapes = [s for s in a.shapes.split(",") if s]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        raise SystemExit(f"--shapes {unknown[0]!r}: one of {', '.join(SHAPES)}")
    per_shape = dict(x.split(":") for x in a.contexts.split(";")) if ":" in a.contexts else {}
    contexts = {s: [int(c) for c in per_shape.get(s, a.contexts if not per_shape else "").split(",") if c]
                for s in shapes}
    need = max((c + SHAPES[s].chunk for s in shapes if s != "token" for c in contexts[s]), default=0)
    cap = capture_dit(max(a.capture_frames, need + need % 2), a.cache) if need else None
    tokens = capture_tokens(a.cache) if "token" in shapes else None
    sims, kinds = [float(x) for x in a.sims.split(",") if x], [k for k in a.annsa.split(",") if k]
    if any(k not in ANNSA_ROWS for k in kinds):
        raise SystemExit(f"--annsa {a.annsa!r}: a comma-separated list of {', '.join(ANNSA_ROWS)}")
    rows = []
    for s in shapes:
        shape = SHAPES[s]
        for context in contexts[s]:
            t0 = time.perf_counter()
            if s == "token":
                from attention_decode import measure_tokens

                from fastcar_compile.runtime.native import library_path

                got = measure_tokens(tokens, context, a.rounds, a.threads, sims, kinds, library_path(), table_rows)
            else:
                p = dit_problem(cap, a.layer, context) if s == "dit" else wan_problem(cap, shape, context)
                rounds = a.rounds if s == "dit" else min(a.rounds, WAN_ROUNDS)
                got = measure(shape, context, p, rounds, a.threads, sims, kinds)
            for r in got:
                print(f"{s:4s} C={context:4d} {r['variant']:32s} density {r['density']:6.1%} recall {r['recall']:6.1%} "
                      f"{r['ms']:10.2f} ms  x{r['speedup']:5.2f} (bound {r['bound']:5.2f}, pair {r['pair_cost']:.2f})",
                      flush=True)
            print(f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
            rows += got
    return save_results(a.out, {"title": "one attention layer: dense vs AnnSA / TempCache at their density",
                                "threads": a.threads, "layer": a.layer, "rounds": a.rounds,
                                "shapes": {s: SHAPES[s].about for s in shapes}, "rows": rows})


if __name__ == "__main__":
    sys.exit(main())
