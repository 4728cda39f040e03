"""ai.fastcar GroupQueryAttention's native kernel (runtime/native/group_query_attention.h) against ONNX Runtime's own
com.microsoft.GroupQueryAttention on the same inputs: one-node models, prompt and decode phases, packed and separate
QKV, rotary off / half-split / interleaved, batch 2 with different lengths, KV groups of 1, 2 and 8 query heads, separate
and shared (in-place) KV buffers, and the left-padding attention_bias `--fused-attention gqa` writes."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from fastcar_compile.core import contract

D = 32  # head size (multiple of 16, as GQA's rotary needs)
MAX_POS = 64


def _library() -> str:
    from fastcar_compile.runtime.native import library_path

    lib = library_path()
    if lib is None:
        pytest.skip("native ai.fastcar kernels not built here")
    return str(lib)


def _model(domain: str, heads: int, kv: int, packed: bool, rotary: bool, interleaved: bool, bias: bool,
           scale: float | None) -> onnx.ModelProto:
    names = ["query", "" if packed else "key", "" if packed else "value", "past_key", "past_value", "seqlens_k",
             "total_sequence_length", "cos_cache" if rotary else "", "sin_cache" if rotary else ""]
    if bias:
        names += ["", "attention_bias"]
    attrs = {"num_heads": heads, "kv_num_heads": kv, "do_rotary": int(rotary), "rotary_interleaved": int(interleaved)}
    if scale is not None:
        attrs["scale"] = scale
    node = helper.make_node("GroupQueryAttention", names, ["output", "present_key", "present_value"],
                            domain=domain, **attrs)
    f = TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info("query", f, None),
              helper.make_tensor_value_info("past_key", f, None), helper.make_tensor_value_info("past_value", f, None),
              helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, None),
              helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, None)]
    if not packed:
        inputs += [helper.make_tensor_value_info(n, f, None) for n in ("key", "value")]
    if rotary:
        inputs += [helper.make_tensor_value_info(n, f, None) for n in ("cos_cache", "sin_cache")]
    if bias:
        inputs.append(helper.make_tensor_value_info("attention_bias", f, None))
    outputs = [helper.make_tensor_value_info(n, f, None) for n in ("output", "present_key", "present_value")]
    graph = helper.make_graph([node], "gqa", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(domain, 1)],
                             ir_version=10)


def _session(model: onnx.ModelProto, native: bool) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = 2
    if native:
        so.register_custom_ops_library(_library())
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _run(sess: ort.InferenceSession, feeds: dict, share: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Run; with `share` the past buffers are bound as the present outputs too (genai's shared buffer)."""
    if not share:
        return tuple(sess.run(None, feeds))
    pk, pv = feeds["past_key"].copy(), feeds["past_value"].copy()
    binding = sess.io_binding()
    for name, arr in feeds.items():
        if name not in ("past_key", "past_value"):
            binding.bind_cpu_input(name, arr)
    for name, arr in (("past_key", pk), ("present_key", pk), ("past_value", pv), ("present_value", pv)):
        ov = ort.OrtValue.ortvalue_from_numpy(arr)
        if name.startswith("past"):
            binding.bind_ortvalue_input(name, ov)
        else:
            binding.bind_ortvalue_output(name, ov)
    binding.bind_output("output")
    sess.run_with_iobinding(binding)
    return binding.get_outputs()[-1].numpy(), pk, pv  # outputs in binding order: present key, value, output


def _caches(rng, half: int) -> tuple[np.ndarray, np.ndarray]:
    ang = rng.uniform(0, 6.3, (MAX_POS, half)).astype(np.float32)
    return np.cos(ang), np.sin(ang)


CASES = [  # heads, kv heads, batch, packed, rotary, interleaved, share, scale
    (4, 2, 1, True, "half", False, True, None),
    (4, 2, 2, True, "half", False, True, None),
    (8, 1, 2, False, "half", True, False, 0.3),
    (16, 2, 2, True, None, False, False, None),
    (2, 2, 1, False, None, False, True, None),
    (8, 8, 2, True, "half", True, True, None),
]


@pytest.mark.parametrize("heads,kv,B,packed,rotary,interleaved,share,scale", CASES)
def test_native_gqa_equals_ort_over_prompt_and_decode(heads, kv, B, packed, rotary, interleaved, share, scale):
    """Prompt (with right padding at batch 2: the shorter row's seqlens_k), then decode steps with per-row lengths
    (at batch 1 also a later 3-token chunk: past = seqlens_k + 1 - S);
    every output and the written KV rows equal ORT's GroupQueryAttention on the same inputs: the first prompt's
    right pads too (rotated at their own position i, attending to the row's real tokens only)."""
    rng = np.random.default_rng(heads * 10 + kv + B)
    models = {n: _session(_model(dom, heads, kv, packed, rotary is not None, interleaved, False, scale), n == "ours")
              for n, dom in (("ort", contract.MS_DOMAIN), ("ours", contract.DOMAIN))}
    N, S0 = 24, 7
    lens = np.array([S0, S0 - 3][:B], np.int32)  # row 1 holds 3 pad tokens at its end (right padding)
    cos, sin = _caches(rng, D // 4 if rotary else 1)
    state = {n: (np.zeros((B, kv, N if share else 0, D), np.float32),) * 2 for n in models}
    width = (heads + 2 * kv) * D if packed else heads * D

    def step(S: int, total: int, seqlens: np.ndarray) -> None:
        feeds = {"query": rng.standard_normal((B, S, width)).astype(np.float32),
                 "seqlens_k": seqlens.astype(np.int32), "total_sequence_length": np.array(total, np.int32)}
        if not packed:
            feeds["key"] = rng.standard_normal((B, S, kv * D)).astype(np.float32)
            feeds["value"] = rng.standard_normal((B, S, kv * D)).astype(np.float32)
        if rotary:
            feeds["cos_cache"], feeds["sin_cache"] = cos, sin
        got = {}
        for n, sess in models.items():
            pk, pv = state[n]
            got[n] = _run(sess, {**feeds, "past_key": pk, "past_value": pv}, share)
            state[n] = (got[n][1], got[n][2])
        for b in range(B):
            tot = int(seqlens[b]) + 1
            # first prompt: every token, right pads included (ORT rotates pad i at position i, attends causally);
            # later steps: the written rows
            rows = S if S == total else tot
            o_ort, o_ours = (got[n][0][b] for n in ("ort", "ours"))
            assert np.abs(o_ort - o_ours).max() <= 2e-5, (S, b)
            for i in (1, 2):
                np.testing.assert_allclose(got["ours"][i][b, :, :rows], got["ort"][i][b, :, :rows], atol=1e-6)
            assert got["ours"][1].shape == got["ort"][1].shape

    step(S0, S0, lens - 1)  # prompt
    for _ in range(3):  # decode: each row one more token; total = the longest row
        lens = lens + 1
        step(1, int(lens.max()), lens - 1)
    if B == 1:  # a later multi-token chunk (ORT allows it at batch 1 only), then decode again
        lens = lens + 3
        step(3, int(lens[0]), lens - 1)
        lens = lens + 1
        step(1, int(lens[0]), lens - 1)


def test_native_gqa_long_context_unequal_rows_equals_ort():
    """~1100 tokens of context at batch 2 with rows of different lengths: the decode steps run one dense task per
    row with key splits (T >= 512, flash-decoding partials combined), the prompt the 32-token tiles; every output
    and the written KV rows equal ORT's."""
    heads, kv, B, N = 4, 2, 2, 1104
    rng = np.random.default_rng(11)
    models = {n: _session(_model(dom, heads, kv, True, True, False, False, None), n == "ours")
              for n, dom in (("ort", contract.MS_DOMAIN), ("ours", contract.DOMAIN))}
    ang = rng.uniform(0, 6.3, (N, D // 4)).astype(np.float32)
    cos, sin = np.cos(ang), np.sin(ang)
    state = {n: (np.zeros((B, kv, 0, D), np.float32),) * 2 for n in models}
    lens = np.array([1100, 1037], np.int32)
    for S in (1100, 1, 1, 1):
        if S == 1:
            lens = lens + 1
        total = int(lens.max())
        feeds = {"query": rng.standard_normal((B, S, (heads + 2 * kv) * D)).astype(np.float32),
                 "seqlens_k": lens - 1, "total_sequence_length": np.array(total, np.int32),
                 "cos_cache": cos, "sin_cache": sin}
        got = {}
        for n, sess in models.items():
            got[n] = sess.run(None, {**feeds, "past_key": state[n][0], "past_value": state[n][1]})
            state[n] = (got[n][1], got[n][2])
        assert np.abs(got["ours"][0] - got["ort"][0]).max() <= 5e-5, S
        for b in range(B):
            rows = S if S == total else int(lens[b])
            for i in (1, 2):
                np.testing.assert_allclose(got["ours"][i][b, :, :rows], got["ort"][i][b, :, :rows], atol=1e-6)


@pytest.mark.parametrize("hidden", [float(np.finfo(np.float32).min), -1e30])
def test_native_gqa_left_padding_bias_equals_ort(hidden):
    """`--fused-attention gqa`'s form: every row T long (seqlens_k = T - 1) and an additive attention_bias
    [B, 1, S, T] of 0 / float-min marking left pads; every output equals ORT's, a pad query's too (it sees no key:
    ORT gives zeros under float-min and the mean of its causal values 0..i under a larger bias such as -1e30, never
    the mean of all T values)."""
    rng = np.random.default_rng(5)
    heads, kv, B, N = 4, 2, 2, 16
    models = {n: _session(_model(dom, heads, kv, False, False, False, True, 0.2), n == "ours")
              for n, dom in (("ort", contract.MS_DOMAIN), ("ours", contract.DOMAIN))}
    pads = [0, 3]
    state = {n: (np.zeros((B, kv, N, D), np.float32),) * 2 for n in models}
    for S, T in ((6, 6), (1, 7), (1, 8)):
        mask = np.ones((B, T), bool)
        for b, p in enumerate(pads):
            mask[b, :p] = False
        bias = np.where(mask, 0, hidden).astype(np.float32)[:, None, None, :]
        feeds = {"query": rng.standard_normal((B, S, heads * D)).astype(np.float32),
                 "key": rng.standard_normal((B, S, kv * D)).astype(np.float32),
                 "value": rng.standard_normal((B, S, kv * D)).astype(np.float32),
                 "seqlens_k": np.full(B, T - 1, np.int32), "total_sequence_length": np.array(T, np.int32),
                 "attention_bias": np.ascontiguousarray(np.broadcast_to(bias, (B, 1, S, T)))}
        got = {}
        for n, sess in models.items():
            got[n] = _run(sess, {**feeds, "past_key": state[n][0], "past_value": state[n][1]}, True)
            state[n] = got[n][1:]
        assert np.abs(got["ours"][0] - got["ort"][0]).max() <= 2e-5, (S, T)


def test_native_gqa_shared_buffer_written_in_place():
    """Past and present bound to one buffer: only the new row of each KV head is written (rows before it and after
    it keep their bytes), at index seqlens_k[b] per batch row."""
    heads, kv, B, N = 4, 2, 2, 12
    sess = _session(_model(contract.DOMAIN, heads, kv, True, False, False, False, None), True)
    rng = np.random.default_rng(9)
    pk = rng.standard_normal((B, kv, N, D)).astype(np.float32)
    pv = rng.standard_normal((B, kv, N, D)).astype(np.float32)
    before_k, before_v = pk.copy(), pv.copy()
    seqlens = np.array([4, 8], np.int32)
    qkv = rng.standard_normal((B, 1, (heads + 2 * kv) * D)).astype(np.float32)
    feeds = {"query": qkv, "seqlens_k": seqlens, "total_sequence_length": np.array(9, np.int32),
             "past_key": pk, "past_value": pv}
    binding = sess.io_binding()
    for name in ("query", "seqlens_k", "total_sequence_length"):
        binding.bind_cpu_input(name, feeds[name])
    for name, arr in (("past_key", pk), ("past_value", pv)):
        binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(arr))
    binding.bind_ortvalue_output("present_key", ort.OrtValue.ortvalue_from_numpy(pk))
    binding.bind_ortvalue_output("present_value", ort.OrtValue.ortvalue_from_numpy(pv))
    binding.bind_output("output")
    sess.run_with_iobinding(binding)
    k_new = qkv[:, 0, heads * D:(heads + kv) * D].reshape(B, kv, D)
    v_new = qkv[:, 0, (heads + kv) * D:].reshape(B, kv, D)
    for b, s in enumerate(seqlens):
        np.testing.assert_array_equal(pk[b, :, s], k_new[b])
        np.testing.assert_array_equal(pv[b, :, s], v_new[b])
        keep = np.arange(N) != s
        np.testing.assert_array_equal(pk[b][:, keep], before_k[b][:, keep])
        np.testing.assert_array_equal(pv[b][:, keep], before_v[b][:, keep])


def test_native_gqa_concurrent_runs_of_one_session():
    """Run calls of one session from four threads at once (the kernel's q scratch, mask and positions are per
    thread, reused between calls): decode steps at batch 1 and 2 (unequal rows), a short prompt and a 600-token
    prompt whose 1.2 MB q is freed after each call, interleaved; every output equals ORT's GroupQueryAttention on
    the same feeds, computed one at a time."""
    from concurrent.futures import ThreadPoolExecutor

    heads, kv = 16, 2
    models = {n: _session(_model(dom, heads, kv, True, True, False, False, None), n == "ours")
              for n, dom in (("ort", contract.MS_DOMAIN), ("ours", contract.DOMAIN))}
    rng = np.random.default_rng(12)
    ang = rng.uniform(0, 6.3, (700, D // 4)).astype(np.float32)
    cos, sin = np.cos(ang), np.sin(ang)
    width = (heads + 2 * kv) * D

    def feeds(B: int, S: int, past: int, lens: list[int]) -> dict:
        return {"query": rng.standard_normal((B, S, width)).astype(np.float32),
                "past_key": rng.standard_normal((B, kv, past, D)).astype(np.float32),
                "past_value": rng.standard_normal((B, kv, past, D)).astype(np.float32),
                "seqlens_k": np.array(lens, np.int32) - 1, "total_sequence_length": np.array(max(lens), np.int32),
                "cos_cache": cos, "sin_cache": sin}

    cases = [feeds(1, 1, 299, [300]), feeds(2, 1, 299, [300, 211]), feeds(1, 5, 0, [5]), feeds(1, 600, 0, [600])]
    want = [models["ort"].run(None, f)[0] for f in cases]
    order = [i % len(cases) for i in range(24)]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda i: models["ours"].run(None, cases[i])[0], order))
    for i, g in zip(order, got, strict=True):
        assert np.abs(g - want[i]).max() <= 5e-5, i

# --- genai builder graphs with the swap -------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["llama", pytest.param("qwen2", marks=pytest.mark.slow),
                                    pytest.param("phi3", marks=pytest.mark.slow)])
def test_swapped_genai_graph_equals_the_original(genai_model, tmp_path, family):
    """The builder's graph with its GroupQueryAttention nodes swapped (native kernel registered) = the unswapped
    graph in plain ORT, logits within 1e-4 over a batch-2 prompt and decode steps (growing cache)."""
    import ort_driver

    import fastcar_compile as fc

    src = genai_model(family, "fp32")
    out = tmp_path / "swapped" / "model.onnx"
    notes = fc.native_attention(src / "model.onnx", out)
    assert any("GroupQueryAttention nodes -> ai.fastcar" in n for n in notes), notes
    ops = [(n.domain, n.op_type) for n in onnx.load(str(out), load_external_data=False).graph.node]
    assert (contract.MS_DOMAIN, "GroupQueryAttention") not in ops and (contract.DOMAIN, "GroupQueryAttention") in ops
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.log_severity_level = 1, 3
    so.register_custom_ops_library(_library())
    ours = ort.InferenceSession(str(out), so, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(4)
    steps = [rng.integers(3, 160, (2, 6))] + [rng.integers(3, 160, (2, 1)) for _ in range(5)]
    want = ort_driver.decode(src / "model.onnx", steps, head_dim=16).logits
    got = ort_driver.decode(ours, steps, head_dim=16).logits
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-4)


def test_generator_tokens_with_native_attention_equal_dense(genai_model, tmp_path):
    """og.Generator (genai's shared KV buffer, written in place by the kernel) on the swapped folder, which names
    the native library relatively in genai_config.json: greedy tokens = genai's on the dense model."""
    og = pytest.importorskip("onnxruntime_genai")
    import json

    import fastcar_compile as fc

    _library()
    src = genai_model("llama", "fp32")
    out = tmp_path / "native"
    fc.native_attention(src / "model.onnx", out / "model.onnx")
    so = json.loads((out / "genai_config.json").read_text())["model"]["decoder"]["session_options"]
    assert so["custom_ops_library"] == "libfastcar_ops.so" and (out / "libfastcar_ops.so").is_file()

    def tokens(folder):
        model = og.Model(str(folder))
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=5 + 24, do_sample=False)
        gen = og.Generator(model, params)
        gen.append_tokens(np.random.default_rng(7).integers(3, 160, (1, 5)).astype(np.int32))
        while not gen.is_done():
            gen.generate_next_token()
        return np.array(gen.get_sequence(0))

    np.testing.assert_array_equal(tokens(out), tokens(src))


def test_native_attention_keeps_unsupported_nodes(tmp_path):
    """A node outside the kernel's subset (softcap) stays ORT's op, with the reason in the notes (--inspect)."""
    import onnx_ir as ir

    from fastcar_compile.passes.native_gqa import NativeGqaPass, inspect_notes

    model = _model(contract.MS_DOMAIN, 4, 2, True, True, False, False, None)
    model.graph.node[0].attribute.append(helper.make_attribute("softcap", 30.0))
    model.graph.node[0].name = "gqa0"
    ir_model = ir.serde.deserialize_model(model)
    for v in ir_model.graph.inputs:
        v.dtype = ir.DataType.FLOAT if v.name not in ("seqlens_k", "total_sequence_length") else ir.DataType.INT32
    assert inspect_notes(ir_model)[1] == "native attention: gqa0 stays ORT's: softcap=30.0 is not supported (only 0.0)"
    notes: list[str] = []
    assert not NativeGqaPass(notes)(ir_model).modified
    assert ir_model.graph.node(0).domain == contract.MS_DOMAIN and "softcap" in notes[0]


@pytest.mark.parametrize("scale", [None, 0.3])
def test_function_body_is_ort_gqa(scale):
    """Without the library, ORT runs the op's function body: ORT's own GroupQueryAttention, bit for bit (an absent
    optional attribute such as scale stays absent)."""
    from fastcar_compile.passes import fastcar_ops

    heads, kv, B = 4, 2, 2
    ours = _model(contract.DOMAIN, heads, kv, True, True, False, False, scale)
    ours.functions.append(fastcar_ops.function_proto(contract.GROUP_QUERY_ATTENTION, 17))
    ours.opset_import.append(helper.make_opsetid(contract.MS_DOMAIN, 1))
    sessions = [_session(ours, False), _session(_model(contract.MS_DOMAIN, heads, kv, True, True, False, False, scale),
                                                False)]
    rng = np.random.default_rng(1)
    cos, sin = _caches(rng, D // 4)
    feeds = {"query": rng.standard_normal((B, 5, (heads + 2 * kv) * D)).astype(np.float32),
             "past_key": np.zeros((B, kv, 8, D), np.float32), "past_value": np.zeros((B, kv, 8, D), np.float32),
             "seqlens_k": np.array([4, 2], np.int32), "total_sequence_length": np.array(5, np.int32),
             "cos_cache": cos, "sin_cache": sin}
    got, want = (s.run(None, feeds) for s in sessions)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


def _bad_feeds(case: str) -> tuple[dict, bool]:
    """Feeds for the separate-QKV (or, with the flag, packed) rotary model, broken as `case` says."""
    rng = np.random.default_rng(3)
    heads, kv, B, S = 4, 2, 2, 3
    cos, sin = _caches(rng, D // 4)
    f = {"query": rng.standard_normal((B, S, heads * D)).astype(np.float32),
         "key": rng.standard_normal((B, S, kv * D)).astype(np.float32),
         "value": rng.standard_normal((B, S, kv * D)).astype(np.float32),
         "past_key": np.zeros((B, kv, 8, D), np.float32), "past_value": np.zeros((B, kv, 8, D), np.float32),
         "seqlens_k": np.array([2, 1], np.int32), "total_sequence_length": np.array(S, np.int32),
         "cos_cache": cos, "sin_cache": sin}
    packed = case.startswith("packed")
    if packed:
        f["query"] = rng.standard_normal((B, S, (heads + 2 * kv) * D)).astype(np.float32)
        del f["key"], f["value"]
    change = {
        "past_value_shape": {"past_value": np.zeros((B, kv, 4, D), np.float32)},
        "value_narrower": {"value": f.get("value", f["query"])[..., :D]},
        "key_other_length": {"key": rng.standard_normal((B, S + 2, kv * D)).astype(np.float32),
                             "value": rng.standard_normal((B, S + 2, kv * D)).astype(np.float32)},
        "seqlens_short": {"seqlens_k": np.array([2], np.int32)},
        "sin_shape": {"sin_cache": sin[:, :2]},
        "width_not_heads": {"query": f["query"][..., :-3]},
        "packed_width": {"query": f["query"][..., :-4]},
        "empty_query": {"query": f["query"][:, :0]},
        "zero_width": {"query": f["query"][..., :0]},
    }[case]
    return {**f, **change}, packed


@pytest.mark.parametrize("case", ["past_value_shape", "value_narrower", "key_other_length", "seqlens_short",
                                  "sin_shape", "width_not_heads", "packed_width", "empty_query",
                                  "zero_width"])
def test_native_gqa_rejects_bad_shapes(case):
    """Inputs whose shapes the kernel would index past their end are a failed Run naming the input, never a crash
    or a silent read out of bounds (ORT's own op rejects them too)."""
    feeds, packed = _bad_feeds(case)
    for domain in (contract.DOMAIN, contract.MS_DOMAIN):
        sess = _session(_model(domain, 4, 2, packed, True, False, False, None), domain == contract.DOMAIN)
        with pytest.raises(Exception) as err:  # noqa: PT011 (ORT raises its own Fail / InvalidArgument types)
            sess.run(None, feeds)
        if domain == contract.DOMAIN:
            assert "GroupQueryAttention" in str(err.value)


def test_native_gqa_rejects_past_key_without_past_value():
    """past_key given, past_value left out: a failed Run, not a null dereference."""
    model = _model(contract.DOMAIN, 4, 2, True, False, False, False, None)
    model.graph.node[0].input[4] = ""
    model.graph.input.remove(next(i for i in model.graph.input if i.name == "past_value"))
    sess = _session(model, True)
    rng = np.random.default_rng(2)
    feeds = {"query": rng.standard_normal((1, 2, 8 * D)).astype(np.float32),
             "past_key": np.zeros((1, 2, 4, D), np.float32), "seqlens_k": np.array([1], np.int32),
             "total_sequence_length": np.array(2, np.int32)}
    with pytest.raises(Exception, match="past_key and past_value"):
        sess.run(None, feeds)


def _bias_graph(cond_shape: list, unsqueeze: bool, attrs: dict | None = None, outputs: int = 3,
                qk_graph_output: bool = False):
    """ORT's GroupQueryAttention fed a Where(mask == 0, float-min, 0) bias built from a `mask` input of cond_shape
    (Unsqueezed at axes 1, 2 when asked), as onnx_ir sees it before the swap."""
    import onnx_ir as ir

    f, lowest = TensorProto.FLOAT, float(np.finfo(np.float32).min)
    inits = [helper.make_tensor("zero_i", TensorProto.INT64, [], [0]), helper.make_tensor("low", f, [], [lowest]),
             helper.make_tensor("zero_f", f, [], [0.0]), helper.make_tensor("axes", TensorProto.INT64, [2], [1, 2])]
    nodes = [helper.make_node("Equal", ["mask", "zero_i"], ["pad"]),
             helper.make_node("Where", ["pad", "low", "zero_f"], ["bias2"])]
    if unsqueeze:
        nodes.append(helper.make_node("Unsqueeze", ["bias2", "axes"], ["bias"]))
    outs = ["output", "present_key", "present_value", "output_qk"][:outputs]
    nodes.append(helper.make_node("GroupQueryAttention", ["query", "key", "value", "past_key", "past_value",
                                                           "seqlens_k", "total_sequence_length", "", "", "",
                                                           "bias" if unsqueeze else "bias2"], outs,
                                  domain=contract.MS_DOMAIN, name="gqa0", num_heads=4, kv_num_heads=2,
                                  **(attrs or {})))
    ins = [helper.make_tensor_value_info(n, f, None) for n in ("query", "key", "value", "past_key", "past_value")]
    ins += [helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, None),
            helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, None),
            helper.make_tensor_value_info("mask", TensorProto.INT64, cond_shape)]
    graph_outs = [helper.make_tensor_value_info(n, f, None) for n in outs[:3] + (["output_qk"] if qk_graph_output
                                                                                 else [])]
    model = helper.make_model(helper.make_graph(nodes, "g", ins, graph_outs, inits),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(contract.MS_DOMAIN, 1)])
    ir_model = ir.serde.deserialize_model(model)
    ir_model.graph.inputs[0].dtype = ir.DataType.FLOAT
    return ir_model


@pytest.mark.parametrize("cond_shape,unsqueeze,swapped", [
    (["B", "T"], True, True),  # --fused-attention gqa's form: [B, T] -> [B, 1, 1, T]
    (["B", 1, 1, "T"], False, True),
    (["B", 1, "S", "T"], False, False),  # a condition per query row: the kernel reads the last row only
    (["B", "T"], False, False),  # a [B, T] bias: not [B, 1, 1|S, T]
])
def test_native_gqa_swaps_only_row_constant_bias(cond_shape, unsqueeze, swapped):
    """The swap takes a Where-mask bias only when its condition is constant across query rows; otherwise the node
    stays ORT's and --inspect says why."""
    from fastcar_compile.passes.native_gqa import NativeGqaPass, inspect_notes

    model = _bias_graph(cond_shape, unsqueeze)
    notes = inspect_notes(model)
    assert (len(notes) == 1) == swapped, notes
    assert swapped or "attention_bias" in notes[1]
    assert NativeGqaPass([])(model).modified == swapped


@pytest.mark.parametrize("attrs,outputs,qk_out,why", [
    ({"smooth_softmax": -1}, 3, False, None),  # ORT's explicit "off"
    ({"smooth_softmax": 1}, 3, False, "smooth_softmax=1"),
    ({}, 2, False, "2 outputs"),
    ({}, 4, True, "output_qk"),
])
def test_native_gqa_refuses_with_a_reason(attrs, outputs, qk_out, why):
    """Nodes the swap cannot take are refused with a reason (never an exception from the pass); smooth_softmax=-1
    is off in ORT and swapped."""
    from fastcar_compile.passes.native_gqa import NativeGqaPass, unsupported

    model = _bias_graph(["B", "T"], True, attrs, outputs, qk_out)
    reason = unsupported(model.graph.node(len(model.graph) - 1))
    assert (reason is None) if why is None else (why in reason), reason
    assert NativeGqaPass([])(model).modified == (why is None)
