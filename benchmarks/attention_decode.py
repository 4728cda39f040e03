"""The token decoders' attention at its density, for bench_attention.py's `token` shape: one decode step (one new
token) of one layer over a KV cache of C frames, at the token world model's shape (4 heads x 64, 65-token frames:
an action token, then 8 x 8 frame tokens), through ai.fastcar CompressedAttention as a compiled decoder runs it
(past and present bound to one buffer, 1 intra-op thread).

Keys and queries: the bundled long-video decoder's own q/k/v teacher-forced on a real clip (attention_data.
capture_tokens: 4 heads x 32, 64-token frames), tiled to the shape: head h = two heads of layer 2 + h // 2 side by
side, a frame's action token a copy of its first token, frame f the clip's frame f mod 64; RoPE applied to each
half at the token's position, as the decoder would.

Variants: dense = CompressedAttention's plain mode (the native dense core over a preallocated buffer), ONNX
Runtime's com.microsoft GroupQueryAttention (a shared past/present buffer, as onnxruntime-genai runs it) and
MultiHeadAttention, PyTorch SDPA; AnnSA (sign LSH 4 bits x 2 tables, int8 2 directions x 2 tables; the first
frame as sinks and the last frame as the window always kept) and TempCache (aligned, merging token p into the slot
of token p - 65) in CompressedAttention's compressed mode with a budget holding every token. The compressed modes'
caches are built by running the op over the C frames (a frame per call) before timing; every timed call decodes the
next token. Density and recall come from the op's own slot records after that prefill (the slots' stored bucket
ids and counts, the queries' ids by the NumPy hasher): the selection the kernel makes, and for merged slots each
member's min(dense, slot / count).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from attention_data import ANNSA_ROWS, TokenCapture

HEADS, HEAD_DIM, FRAME = 4, 64, 65
SINKS = WINDOW = FRAME  # the first frame and the last frame are always attended (AnnSA)
DECODE_QUERIES = 16  # decode positions whose queries density and recall average over


def world_tensors(cap: TokenCapture, n: int) -> dict[str, np.ndarray]:
    """Tokens 0..n-1 at the world model's shape: q, k (post-RoPE), k_raw (pre-RoPE), v, each [1, 4, n, 64]."""
    from fastcar_compile.fastar.rope import apply_rope

    t = np.arange(n)
    f, j = t // FRAME, t % FRAME
    src = (f % (cap.k.shape[1] // cap.frame_tokens)) * cap.frame_tokens + np.maximum(j - 1, 0)
    out = {name: np.empty((1, HEADS, n, HEAD_DIM), np.float32) for name in ("q", "k", "k_raw", "v")}
    half = cap.k.shape[-1]
    for h in range(HEADS):
        layer, pair = 2 + h // 2, (2 * (h % 2), 2 * (h % 2) + 1)
        for name, x in (("q", cap.q), ("k_raw", cap.k), ("v", cap.v)):
            out[name][0, h] = np.concatenate([x[layer, src, c] for c in pair], -1)
        for name, raw in (("q", "q"), ("k", "k_raw")):
            pre = out[raw][0, h] if name == "k" else out["q"][0, h].copy()
            out[name][0, h] = np.concatenate([apply_rope(pre[:, i * half:(i + 1) * half], t, cap.rope_theta)
                                              for i in range(2)], -1)
    return out


def _compressed_model(n_in: int, n_out: int, **attrs) -> bytes:
    from onnx import TensorProto, helper

    from fastcar_compile.core import contract
    from fastcar_compile.passes import fastcar_ops

    names = ["q", "k", "v", "past_key", "past_value", "attention_mask", "total_len", "past_slots", "k_raw",
             "past_key_raw"][:n_in]
    types = {"attention_mask": TensorProto.INT64, "total_len": TensorProto.INT32}
    ins = [helper.make_tensor_value_info(n, types.get(n, TensorProto.FLOAT), None) for n in names]
    onames = ["out", "present_key", "present_value", "present_slots", "aligned_key", "present_key_raw"][:n_out]
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in onames]
    node = helper.make_node(contract.COMPRESSED_ATTENTION, names, onames, domain=contract.DOMAIN,
                            num_heads=HEADS, kv_num_heads=HEADS, scale=float(HEAD_DIM ** -0.5), **attrs)
    model = helper.make_model(helper.make_graph([node], "g", ins, outs), ir_version=10,
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(contract.DOMAIN, 1)],
                              functions=[fastcar_ops.function_proto(contract.COMPRESSED_ATTENTION, 17)])
    return model.SerializeToString()


@dataclass
class Decoder:
    """One CompressedAttention variant with its cache buffers, decoding tokens from `at` on."""

    sess: object
    state: dict  # name -> OrtValue bound as past_X and present_X
    merges: bool
    width: int  # slot record floats (0: plain mode)
    at: int = 0
    ready: list = field(default_factory=list)  # prepared bindings of the next single-token steps

    def binding(self, x: dict[str, np.ndarray], p: int, n: int):
        """The IO binding writing tokens p..p+n-1 (x: world_tensors) and attending with their queries."""
        io = self.sess.io_binding()
        feeds = {"q": x["q"][:, :, p:p + n], "k": x["k"][:, :, p:p + n], "v": x["v"][:, :, p:p + n],
                 "attention_mask": np.ones((1, p + n), np.int64), "total_len": np.array(p + n, np.int32)}
        if self.merges:
            feeds["k_raw"] = x["k_raw"][:, :, p:p + n]
        for key, a in feeds.items():
            io.bind_cpu_input(key, np.ascontiguousarray(a))
        for key, ov in self.state.items():
            io.bind_ortvalue_input("past_" + key, ov)
            io.bind_ortvalue_output("present_" + key, ov)
        io.bind_output("out")
        if self.width:
            io.bind_output("aligned_key")
        io.keep = feeds  # the bound arrays live as long as the binding
        return io

    def step(self, x: dict[str, np.ndarray], n: int = 1) -> None:
        """Decode the next n tokens (a prepared binding when one is there: no Python work in a timed step)."""
        io = self.ready.pop(0) if self.ready and n == 1 else self.binding(x, self.at, n)
        self.sess.run_with_iobinding(io)
        self.at += n

    def prepare(self, x: dict[str, np.ndarray], steps: int) -> None:
        self.ready = [self.binding(x, self.at + i, 1) for i in range(steps)]

    def slots(self) -> np.ndarray:
        return self.state["slots"].numpy()


def decoder(cfg, capacity: int, threads: int, lib) -> Decoder:
    """CompressedAttention with `cfg` (a fastar.KVCompressConfig; None: the plain mode over a preallocated buffer
    of `capacity` tokens), its buffers zero."""
    import onnxruntime as ort
    from _common import make_session

    from fastcar_compile.passes.fused_attention import compressed_attributes, slot_width

    if cfg is None:
        sess = make_session(_compressed_model(7, 3), threads, library=lib)
        names, width, merges = ("key", "value"), 0, False
    else:
        merges = cfg.tempcache_sim is not None
        attrs = compressed_attributes(cfg, HEAD_DIM)
        sess = make_session(_compressed_model(10 if merges else 8, 6 if merges else 5, **attrs), threads, library=lib)
        width = slot_width(cfg)
        names = ("key", "value", "slots") + (("key_raw",) if merges else ())
    state = {n: ort.OrtValue.ortvalue_from_numpy(np.zeros((1, HEADS, capacity, width if n == "slots" else HEAD_DIM),
                                                          np.float32)) for n in names}
    return Decoder(sess, state, merges, width)


def dense_baselines(x: dict[str, np.ndarray], n: int, threads: int) -> dict[str, callable]:
    """ORT's GroupQueryAttention (shared buffer, decoding token n) and MultiHeadAttention, and PyTorch SDPA, each
    over the first n tokens' keys and the new one."""
    import onnxruntime as ort
    import torch
    from _common import make_session
    from onnx import TensorProto, helper

    F, I32 = TensorProto.FLOAT, TensorProto.INT32
    q1 = np.ascontiguousarray(x["q"][:, :, n:n + 1])
    flat = lambda a: np.ascontiguousarray(a.transpose(0, 2, 1, 3).reshape(1, a.shape[2], -1))  # noqa: E731
    out: dict[str, callable] = {}
    tq, tk, tv = (torch.from_numpy(np.ascontiguousarray(a)) for a in (q1, x["k"][:, :, :n + 1], x["v"][:, :, :n + 1]))
    out["torch sdpa"] = lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv)
    names = ["query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length"]
    node = helper.make_node("GroupQueryAttention", names, ["output", "present_key", "present_value"],
                            domain="com.microsoft", num_heads=HEADS, kv_num_heads=HEADS, scale=float(HEAD_DIM ** -0.5))
    ins = [helper.make_tensor_value_info(nm, I32 if nm in ("seqlens_k", "total_sequence_length") else F, None)
           for nm in names]
    outs = [helper.make_tensor_value_info(nm, F, None) for nm in ("output", "present_key", "present_value")]
    gqa = make_session(helper.make_model(helper.make_graph([node], "gqa", ins, outs), ir_version=10, opset_imports=[
        helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]).SerializeToString(), threads)
    buf = [ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(
        np.concatenate([x[name][:, :, :n + 1], np.zeros((1, HEADS, 1, HEAD_DIM), np.float32)], 2)))
           for name in ("k", "v")]
    io = gqa.io_binding()
    for name, a in (("query", flat(q1)), ("key", flat(x["k"][:, :, n:n + 1])), ("value", flat(x["v"][:, :, n:n + 1])),
                    ("seqlens_k", np.array([n], np.int32)), ("total_sequence_length", np.array(n + 1, np.int32))):
        io.bind_cpu_input(name, a)
    for name, ov in zip(("key", "value"), buf, strict=True):
        io.bind_ortvalue_input("past_" + name, ov)
        io.bind_ortvalue_output("present_" + name, ov)
    io.bind_output("output")
    out["ort GroupQueryAttention"] = lambda: gqa.run_with_iobinding(io)
    out["ort GroupQueryAttention"].keep = (gqa, io, buf)
    mnode = helper.make_node("MultiHeadAttention", ["q", "k", "v"], ["out"], domain="com.microsoft", num_heads=HEADS)
    mha = make_session(helper.make_model(helper.make_graph(
        [mnode], "mha", [helper.make_tensor_value_info(nm, F, None) for nm in ("q", "k", "v")],
        [helper.make_tensor_value_info("out", F, None)]), ir_version=10, opset_imports=[
        helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]).SerializeToString(), threads)
    mfeed = {"q": flat(x["q"][:, :, n:n + 1]) * np.float32(1.0), "k": np.ascontiguousarray(x["k"][:, :, :n + 1]),
             "v": np.ascontiguousarray(x["v"][:, :, :n + 1])}
    out["ort MultiHeadAttention"] = lambda: mha.run(None, mfeed)
    return out


def _probs(q: np.ndarray, keys: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    s = keys.astype(np.float64) @ q.astype(np.float64) * HEAD_DIM ** -0.5
    if bias is not None:
        s = s + bias
    s = np.exp(s - s.max())
    return s / s.sum()


def density_recall(x: dict[str, np.ndarray], slots: np.ndarray, cfg, n: int) -> tuple[float, float]:
    """Mean over DECODE_QUERIES decode positions p = n.. (the cache as the prefill left it, plus the new token) of
    executed / dense pairs and of the recall (fastar/attention.py): the slots the kernel selects from its records."""
    from fastcar_compile.fastar.cache import hasher

    h = hasher(cfg, HEAD_DIM) if cfg.sparse_tables else None
    tables = cfg.sparse_tables
    pairs = dense = 0
    recall = []
    for hd in range(HEADS):
        rec = slots[0, hd]
        live = np.flatnonzero(rec[:, 0] > 0)
        pos, count = rec[live, 0].astype(np.int64) - 1, rec[live, 1].astype(np.int64)
        codes = rec[live, 3:3 + tables].astype(np.int64)
        for p in range(n, n + DECODE_QUERIES):
            q = x["q"][0, hd, p]
            keep = np.ones(pos.size, bool)  # without AnnSA every live slot
            if h is not None:
                keep = (pos < SINKS) | (pos > p - WINDOW) | (codes == h.codes(q.astype(np.float64))).any(-1)
            sel = np.flatnonzero(keep)
            keys = np.concatenate([x["k"][0, hd, pos[sel]], x["k"][0, hd, p:p + 1]])
            slot_p = _probs(q, keys, np.append(np.log(count[sel]), 0.0))
            dense_p = _probs(q, np.concatenate([x["k"][0, hd, :n], x["k"][0, hd, p:p + 1]]))
            got = min(dense_p[-1], slot_p[-1])
            for a, s in enumerate(sel):  # an aligned slot's members: its latest position, then 65 back each
                members = pos[s] - FRAME * np.arange(count[s])
                got += np.minimum(dense_p[members[members >= 0]], slot_p[a] / count[s]).sum()
            recall.append(got)
            pairs += sel.size + 1
            dense += n + 1
    return pairs / dense, float(np.mean(recall))


BLOCK = 20  # decode steps per variant per round (a step is well under a millisecond)


def measure_tokens(cap: TokenCapture, context: int, rounds: int, threads: int, sims: list[float],
                   kinds: list[str], lib, table_rows) -> list[dict]:
    """The `token` shape's rows at C = `context` frames (table_rows: bench_attention's row builder)."""
    import time

    from _common import interleave_cpu_wall

    from fastcar_compile.fastar.config import KVCompressConfig

    n = context * FRAME
    decoded = (rounds * BLOCK + 1) + DECODE_QUERIES
    x = world_tensors(cap, n + decoded)
    capacity = n + decoded
    steps = dense_baselines(x, n, threads)
    plain = decoder(None, capacity, threads, lib)
    for name, src in (("key", "k"), ("value", "v")):  # the plain mode's buffer holds the n tokens (no records)
        plain.state[name].numpy()[:, :, :n] = x[src][:, :, :n]
    plain.at = n
    plain.prepare(x, decoded - DECODE_QUERIES)
    steps["fastcar CompressedAttention (dense core)"] = lambda: plain.step(x)
    common = {"budget": capacity, "sinks": SINKS, "window": WINDOW, "frame_tokens": FRAME, "video_start": 0}
    configs = {ANNSA_ROWS[k]:
               KVCompressConfig(**common, **({"lsh_bits": 4, "lsh_tables": 2} if k == "lsh" else
                                             {"int8_dirs": 2, "int8_tables": 2})) for k in kinds}
    configs.update({f"TempCache SIM {s:g}": KVCompressConfig(**common, tempcache_sim=s) for s in sims})
    modes: dict[str, dict] = {}
    for name, cfg in configs.items():
        d = decoder(cfg, capacity, threads, lib)
        t0 = time.thread_time()
        for _ in range(context):
            d.step(x, FRAME)
        prefill = time.thread_time() - t0
        density, recall = density_recall(x, d.slots(), cfg, n)
        resident = float((d.slots()[..., 0] > 0).mean() * capacity / n)
        d.prepare(x, decoded - DECODE_QUERIES)
        steps[name] = lambda d=d: d.step(x)
        # pairs as a share of the dense ones (table_rows is given 1 dense pair); the index lives in the op
        modes[name] = {"pairs": density, "recall": recall, "codes_ms": 0.0, "index_ms": 0.0, "prefill_s": prefill, **({"resident": resident} if cfg.tempcache_sim is not None else {})}
    cpu, wall = interleave_cpu_wall(steps, rounds, BLOCK)
    rows = table_rows("token", context, n, 1, 1, cpu, wall, modes, [])
    for r in rows:
        if r["mode"] in modes:
            r["prefill_s"] = modes[r["mode"]]["prefill_s"]
    return rows
