"""ai.fastcar SlotAttention (runtime/native/slot_attention.h, and its function body in passes/fastcar_ops.py) against
a NumPy brute force written from its definition: per (row, head) and query, the listed cache slots (logit + their
bias) and the chunk's keys, one softmax, times the values."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from ort_driver import make_session

from fastcar_compile.core import contract
from fastcar_compile.passes.fastcar_ops import function_proto

NAMES = ("q", "k", "v", "past_key", "past_value", "slots", "slot_bias")


def _model() -> onnx.ModelProto:
    node = helper.make_node(contract.SLOT_ATTENTION, list(NAMES), ["out"], domain=contract.DOMAIN)
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT64 if n == "slots" else TensorProto.FLOAT, None)
              for n in NAMES]
    graph = helper.make_graph([node], "slots", inputs, [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid(contract.DOMAIN, 1)], ir_version=10)
    model.functions.append(function_proto(contract.SLOT_ATTENTION, 17))
    return model


def _case(seed: int, B=2, H=3, Q=5, D=16, S=40, N=30) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    f = {n: rng.standard_normal(s).astype(np.float32) for n, s in
         (("q", (B, H, Q, D)), ("k", (B, H, Q, D)), ("v", (B, H, Q, D)), ("past_key", (B, H, S, D)),
          ("past_value", (B, H, S, D)))}
    # per (row, head) a different set of slots, listed in any order, -1 padding anywhere; counts 1..4 as log
    slots = np.full((B, H, N), -1, np.int64)
    for b in range(B):
        for h in range(H):
            n = int(rng.integers(0, N + 1))
            slots[b, h, rng.permutation(N)[:n]] = rng.permutation(S)[:n]
    f.update(slots=slots, slot_bias=np.log(rng.integers(1, 5, (B, H, S))).astype(np.float32))
    return f


def _brute(f: dict[str, np.ndarray]) -> np.ndarray:
    B, H, Q, D = f["q"].shape
    out = np.zeros((B, H, Q, D), np.float64)
    for b in range(B):
        for h in range(H):
            chosen = [p for p in f["slots"][b, h].tolist() if p >= 0]
            keys = np.concatenate([f["past_key"][b, h, chosen], f["k"][b, h]]).astype(np.float64)
            vals = np.concatenate([f["past_value"][b, h, chosen], f["v"][b, h]]).astype(np.float64)
            bias = np.concatenate([f["slot_bias"][b, h, chosen], np.zeros(Q)])
            s = f["q"][b, h].astype(np.float64) @ keys.T + bias
            w = np.exp(s - s.max(1, keepdims=True))
            out[b, h] = (w / w.sum(1, keepdims=True)) @ vals
    return out


@pytest.mark.parametrize("native", [True, False], ids=["native", "function-body"])
@pytest.mark.parametrize("seed,Q,D,S,N", [(0, 5, 16, 40, 30), (1, 70, 20, 2500, 2000), (2, 17, 33, 300, 1)])
def test_slot_attention_matches_brute_force(native: bool, seed: int, Q: int, D: int, S: int, N: int):
    f = _case(seed, Q=Q, D=D, S=S, N=N)
    np.testing.assert_allclose(make_session(_model().SerializeToString(), native=native).run(None, f)[0], _brute(f),
                               rtol=1e-4, atol=1e-5)


def test_slot_attention_dead_slot_weighs_nothing():
    """A listed slot whose bias is -inf (TempCache's dead slot) takes no weight, as if it were not listed."""
    f = _case(3)
    g = {k: v.copy() for k, v in f.items()}
    dead = f["slots"][0, 0][f["slots"][0, 0] >= 0][:2]
    g["slot_bias"][0, 0, dead] = -np.inf
    h = {k: v.copy() for k, v in f.items()}
    h["slots"][0, 0] = np.where(np.isin(h["slots"][0, 0], dead), -1, h["slots"][0, 0])
    sess = make_session(_model().SerializeToString(), native=True)
    np.testing.assert_allclose(sess.run(None, g)[0], sess.run(None, h)[0], rtol=1e-5, atol=1e-6)


def test_native_kernel_refuses_a_slot_outside_the_cache():
    f = _case(4)
    f["slots"][1, 2, 0] = f["past_key"].shape[2]
    with pytest.raises(Exception, match="SlotAttention: a slot is outside past_key"):
        make_session(_model().SerializeToString(), native=True).run(None, f)
