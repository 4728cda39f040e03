"""Native ai.fastcar kernels vs the model-local function bodies (max abs diff <= 1e-5), where they build."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

pytestmark = pytest.mark.filterwarnings("ignore")


def _ops_model(L: int, max_replay: int, opset: int = 20) -> onnx.ModelProto:
    """q, key, age, cache, branch -> the three ops chained as the compiler wires them."""
    from fastcar_compile.passes.fastcar_ops import DOMAIN, function_proto

    f = TensorProto.FLOAT
    i64 = TensorProto.INT64
    nodes = [
        helper.make_node("TemporalGate", ["q", "key", "age", "threshold", "video_start"],
                         ["replay", "tas", "slot", "write"], domain=DOMAIN, frame_tokens=L, max_replay=max_replay),
        helper.make_node("MLPCacheRead", ["cache", "slot"], ["cached"], domain=DOMAIN),
        helper.make_node("Unsqueeze", ["replay", "axis2"], ["replay3"]),
        helper.make_node("Where", ["replay3", "cached", "fresh"], ["branch"]),
        helper.make_node("MLPCacheUpdate", ["cache", "age", "branch", "replay", "slot", "write"],
                         ["new_cache", "new_age"], domain=DOMAIN),
    ]
    ins = [helper.make_tensor_value_info("q", f, ["B", "H", "S", "D"]),
           helper.make_tensor_value_info("key", f, ["B", "Hkv", "T", "D"]),
           helper.make_tensor_value_info("age", i64, ["B", L]),
           helper.make_tensor_value_info("threshold", f, []),
           helper.make_tensor_value_info("video_start", i64, []),
           helper.make_tensor_value_info("cache", f, ["B", L, "Hd"]),
           helper.make_tensor_value_info("fresh", f, ["B", "S", "Hd"])]
    outs = [helper.make_tensor_value_info(n, t, None) for n, t in
            (("replay", TensorProto.BOOL), ("tas", f), ("slot", i64), ("write", TensorProto.BOOL),
             ("cached", f), ("new_cache", f), ("new_age", i64))]
    axis = helper.make_tensor("axis2", i64, [1], [2])
    g = helper.make_graph(nodes, "fastcar_ops", ins, outs, [axis])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(DOMAIN, 1)],
                          functions=[function_proto(op, opset) for op in ("TemporalGate", "MLPCacheRead",
                                                                           "MLPCacheUpdate")])
    m.ir_version = 10
    return m


def _session(model: onnx.ModelProto, lib) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    if lib is not None:
        so.register_custom_ops_library(str(lib))
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


CASES = [  # B, H, Hkv, S, D, L, Hd, past, video_start, max_replay
    (8, 4, 2, 1, 16, 8, 32, 20, 3, 0),     # decode step, GQA: rows replay and compute
    (1, 4, 4, 1, 8, 4, 16, 9, 2, 2),       # MHA, drift guard
    (3, 8, 2, 1, 16, 8, 64, 5, 0, 0),      # aligned index < video_start: never eligible
    (2, 4, 2, 6, 16, 4, 32, 0, 3, 0),      # prefill longer than a frame: only the last L video tokens write
    (2, 4, 2, 3, 16, 8, 32, 11, 4, 0),     # multi-token step: no replay, writes
]


@pytest.mark.parametrize("case", CASES)
def test_native_equals_function_bodies(native_lib, case):
    B, H, Hkv, S, D, L, Hd, past, vs, K = case
    rng = np.random.default_rng(sum(case))
    T = past + S
    feeds = {
        "q": rng.standard_normal((B, H, S, D)).astype(np.float32),
        "key": rng.standard_normal((B, Hkv, T, D)).astype(np.float32),
        "age": rng.integers(-1, 4, (B, L)).astype(np.int64),
        "threshold": np.array(0.0, np.float32),
        "video_start": np.array(vs, np.int64),
        "cache": rng.standard_normal((B, L, Hd)).astype(np.float32),
        "fresh": rng.standard_normal((B, S, Hd)).astype(np.float32),
    }
    m = _ops_model(L, K)
    ref = _session(m, None).run(None, feeds)
    got = _session(m, native_lib).run(None, feeds)
    names = [o.name for o in m.graph.output]
    for n, a, b in zip(names, ref, got, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, n
        if a.dtype == np.float32:
            np.testing.assert_allclose(b, a, atol=1e-5, rtol=0, err_msg=n)
        else:
            np.testing.assert_array_equal(b, a, err_msg=n)
    if case == CASES[0]:  # the comparison covered both decisions
        assert ref[0].any() and not ref[0].all()


def test_native_in_place_update(native_lib):
    """Binding present_mlp_cache to past_mlp_cache's buffer updates it in place, same values as the copy."""
    B, H, Hkv, S, D, L, Hd, past, vs = 2, 4, 2, 1, 16, 8, 32, 20, 3
    rng = np.random.default_rng(5)
    feeds = {
        "q": rng.standard_normal((B, H, S, D)).astype(np.float32),
        "key": rng.standard_normal((B, Hkv, past + S, D)).astype(np.float32),
        "age": rng.integers(0, 3, (B, L)).astype(np.int64),
        "threshold": np.array(-0.5, np.float32),
        "video_start": np.array(vs, np.int64),
        "cache": rng.standard_normal((B, L, Hd)).astype(np.float32),
        "fresh": rng.standard_normal((B, S, Hd)).astype(np.float32),
    }
    m = _ops_model(L, 0)
    want = _session(m, None).run(["new_cache", "new_age"], feeds)
    sess = _session(m, native_lib)
    cache, age = feeds["cache"].copy(), feeds["age"].copy()
    io = sess.io_binding()
    for k, v in feeds.items():
        arr = {"cache": cache, "age": age}.get(k, v)
        io.bind_cpu_input(k, arr)
    io.bind_output("new_cache", "cpu", 0, np.float32, list(cache.shape), cache.ctypes.data)
    io.bind_output("new_age", "cpu", 0, np.int64, list(age.shape), age.ctypes.data)
    sess.run_with_iobinding(io)
    np.testing.assert_allclose(cache, want[0], atol=1e-6)
    np.testing.assert_array_equal(age, want[1])


def test_compiled_model_with_native_kernels(native_lib, zoo_model, tmp_path):
    """A whole compiled model: native (copying and in place) decodes exactly as the function bodies."""
    fc = pytest.importorskip("fastcar_compile")
    from fastcar_compile.core.errors import FastCarError
    from fastcar_compile.runtime import FastCarSession

    path = tmp_path / "fast.onnx"
    fc.compile(str(zoo_model("llama", "dynamo20")), str(path), frame_tokens=8)
    kw = dict(threshold=0.0, keep_logits=True, cfg_scale=2.0, uncond_prompt_ids=[[7], [8, 9]])
    ref = FastCarSession(path, native=False, threads=1).generate([[1, 2, 3], [4, 5]], 4, **kw)
    assert 0 < ref.stats.replay_ratio
    for inplace in (False, True):
        s = FastCarSession(path, native=True, inplace=inplace, threads=1)
        assert s.native_library and s.inplace == inplace
        got = s.generate([[1, 2, 3], [4, 5]], 4, **kw)
        np.testing.assert_array_equal(got.tokens, ref.tokens)
        assert got.stats.steps == ref.stats.steps
        # (the native attention kernel sums in another order than ORT's MatMul; cfg_scale 2 amplifies by 5)
        np.testing.assert_allclose(got.logits, ref.logits, atol=5e-5, rtol=0)
    # in place consumes the state it was given: reusing it is refused, not silently wrong
    s = FastCarSession(path, native=True, inplace=True, threads=1)
    st = s.step(s.new_state(1, video_start=2), np.array([[1, 2]])).state
    s.step(st, np.array([[3]]))
    with pytest.raises(FastCarError, match="in place"):
        s.step(st, np.array([[3]]))
    with pytest.raises(FastCarError, match="native"):
        FastCarSession(path, native=False, inplace=True)


def test_float16_model_falls_back_to_function_bodies(native_lib, tmp_path):
    """The kernels are float32 only: a float16 model still loads (function bodies) unless native=True."""
    import torch
    import zoo

    fc = pytest.importorskip("fastcar_compile")
    from fastcar_compile.core.errors import FastCarError
    from fastcar_compile.runtime import FastCarSession

    info = zoo.model_info("llama")
    wrapper = zoo.FlatKVWrapper(zoo.build_model("llama").to(torch.float16), info.num_layers).eval()
    orig = zoo.example_inputs
    zoo.example_inputs = lambda i, *a, **k: tuple(t.half() if t.is_floating_point() else t for t in orig(i, *a, **k))
    try:
        with torch.no_grad():
            zoo._export_dynamo(wrapper, info, tmp_path / "h.onnx", 20)
    finally:
        zoo.example_inputs = orig
    fc.compile(str(tmp_path / "h.onnx"), str(tmp_path / "fast.onnx"), frame_tokens=4)
    auto = FastCarSession(tmp_path / "fast.onnx", threads=1)
    assert auto.native_library is None and not auto.inplace
    plain = FastCarSession(tmp_path / "fast.onnx", native=False, threads=1)
    a, b = auto.generate([[1, 2, 3]], 3, threshold=0.0), plain.generate([[1, 2, 3]], 3, threshold=0.0)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert a.stats.steps == b.stats.steps
    with pytest.raises(FastCarError, match="float32 only"):
        FastCarSession(tmp_path / "fast.onnx", native=True)


def test_unfed_gate_input_is_named(native_lib):
    """ORT's IO binding runs a session without checking that every graph input is bound (a run() call refuses):
    the gate meets a value holding no tensor, for which ORT's own words are "must contain a constructed tensor".
    The kernel names the graph input that was not fed."""
    feeds = {"q": np.zeros((1, 2, 1, 4), np.float32), "key": np.zeros((1, 2, 6, 4), np.float32),
             "age": np.zeros((1, 4), np.int64), "video_start": np.array(0, np.int64),
             "cache": np.zeros((1, 4, 8), np.float32), "fresh": np.zeros((1, 1, 8), np.float32)}
    sess = _session(_ops_model(4, 0), native_lib)
    io = sess.io_binding()
    for k, v in feeds.items():  # every input but the threshold
        io.bind_cpu_input(k, v)
    for o in sess.get_outputs():
        io.bind_output(o.name)
    with pytest.raises(Exception, match=r"input threshold \('threshold'\) has no value: a graph input that was not"):
        sess.run_with_iobinding(io)
