"""Functional simulator: executes a bundle program on numbers (float64), one decode step at a time.

It interprets every instruction the way the hardware would (tile by tile, row mask by row mask, through the
static or the DRS dispatcher), so its output checks the compiler's lowering (tiling, buffer wiring, KV and
replay-cache addressing, TAS and the dispatch of replayed rows) against an independent NumPy decoder.
Sizes: tiny models only (Python loop over rows and instructions).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fastcar_compile.core.errors import FastCarError

from . import isa
from .encode import Program
from .modelspec import ModelSpec, split_source
from .schedule import drs_masks, static_masks

B = isa.BUF


def random_weights(program: Program, seed: int = 0, scale: float = 1.0) -> dict[int, np.ndarray]:
    """Weights for every tensor of the program's table: matrices ~ N(0, 1/in) * scale, norms ~ 1 + N(0, 0.1)."""
    rng = np.random.default_rng(seed)
    out = {}
    for t in program.meta["tensors"]:
        shape = tuple(t["shape"])
        if len(shape) == 1:
            out[t["id"]] = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            out[t["id"]] = rng.standard_normal(shape) * scale / np.sqrt(shape[0])
    return out


def weights_from_onnx(program: Program, path: str) -> tuple[dict[int, np.ndarray], np.ndarray | None]:
    """Weights of the program's tensor table read from the ONNX model it was compiled from (by the
    initializer names the partitioner recorded), plus the embedding table (Gather [vocab, hidden]) if any."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path))
    inits = {t.name: t for t in model.graph.initializer}
    out, missing = {}, []
    for t in program.meta["tensors"]:
        src = t.get("source")
        name, cols = split_source(src) if src else (None, None)
        if name not in inits:
            missing.append(t["name"])
            continue
        arr = numpy_helper.to_array(inits[name]).astype(np.float64)
        arr = arr[:, cols] if cols is not None else arr
        if list(arr.shape) != list(t["shape"]):
            raise FastCarError(f"weight {t['name']} ({src}) has shape {list(arr.shape)}, expected {t['shape']}")
        out[t["id"]] = arr
    if missing:
        raise FastCarError(f"cannot find the ONNX initializers of {missing}; functional mode needs every weight")
    spec = ModelSpec.from_dict(program.meta["model"])
    emb = None
    for node in model.graph.node:
        if node.op_type == "Gather" and node.input and node.input[0] in inits:
            arr = numpy_helper.to_array(inits[node.input[0]])
            if arr.shape == (spec.vocab, spec.hidden):
                emb = arr.astype(np.float64)
    return out, emb


def rope(v: np.ndarray, heads: int, pos: int, theta: float) -> np.ndarray:
    d = v.size // heads
    x = v.reshape(heads, d)
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    ang = np.concatenate([pos * inv, pos * inv])
    rot = np.concatenate([-x[:, d // 2 :], x[:, : d // 2]], axis=1)
    return (x * np.cos(ang) + rot * np.sin(ang)).reshape(-1)


class FunctionalSim:
    """State (KV cache, replay cache, ages) for ``batch`` rows of one video; ``step`` runs one token per row."""

    def __init__(self, program: Program, weights: dict[int, np.ndarray], max_context: int,
                 policy: str = "static") -> None:
        self.p = program
        if not {"model", "batch", "binding_masks", "tensors"} <= set(program.meta):
            raise FastCarError("functional mode needs a program made by the FPGA compiler (model, batch, tensors)")
        self.spec = ModelSpec.from_dict(program.meta["model"])
        self.batch = int(program.meta["batch"])
        self.binding = np.asarray(program.meta["binding_masks"], np.uint32)
        self.policy = policy
        missing = [t["name"] for t in program.meta["tensors"] if t["id"] not in weights]
        if missing:
            raise FastCarError(f"functional simulation lacks weights for {missing[:5]}")
        self.w = weights
        s, b = self.spec, self.batch
        self.max_context = max_context
        self.kc = np.zeros((s.layers, b, max_context, s.kv_dim))
        self.vc = np.zeros((s.layers, b, max_context, s.kv_dim))
        frame = s.frame_tokens or 1  # a dense program has no replay cache to address
        self.cache = np.zeros((s.layers, b, frame, s.hidden))
        self.age = -np.ones((s.layers, b, frame), np.int64)

    def step(self, x: np.ndarray, pos: int) -> dict[str, Any]:
        """Run the program for the token at KV index ``pos`` with input embeddings x (batch, hidden)."""
        s, nb, C = self.spec, self.batch, self.p.cores
        if pos >= self.max_context:
            raise FastCarError(f"position {pos} beyond max_context {self.max_context}")
        ctx = pos + 1
        widths = {"x": s.hidden, "xn": s.hidden, "q": s.q_dim, "k": s.kv_dim, "v": s.kv_dim,
                  "scores": s.heads * ctx, "attn": s.q_dim, "o": s.hidden, "gate": s.intermediate,
                  "up": s.intermediate, "h": s.intermediate, "mlp": s.hidden, "merged": s.hidden,
                  "logits": s.vocab}
        buf = {B[k]: np.zeros((nb, w)) for k, w in widths.items()}
        all_rows = (1 << nb) - 1
        index = {layer: all_rows for layer in range(s.layers)}
        latched = dict(index)
        masks: dict[int, np.ndarray] = {}
        replay = np.zeros((s.layers, nb), bool)
        tas = np.full((s.layers, nb), np.nan)
        g = s.heads // s.kv_heads
        hd = s.head_dim
        for bundle in self.p.bundles:
            ctl = bundle[C]
            cop = int(ctl["opcode"])
            if cop == isa.Op.DRS_SET:  # from the TAS unit, or an immediate Index Register value (tests, forcing)
                layer = int(ctl["layer"])
                latched[layer] = index[layer] if int(ctl["flags"]) & isa.Flag.FROM_TAS else int(ctl["arg"]) & all_rows
            elif cop == isa.Op.DRS_DISPATCH:
                layer = int(ctl["layer"])
                idx = latched[layer]
                masks[layer] = drs_masks(idx, nb, C) if self.policy == "drs" else static_masks(idx, self.binding)
            for c in range(C):
                ins = bundle[c]
                op = int(ins["opcode"])
                if op == isa.Op.NOP:
                    continue
                flags, sub, layer = int(ins["flags"]), int(ins["sub"]), int(ins["layer"])
                if flags & isa.Flag.SKIP_ON_REPLAY:
                    if layer not in masks:
                        raise FastCarError(f"replayable instruction of layer {layer} before its DRS_DISPATCH")
                    rowmask = int(masks[layer][c])
                else:
                    rowmask = int(ins["arg"]) & all_rows
                m, k, n = int(ins["m"]), int(ins["k"]), max(1, int(ins["n"]))
                if flags & isa.Flag.CTX:
                    m = ctx
                om, ok = int(ins["off_m"]), int(ins["off_k"])
                dst, src, ten = int(ins["dst"]), int(ins["src"]), int(ins["tensor"])
                for r in range(nb):
                    if not rowmask >> r & 1:
                        continue
                    if op == isa.Op.LOAD and sub == isa.Space.ACT:
                        buf[dst][r, :m] = x[r, :m]
                    elif op == isa.Op.VEC:
                        self._vec(sub, buf, r, src, dst, ten, m, n, pos)
                    elif op == isa.Op.GEMM and sub == isa.Space.WEIGHT:
                        y = buf[src][r, ok : ok + k] @ self.w[ten][ok : ok + k, om : om + m]
                        if ok == 0:
                            buf[dst][r, om : om + m] = y
                        else:
                            buf[dst][r, om : om + m] += y
                    elif op == isa.Op.STORE and sub == isa.Space.ACT:
                        pass  # logits leave for the host; the buffer keeps them for the caller
                    elif op == isa.Op.STORE and sub in (isa.Space.KV_K, isa.Space.KV_V):
                        cache = self.kc if sub == isa.Space.KV_K else self.vc
                        cache[layer, r, pos] = buf[src][r, :m]
                    elif op == isa.Op.GEMM and sub == isa.Space.KV_K:
                        q = buf[src][r, : s.q_dim].reshape(s.heads, hd)
                        kk = self.kc[layer, r, :m].reshape(m, s.kv_heads, hd)
                        sc = np.einsum("hd,thd->ht", q, kk[:, np.arange(s.heads) // g, :]) / np.sqrt(hd)
                        buf[dst][r, : s.heads * m] = sc.reshape(-1)
                    elif op == isa.Op.GEMM and sub == isa.Space.KV_V:
                        pr = buf[src][r, : s.heads * m].reshape(s.heads, m)
                        vv = self.vc[layer, r, :m].reshape(m, s.kv_heads, hd)
                        buf[dst][r, : s.q_dim] = np.einsum("ht,thd->hd", pr, vv[:, np.arange(s.heads) // g, :]).reshape(-1)
                    elif op == isa.Op.TAS:
                        frame, vstart = k, int(ins["off_k"])
                        tau = isa.tau_from_bits(int(ins["off_m"]))
                        aligned = pos - frame
                        slot = (pos - vstart) % frame
                        if aligned >= vstart:
                            q = buf[src][r, : s.q_dim].reshape(s.heads, hd)
                            ka = self.kc[layer, r, aligned].reshape(s.kv_heads, hd)[np.arange(s.heads) // g]
                            tas[layer, r] = float(np.mean(np.sum(q * ka, axis=1)) / np.sqrt(hd))
                            if self.age[layer, r, slot] >= 0 and tas[layer, r] > tau:
                                index[layer] &= ~(1 << r)
                    elif op == isa.Op.XCHG:
                        frame, vstart = k, int(ins["off_k"])
                        if pos < vstart:
                            continue
                        slot = (pos - vstart) % frame
                        replay[layer, r] = not latched[layer] >> r & 1  # the Index Register decides
                        if replay[layer, r]:
                            buf[dst][r, :m] = self.cache[layer, r, slot]
                            self.age[layer, r, slot] += 1
                        else:
                            self.cache[layer, r, slot] = buf[src][r, :m]
                            buf[dst][r, :m] = buf[src][r, :m]
                            self.age[layer, r, slot] = 0
                    else:
                        raise FastCarError(f"functional mode cannot execute {isa.Op(op).name} sub {sub}")
        return {"logits": buf[B["logits"]].copy(), "hidden": buf[B["x"]].copy(), "replay": replay, "tas": tas}

    def _vec(self, sub: int, buf: dict[int, np.ndarray], r: int, src: int, dst: int, ten: int, m: int, n: int,
             pos: int) -> None:
        """The vector unit on row r: buffer src (and ten, a weight or second operand) -> buffer dst."""
        s, v = self.spec, buf[src][r]
        if sub == isa.Vec.RMSNORM:  # n groups of m / n (per-head q/k norm), one scale
            vv = v[:m].reshape(n, m // n)
            norm = np.sqrt(np.mean(vv * vv, axis=1, keepdims=True) + s.rms_eps)
            buf[dst][r, :m] = (vv / norm * self.w[ten]).reshape(-1)
        elif sub == isa.Vec.ROPE:
            buf[dst][r, :m] = rope(v[:m], n, pos, s.rope_theta)
        elif sub == isa.Vec.SOFTMAX:
            sc = v[: n * m].reshape(n, m)
            e = np.exp(sc - sc.max(axis=1, keepdims=True))
            buf[dst][r, : n * m] = (e / e.sum(axis=1, keepdims=True)).reshape(-1)
        elif sub == isa.Vec.SILU_MUL:
            a = v[:m]
            buf[dst][r, :m] = a / (1.0 + np.exp(-a)) * buf[ten][r, :m]
        elif sub == isa.Vec.ADD:
            buf[dst][r, :m] = v[:m] + buf[ten][r, :m]
