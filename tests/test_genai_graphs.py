"""onnxruntime-genai builder graphs: the fixtures themselves, then compiling them.

The genai graph is built from the same seeded transformers model the eager reference runs, so the plain
graph must reproduce transformers' logits (fp32) before anything of ours is involved.
"""

from __future__ import annotations

import numpy as np
import ort_driver
import pytest

pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (pip install '.[genai]')")
genai_zoo = pytest.importorskip("genai_zoo", reason="the genai graphs need torch and transformers")
from reference import plain_logits  # noqa: E402

HEAD_DIM = 16
# The builder's fp16 CPU graph, uncompiled, at the first decode step in ORT 1.31 (any optimisation level;
# runs with SessionOptions.enable_mem_reuse = False).
FP16_CPU_BROKEN = "Shape mismatch attempting to re-use buffer"


def _steps(batch: int = 2, prompt: int = 5, decode: int = 6, seed: int = 3) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, genai_zoo.GENAI_VOCAB, (batch, prompt))] + [
        rng.integers(3, genai_zoo.GENAI_VOCAB, (batch, 1)) for _ in range(decode)]


@pytest.mark.parametrize("family", ["llama"])
def test_genai_graph_equals_transformers(genai_model, family):
    """The builder's graph (GroupQueryAttention, packed QKV, fused rotary) = the transformers model, fp32."""
    folder = genai_model(family, "fp32")
    steps = _steps()
    got = ort_driver.decode(folder / "model.onnx", steps, head_dim=HEAD_DIM)
    want = plain_logits(genai_zoo.build_model(family), steps)
    for g, w in zip(got.logits, want, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-4)


# --- compiling genai graphs -------------------------------------------------------------------------------

L = 4
VIDEO_START = 3
TOL = 1e-4
MARGIN = 1e-3


def _reference(model, tau: float | list[float], tas_query: str, prompt: np.ndarray, n: int):
    from reference import FastCarReference

    with FastCarReference(model, frame_tokens=L, threshold=tau, tas_query=tas_query,
                          video_start=VIDEO_START, max_replay=2) as ref:
        run = ref.run([prompt], greedy=n)
        run.final_age = {i: ref.mlp_age[i].numpy().copy() for i in ref.layers}
    return run


def _pick_tau(run, layer: int = 0, margin: float = MARGIN) -> float:
    """A tau in a gap of the eligible tokens' TAS (no value within MARGIN), near the 45% quantile."""
    el = [k for k in range(1, len(run.steps)) if VIDEO_START + L <= run.steps[0].shape[1] + k - 1]
    tas = np.sort(np.concatenate([run.tas[layer][k][:, 0] for k in el]))
    mids = [(a + b) / 2 for a, b in zip(tas[:-1], tas[1:], strict=True) if b - a > 2 * margin]
    target = np.quantile(tas, 0.45)
    return float(min(mids, key=lambda m: abs(m - target)))


# Per build: (logits, TAS tolerance vs the reference; half-gap around tau; tau=+inf vs the uncompiled graph).
# fp16: the graph computes in half precision, the reference in fp32 on the same (fp16) weights; measured on
# Llama/Qwen2/Phi-3: logits <= 1.2e-2, TAS <= 5.4e-3, compiled at tau=+inf vs uncompiled <= 1.0e-2 (the MLP
# runs inside the If branch, where ORT places its fp16 -> fp32 casts differently).
TOLERANCES = {"fp32": (TOL, TOL, MARGIN, 1e-5), "int4-fp32a": (TOL, TOL, MARGIN, 1e-5),
              "fp16": (3e-2, 1.5e-2, 2e-2, 2e-2)}


def _session(path, precision: str, compiled: bool, native=None, inputs=frozenset()):
    """ORT session for a genai graph (`native`: the ai.fastcar kernels' library, else the function bodies;
    `inputs`: video_start / fastcar_threshold made graph inputs to feed); the builder's fp16 CPU graph runs only
    without memory reuse (its repeat_kv tensors declare dim names ORT's buffer reuse trusts, passes/kv_dims.py;
    compiled graphs are repaired and run with the defaults)."""
    import onnxruntime as ort

    if (precision != "fp16" or compiled) and native is None:
        return ort_driver.make_session(path, inputs=inputs)
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.log_severity_level = 1, 3
    so.enable_mem_reuse = precision != "fp16" or compiled
    if native is not None:
        so.register_custom_ops_library(str(native))
    return ort.InferenceSession(ort_driver.model_source(path, so, inputs), so, providers=["CPUExecutionProvider"])


def _natives(precision: str) -> list:
    """Function bodies (None), then the native kernels where they exist (fp32 activations only: packed-QKV
    layers run the packed TemporalGate); a missing library is reported as a skip after the body check."""
    lib = ort_driver.native_or_none() if precision != "fp16" else None
    return [None] + ([lib] if lib is not None else [])


def _case(genai_model, family: str, precision: str, tas_query: str, sizes: dict | None = None):
    """(the builder graph, its reference model, the reference run at a tau in a gap of layer 0's TAS)."""
    src = genai_model(family, precision, sizes) / "model.onnx"
    model = genai_zoo.reference_model(family, src, sizes)
    prompt = np.random.default_rng(7).integers(3, genai_zoo.GENAI_VOCAB, (2, VIDEO_START + 2))
    probe = _reference(model, float("inf"), tas_query, prompt, 4 * L)
    tau = _pick_tau(probe, margin=TOLERANCES[precision][2])
    return src, tau, _reference(model, tau, tas_query, prompt, 4 * L)


def _check_decode(got, run, precision: str, what: str, age_of) -> np.ndarray:
    """Logits, replay masks, TAS and the final stored age (`age_of(layer)` -> the reference age as stored) of
    one compiled decode vs the reference; returns the replay decisions [B, decode steps * layers]."""
    logit_tol, tas_tol = TOLERANCES[precision][:2]
    for k, (g, w) in enumerate(zip(got.logits, run.logits, strict=True)):
        err = np.abs(g.astype(np.float32) - w).max()
        assert err <= logit_tol, f"step {k}: logits differ by {err:.3g} ({what})"
    decided = []
    for i in (0, 1):
        for k in range(1, len(run.steps)):
            np.testing.assert_array_equal(got.replay_mask[i][k].astype(bool), run.replay[i][k],
                                          err_msg=f"layer {i} step {k} ({what})")
            if not np.isnan(run.tas[i][k]).any():
                assert np.abs(got.tas[i][k] - run.tas[i][k]).max() <= tas_tol
        decided.append(np.concatenate(run.replay[i][1:], axis=1))
        name, want = age_of(i)
        np.testing.assert_array_equal(got.final_state[name], want, err_msg=f"{name} ({what})")
    dec = np.concatenate(decided, axis=1)
    assert dec.any() and not dec.all() and (dec[0] != dec[1]).any(), "the case must mix replay and compute"
    return dec


@pytest.mark.parametrize("family,precision,tas_query", [
    ("llama", "fp32", "rope"), ("llama", "fp32", "raw"), ("llama", "int4-fp32a", "rope"),
    ("qwen3", "fp32", "rope"),
    pytest.param("qwen3", "fp32", "raw", marks=pytest.mark.slow),
    pytest.param("qwen3", "int4-fp32a", "rope", marks=pytest.mark.slow),
    pytest.param("mistral", "fp32", "rope", marks=pytest.mark.slow),
    pytest.param("gemma", "fp32", "rope", marks=pytest.mark.slow),
    pytest.param("gemma", "fp32", "raw", marks=pytest.mark.slow),
    pytest.param("llama", "fp16", "rope", marks=pytest.mark.slow),
    pytest.param("qwen2", "fp32", "rope", marks=pytest.mark.slow),
    pytest.param("qwen2", "int4-fp32a", "raw", marks=pytest.mark.slow),
    pytest.param("qwen2", "fp16", "rope", marks=pytest.mark.slow),
    pytest.param("phi3", "fp32", "rope", marks=pytest.mark.slow),
    pytest.param("phi3", "fp32", "raw", marks=pytest.mark.slow),
    pytest.param("phi3", "int4-fp32a", "rope", marks=pytest.mark.slow),
    pytest.param("phi3", "fp16", "raw", marks=pytest.mark.slow)])
def test_compiled_genai_graph_matches_reference(genai_model, fc_compile, tmp_path, family, precision, tas_query):
    """Every family the builder makes on CPU with RoPE: GroupQueryAttention rotating inside (do_rotary=1) on
    packed QKV (Llama, Qwen2, Phi-3, Mistral, Gemma) or on separate q/k/v after per-head q/k norms (Qwen3),
    fp32 and int4 MatMulNBits, and the fp16 CPU build (MultiHeadAttention + RotaryEmbedding): at a tau that
    mixes replay and compute, TAS from the rebuilt query equals the eager reference's (post-RoPE `rope`
    from the graph's own cos/sin caches, pre-RoPE `raw`), and so do the replay decisions and logits over a
    prompt and a greedy decode of four frames; tau=+inf equals the uncompiled graph. The reference is the
    transformers model carrying the graph's own weights (int4 dequantized with NumPy from MatMulNBits'
    spec, fp16 widened)."""
    _compiled_matches_reference(genai_model, fc_compile, tmp_path, family, precision, tas_query)


def _compiled_matches_reference(genai_model, fc_compile, tmp_path, family: str, precision: str, tas_query: str,
                                sizes: dict | None = None) -> None:
    src, tau, run = _case(genai_model, family, precision, tas_query, sizes)
    cfg = genai_zoo.build_model(family, sizes).config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    out = tmp_path / "fastcar.onnx"
    _, report = fc_compile(str(src), output=str(out), frame_tokens=L, threshold=tau, tas_query=tas_query,
                           max_replay=2, emit_diagnostics=True, genai=False)  # DESIGN.md's state names
    assert report.rewritten == [0, 1]
    natives = _natives(precision)
    for native in natives:
        got = ort_driver.decode(_session(out, precision, compiled=True, native=native, inputs={"video_start"}),
                                run.steps, video_start=VIDEO_START, head_dim=head_dim)
        _check_decode(got, run, precision, f"native {native}", lambda i: (f"past_mlp_age.{i}", run.final_age[i]))
    never_tol = TOLERANCES[precision][3]
    dense = ort_driver.decode(_session(src, precision, compiled=False), run.steps, head_dim=head_dim)
    never = ort_driver.decode(_session(out, precision, compiled=True, inputs=ort_driver.VIDEO_INPUTS), run.steps,
                              video_start=VIDEO_START, threshold=float("inf"), head_dim=head_dim)
    for a, b in zip(never.logits, dense.logits, strict=True):
        assert np.abs(a.astype(np.float32) - b.astype(np.float32)).max() <= never_tol
    if precision != "fp16" and len(natives) == 1:
        ort_driver.skip_native_half(None)


# Phi-3 with partial rotary (Phi-4-mini style): the builder's cos/sin caches cover the first half of each head.
# ORT's GroupQueryAttention wants the cache width a multiple of 8, so the head is 32 wide (2 heads, 1 KV head).
PARTIAL = {"partial_rotary_factor": 0.5, "num_attention_heads": 2, "num_key_value_heads": 1}


@pytest.mark.slow
@pytest.mark.parametrize("tas_query", ["rope", "raw"])
def test_partial_rotary_genai_graph_matches_reference(genai_model, fc_compile, tmp_path, tas_query):
    """GroupQueryAttention rotating 16 of 32 channels inside: the gate rotates the same 16 (and reads the
    other 16 as they are), so TAS, replay decisions and logits equal the eager reference's."""
    _compiled_matches_reference(genai_model, fc_compile, tmp_path, "phi3", "fp32", tas_query, PARTIAL)


@pytest.mark.parametrize("family,sizes,rotary,form", [
    ("qwen3", None, "rotary in GroupQueryAttention (do_rotary=1, half-split, dim 16)",
     "on separate q/k/v"),
    ("llama", None, "rotary in GroupQueryAttention (do_rotary=1, half-split, dim 16)", "on packed QKV"),
    pytest.param("phi3", PARTIAL, "rotary in GroupQueryAttention (do_rotary=1, half-split, dim 16 of 32)",
                 "on packed QKV", marks=pytest.mark.slow)])
def test_inspect_names_the_rotary_inside_gqa(genai_model, family, sizes, rotary, form):
    """--inspect says where the rotary is, its pairing and width (Qwen3's separate q/k/v read "rotary none"
    before: the rotary inside the op went unnoticed and the gate read the unrotated query for `rope`)."""
    import fastcar_compile

    report = fastcar_compile.inspect(str(genai_model(family, "fp32", sizes) / "model.onnx"))
    text = report.format(verbose=True)
    assert report.matched == [0, 1], text
    for r in report.layers:
        assert f"{rotary}, MLP" in r.summary, text
        assert any(form in t for t in r.trace), text


def _with_position_ids(src, out) -> None:
    """The builder graph with a `position_ids` input wired into each GroupQueryAttention (input 9): the op then
    rotates at those positions, which the gate does not read."""
    import onnx
    from onnx import TensorProto, helper

    model = onnx.load(str(src))
    model.graph.input.append(helper.make_tensor_value_info("position_ids", TensorProto.INT64,
                                                           ["batch_size", "sequence_length"]))
    for node in model.graph.node:
        if node.op_type == "GroupQueryAttention":
            while len(node.input) < 10:
                node.input.append("")
            node.input[9] = "position_ids"
    onnx.save(model, str(out))


def test_rotary_the_gate_cannot_reproduce_is_refused_for_rope(genai_model, fc_compile, tmp_path):
    """A GroupQueryAttention that rotates at a position_ids input: `rope` TAS is refused with an error naming
    --tas-query raw (never computed from a guessed rotation), --inspect says why, and `raw` still compiles."""
    import fastcar_compile
    from fastcar_compile.core.errors import FastCarError

    src = tmp_path / "positions.onnx"
    _with_position_ids(genai_model("qwen3", "fp32") / "model.onnx", src)
    report = fastcar_compile.inspect(str(src))
    assert all("rope TAS refused" in r.summary and "position_ids" in r.summary for r in report.layers), str(report)
    with pytest.raises(FastCarError, match=r"--tas-query raw") as err:
        fc_compile(str(src), output=str(tmp_path / "rope.onnx"), frame_tokens=L, threshold=0.0, tas_query="rope",
                   genai=False)
    assert "\n" not in str(err.value) and "position_ids" in str(err.value)
    assert not (tmp_path / "rope.onnx").exists()
    _, raw = fc_compile(str(src), output=str(tmp_path / "raw.onnx"), frame_tokens=L, threshold=0.0, tas_query="raw",
                        genai=False)
    assert raw.rewritten == [0, 1]


@pytest.mark.parametrize("family,precision,tas_query", [
    ("llama", "fp32", "rope"), pytest.param("phi3", "int4-fp32a", "raw", marks=pytest.mark.slow),
    pytest.param("qwen3", "fp32", "rope", marks=pytest.mark.slow)])
def test_genai_state_names_match_reference(genai_model, fc_compile, tmp_path, family, precision, tas_query):
    """Compiled for onnxruntime-genai's generator (state `past_key_values.N.conv_state` / `.recurrent_state`,
    the age stored + 1 through the ops' `age_offset`, passes/genai_state.py) and driven as genai's generator
    drives it (those inputs zero-filled, present.N.* carried into past_key_values.N.*): replay decisions and
    logits equal the eager reference's, and the stored age is the reference's age + 1."""
    src, tau, run = _case(genai_model, family, precision, tas_query)
    out = tmp_path / "genai" / "fastcar.onnx"
    _, report = fc_compile(str(src), output=str(out), frame_tokens=L, threshold=tau, tas_query=tas_query,
                           max_replay=2, emit_diagnostics=True, genai=True)
    assert report.rewritten == [0, 1]
    names = {i.name for i in ort_driver.make_session(out).get_inputs()}
    assert {f"past_key_values.{i}.{s}" for i in (0, 1) for s in ("conv_state", "recurrent_state")} <= names
    assert not any(n.startswith(("past_mlp_cache.", "past_mlp_age.")) for n in names)
    natives = _natives(precision)
    for native in natives:
        got = ort_driver.decode(_session(out, precision, compiled=True, native=native, inputs={"video_start"}),
                                run.steps, video_start=VIDEO_START, head_dim=HEAD_DIM)
        _check_decode(got, run, precision, f"genai names, native {native}",
                      lambda i: (f"past_key_values.{i}.recurrent_state", run.final_age[i] + 1))
    if precision != "fp16" and len(natives) == 1:
        ort_driver.skip_native_half(None)


@pytest.mark.parametrize("family", ["llama", pytest.param("qwen2", marks=pytest.mark.slow),
                                    pytest.param("phi3", marks=pytest.mark.slow)])
def test_compiled_genai_int4_never_replaying_equals_original(genai_model, fc_compile, tmp_path, family):
    """The builder's default CPU int4 graph (MatMulNBits accuracy_level 4: int8 activations, which no fp32
    reference reproduces): every layer is rewritten, and at tau=+inf the compiled graph equals the original."""
    src = genai_model(family, "int4") / "model.onnx"
    out = tmp_path / "fast.onnx"
    _, report = fc_compile(str(src), output=str(out), frame_tokens=L, threshold=float("inf"), genai=False)
    assert report.rewritten == [0, 1]
    steps = _steps(decode=2 * L + 2)
    dense = ort_driver.decode(src, steps, head_dim=HEAD_DIM)
    fast = ort_driver.decode(out, steps, head_dim=HEAD_DIM)
    for a, b in zip(fast.logits, dense.logits, strict=True):
        assert np.abs(a - b).max() <= 1e-5


def test_int4_reference_weights_reproduce_the_graph(genai_model):
    """The reference's int4 weights (NumPy dequantization of MatMulNBits) are the graph's: with fp32
    activations the uncompiled graph equals transformers on them, and differs from the original weights."""
    src = genai_model("llama", "int4-fp32a") / "model.onnx"
    steps = _steps()
    got = ort_driver.decode(src, steps, head_dim=HEAD_DIM).logits
    want = plain_logits(genai_zoo.reference_model("llama", src), steps)
    orig = plain_logits(genai_zoo.build_model("llama"), steps)
    for g, w, o in zip(got, want, orig, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-4)
        assert np.abs(g - o).max() > 1e-2


def test_fp16_cpu_build_runs_once_compiled(genai_model, fc_compile, tmp_path):
    """The builder's fp16 CPU graph declares `sequence_length` on its repeat_kv tensors, which are past + new
    tokens long; ORT's buffer reuse trusts the name and fails at the first decode step. The compiler drops
    those names (passes/kv_dims.py): the compiled graph runs with ORT's defaults."""
    src = genai_model("llama", "fp16") / "model.onnx"
    out = tmp_path / "fast.onnx"
    fc_compile(str(src), output=str(out), frame_tokens=L, threshold=float("inf"), genai=False)
    steps = _steps(decode=3)
    with pytest.raises(Exception, match=FP16_CPU_BROKEN):  # ORT 1.31 on the builder's own graph
        ort_driver.decode(src, steps, head_dim=HEAD_DIM)
    fast = ort_driver.decode(out, steps, head_dim=HEAD_DIM)
    dense = ort_driver.decode(_session(src, "fp16", compiled=False), steps, head_dim=HEAD_DIM)
    for a, b in zip(fast.logits, dense.logits, strict=True):
        assert np.abs(a.astype(np.float32) - b.astype(np.float32)).max() <= 2e-2
