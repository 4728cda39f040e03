"""ai.fastcar AnnSAAttention (runtime/native/annsa_attention.h, and its function body in passes/fastcar_ops.py)
against a NumPy brute force written from its definition: per query, the selected cache slots (the dense
positions, and every bucketed slot whose id equals the query's in at least one table, once), the chunk's keys,
one softmax, times the values."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from ort_driver import make_session

from fastcar_compile.core import contract
from fastcar_compile.passes.fastcar_ops import function_proto

NAMES = ("q", "k", "v", "past_key", "past_value", "dense", "query_codes", "key_codes", "sorted_codes",
         "sorted_slots")


def _model() -> onnx.ModelProto:
    node = helper.make_node(contract.ANNSA_ATTENTION, list(NAMES), ["out"], domain=contract.DOMAIN)
    ints = {"dense", "query_codes", "key_codes", "sorted_codes", "sorted_slots"}
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT64 if n in ints else TensorProto.FLOAT, None)
              for n in NAMES]
    graph = helper.make_graph([node], "annsa", inputs, [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid(contract.DOMAIN, 1)], ir_version=10)
    model.functions.append(function_proto(contract.ANNSA_ATTENTION, 17))
    return model


def _session(native: bool) -> ort.InferenceSession:
    return make_session(_model().SerializeToString(), native=native)


def _case(seed: int, B=2, H=3, Q=5, D=16, S=40, T=3, codes=4) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    f = {n: rng.standard_normal(s).astype(np.float32) for n, s in
         (("q", (B, H, Q, D)), ("k", (B, H, Q, D)), ("v", (B, H, Q, D)), ("past_key", (B, H, S, D)),
          ("past_value", (B, H, S, D)))}
    perm = rng.permutation(S)
    dense, sparse = np.sort(perm[:8]), np.sort(perm[8:S - 6])  # the last 6 positions: empty (never attended)
    key_codes = np.full((B, H, S, T), -1, np.int64)
    key_codes[:, :, sparse] = rng.integers(0, codes, (B, H, sparse.size, T))
    sel = key_codes[:, :, sparse].transpose(0, 1, 3, 2)  # [B, H, T, N]
    order = np.argsort(sel, axis=-1, kind="stable")
    f.update(dense=dense.astype(np.int64), query_codes=rng.integers(0, codes, (B, H, Q, T)), key_codes=key_codes,
             sorted_codes=np.take_along_axis(sel, order, -1), sorted_slots=sparse[order].astype(np.int64))
    return f


def _brute(f: dict[str, np.ndarray]) -> np.ndarray:
    B, H, Q, D = f["q"].shape
    out = np.zeros((B, H, Q, D), np.float64)
    sparse = set(f["sorted_slots"][0, 0, 0].tolist())
    for b in range(B):
        for h in range(H):
            for i in range(Q):
                qc = f["query_codes"][b, h, i]
                chosen = [p for p in range(f["past_key"].shape[2]) if p in set(f["dense"].tolist()) or
                          (p in sparse and any(f["key_codes"][b, h, p, t] == qc[t] for t in range(qc.size)))]
                keys = np.concatenate([f["past_key"][b, h, chosen], f["k"][b, h]]).astype(np.float64)
                vals = np.concatenate([f["past_value"][b, h, chosen], f["v"][b, h]]).astype(np.float64)
                s = keys @ f["q"][b, h, i].astype(np.float64)
                w = np.exp(s - s.max())
                out[b, h, i] = (w / w.sum()) @ vals
    return out


@pytest.mark.parametrize("native", [True, False], ids=["native", "function-body"])
@pytest.mark.parametrize("seed,T,codes", [(0, 1, 4), (1, 3, 4), (2, 2, 16), (3, 4, 2)])
def test_annsa_attention_matches_brute_force(native: bool, seed: int, T: int, codes: int):
    f = _case(seed, T=T, codes=codes)
    got = _session(native).run(None, f)[0]
    np.testing.assert_allclose(got, _brute(f), rtol=1e-4, atol=1e-5)


def _brute_vectorised(f: dict[str, np.ndarray]) -> np.ndarray:
    """The same definition as _brute, one (row, head) at a time: the selection as a boolean [Q, S] mask."""
    B, H, Q, D = f["q"].shape
    S = f["past_key"].shape[2]
    out = np.zeros((B, H, Q, D), np.float64)
    dense = np.zeros(S, bool)
    dense[f["dense"]] = True
    for b in range(B):
        for h in range(H):
            kc, qc = f["key_codes"][b, h], f["query_codes"][b, h]  # [S, T], [Q, T]
            shared = ((kc[None] == qc[:, None]) & (kc[None] >= 0)).any(-1)  # [Q, S]
            sel = shared | dense[None]
            q = f["q"][b, h].astype(np.float64)
            past = np.where(sel, q @ f["past_key"][b, h].astype(np.float64).T, -np.inf)
            logits = np.concatenate([past, q @ f["k"][b, h].astype(np.float64).T], 1)
            w = np.exp(logits - logits.max(1, keepdims=True))
            vals = np.concatenate([f["past_value"][b, h], f["v"][b, h]]).astype(np.float64)
            out[b, h] = (w / w.sum(1, keepdims=True)) @ vals
    return out


@pytest.mark.parametrize("seed,Q,D,T,codes", [(10, 70, 20, 3, 3), (11, 9, 37, 2, 5), (12, 133, 64, 1, 2),
                                              (13, 40, 8, 4, 8), (14, 37, 31, 2, 3)])
def test_annsa_attention_blocks_at_kernel_sizes(seed: int, Q: int, D: int, T: int, codes: int):
    """Sizes that exercise the kernel's blocking: query groups of 32, 16 and 8 lanes and their tails, thousands of
    keys (several key tiles and L2 chunks per block), head sizes off the register blocking, skewed buckets (a few
    ids, so each bucket holds hundreds of slots and dozens of queries), up to 4 tables (pairs met in an earlier
    table masked), and group buffers of odd sizes (Q 37, D 31: an 8-lane tail after 16-lane groups)."""
    f = _case(seed, B=1, H=2, Q=Q, D=D, S=3000, T=T, codes=codes)
    np.testing.assert_allclose(_session(True).run(None, f)[0], _brute_vectorised(f), rtol=1e-4, atol=1e-5)


def test_annsa_attention_without_bucketed_slots():
    """No slot in any bucket (N = 0): dense positions and the chunk only."""
    f = _case(4)
    f["key_codes"][:] = -1
    f["sorted_codes"] = f["sorted_codes"][..., :0]
    f["sorted_slots"] = f["sorted_slots"][..., :0]
    for native in (True, False):
        np.testing.assert_allclose(_session(native).run(None, f)[0], _brute(f), rtol=1e-4, atol=1e-5)


def test_native_kernel_refuses_a_position_outside_the_cache():
    """The registered kernel runs (not the function body, which would index silently): it names the bad input."""
    f = _case(5)
    f["dense"] = np.append(f["dense"], f["past_key"].shape[2])
    with pytest.raises(Exception, match="AnnSAAttention: a dense position is outside past_key"):
        _session(True).run(None, f)
