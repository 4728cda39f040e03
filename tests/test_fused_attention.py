"""Fused attention (passes/fused_attention.py): exported attention cores -> com.microsoft.GroupQueryAttention.

References: the uncompiled export (tau = +inf: logits at every real position within 1e-4 over a long decode,
batch 2 with left padding) and the eager FastCar reference at finite tau (tests/test_pass_reference.py's
check, the compiler called with fused attention on).
"""

from __future__ import annotations

import functools

import numpy as np
import onnx
import ort_driver
import pytest
import test_pass_reference as tpr
import zoo

L = 4
FUSED = [("llama", "dynamo20"), pytest.param("qwen2", "dynamo20", marks=pytest.mark.slow),
         pytest.param("phi3", "dynamo18", marks=pytest.mark.slow),
         pytest.param("llama", "ortfusions20sdpa", marks=pytest.mark.slow),
         pytest.param("phi3", "ortfusions20sdpa", marks=pytest.mark.slow)]


@pytest.mark.parametrize("family,exporter", FUSED)
def test_fused_attention_equals_the_export(zoo_model, fc_compile, tmp_path, family, exporter):
    src = zoo_model(family, exporter)
    out = tmp_path / "fast.onnx"
    _, report = fc_compile(str(src), output=str(out), frame_tokens=L, threshold=float("inf"), fused_attention=True)
    assert any("fused attention (GroupQueryAttention) in layers [0, 1]" in n for n in report.notes)
    graph = onnx.load(str(out)).graph
    ops = [n.op_type for n in graph.node]
    assert ops.count("GroupQueryAttention") == 2 and "Softmax" not in ops
    producers = {o: n.op_type for n in graph.node for o in n.output}
    assert all(producers[f"present.{i}.{k}"] == "GroupQueryAttention" for i in (0, 1) for k in ("key", "value"))
    rng = np.random.default_rng(1)
    pad = [0, 3]
    steps = [rng.integers(0, zoo.VOCAB, (2, 6))] + [rng.integers(0, zoo.VOCAB, (2, 1)) for _ in range(12 * L)]
    want = ort_driver.decode(src, steps, pad=pad)
    got = ort_driver.decode(out, steps, pad=pad)
    real = np.arange(6)[None, :] >= np.array(pad)[:, None]
    assert np.abs(got.logits[0] - want.logits[0])[real].max() <= 1e-4
    for k in range(1, len(steps)):
        assert np.abs(got.logits[k] - want.logits[k]).max() <= 1e-4, f"step {k}"


def test_fused_attention_matches_eager_reference(zoo_model, fc_compile, tmp_path):
    """Finite tau: TAS from the query GroupQueryAttention reads, replay decisions, logits and the final state
    equal the eager reference (left padding, video_start > 0). No multi-token step after the prompt: ORT's
    GroupQueryAttention refuses one at batch > 1 ("batch_size must be 1 when sequence_length > 1 and past
    context is given")."""
    case = tpr.Case("llama", "dynamo20", "rope", max_replay=2, pad=(0, 2), video_start=3)
    tpr.check_against_reference(zoo_model, functools.partial(fc_compile, fused_attention=True), tmp_path, case)


def test_unfused_shapes_are_left_alone(zoo_model, fc_compile, tmp_path):
    """GPT-2 projects through a 2-D Gemm (no [B, S, H * D] value to replace): the layer stays as exported."""
    out = tmp_path / "fast.onnx"
    _, report = fc_compile(str(zoo_model("gpt2", "dynamo20")), output=str(out), frame_tokens=L,
                           threshold=float("inf"), fused_attention=True)
    assert not any("fused attention" in n for n in report.notes)
    assert "GroupQueryAttention" not in [n.op_type for n in onnx.load(str(out)).graph.node]


@pytest.mark.parametrize("kind", ["fastcar", "gqa"])
def test_a_nan_guarded_softmax_is_left_as_exported(zoo_model, fc_compile, tmp_path, kind):
    """GPT-NeoX's TorchScript export masks with -inf and zeroes the NaN rows of its softmax (Where(IsNaN(p), 0, p)):
    a left-padded query that sees no key gets zeros, where the fused op averages every value. With its Constant
    outputs typed (ONNX shape inference), layer 1's core otherwise looks fusable; the compiled model must still give
    the export's logits at every position, the padded ones included."""
    src = tmp_path / "typed.onnx"
    onnx.save(onnx.shape_inference.infer_shapes(onnx.load(str(zoo_model("neox", "torchscript17")))), str(src))
    out = tmp_path / "fast.onnx"
    fc_compile(str(src), output=str(out), frame_tokens=L, threshold=float("inf"), fused_attention=kind)
    rng = np.random.default_rng(2)
    steps = [rng.integers(0, zoo.VOCAB, (2, 6))] + [rng.integers(0, zoo.VOCAB, (2, 1)) for _ in range(2 * L)]
    want = ort_driver.decode(src, steps, pad=[0, 2])
    got = ort_driver.decode(out, steps, pad=[0, 2])
    for k in range(len(steps)):
        assert np.abs(got.logits[k] - want.logits[k]).max() <= 1e-5, f"step {k}"


def _greedy(sess, prompt: np.ndarray, pad: list[int], n: int) -> tuple[np.ndarray, int]:
    state = sess.new_state(prompt.shape[0])
    mask = (np.arange(prompt.shape[1])[None, :] >= np.array(pad)[:, None]).astype(np.int64)
    out = sess.step(state, prompt, attention_mask=mask)
    logits, replayed = [out.logits[:, -1]], 0
    for _ in range(n):
        ids = out.logits[:, -1].argmax(-1)[:, None]
        out = sess.step(out.state, ids)
        logits.append(out.logits[:, -1])
        replayed += int(out.replay.sum()) if out.replay is not None else 0
    return np.stack(logits, 1), replayed


def test_shared_kv_buffer_session(zoo_model, fc_compile, tmp_path):
    """FastCarSession(max_length=...) on a fused model: one KV buffer per video bound as GQA's past and
    present (appended in place); greedy logits equal the unfused compiled model run with a growing cache
    (batch 2, left padding, finite tau with replay), and a model without GQA is refused clearly."""
    from fastcar_compile.core.errors import FastCarError
    from fastcar_compile.runtime import FastCarSession

    src = zoo_model("llama", "dynamo20")
    fused, plain = tmp_path / "fused.onnx", tmp_path / "plain.onnx"
    fc_compile(str(src), output=str(fused), frame_tokens=L, threshold=0.0, fused_attention=True)
    fc_compile(str(src), output=str(plain), frame_tokens=L, threshold=0.0, fused_attention=None)
    prompt = np.random.default_rng(4).integers(0, zoo.VOCAB, (2, 6))
    want, replayed = _greedy(FastCarSession(plain), prompt, [0, 2], 8 * L)
    got, _ = _greedy(FastCarSession(fused, max_length=6 + 8 * L + 1), prompt, [0, 2], 8 * L)
    assert replayed > 0
    assert np.abs(got - want).max() <= 1e-4
    with pytest.raises(FastCarError, match="GroupQueryAttention"):
        FastCarSession(plain, max_length=64)
    with pytest.raises(FastCarError, match="max_length"):
        _greedy(FastCarSession(fused, max_length=8), prompt, [0, 0], 4)


# --- the ai.fastcar CompressedAttention variant (--fused-attention fastcar) ----------------------------------------

@pytest.mark.parametrize("runner", ["body", "native"])
def test_fastcar_attention_equals_the_export(zoo_model, fc_compile, tmp_path, runner):
    """tau=+inf: logits equal the export within 1e-4 over a long decode at batch 2 with left padding, including
    multi-token steps after the prompt (which ORT's GroupQueryAttention refuses at batch > 1); both the function
    body (stock ORT) and the native kernel."""
    src = zoo_model("llama", "dynamo20")
    out = tmp_path / "fast.onnx"
    _, report = fc_compile(str(src), output=str(out), frame_tokens=L, threshold=float("inf"),
                           fused_attention="fastcar")
    assert any("fused attention (ai.fastcar CompressedAttention) in layers [0, 1]" in n for n in report.notes)
    graph = onnx.load(str(out)).graph
    ops = [n.op_type for n in graph.node]
    assert ops.count("CompressedAttention") == 2 and "Softmax" not in ops and "GroupQueryAttention" not in ops
    rng = np.random.default_rng(2)
    pad = [0, 3]
    steps = [rng.integers(0, zoo.VOCAB, (2, 6))]
    for k in range(10 * L):
        steps.append(rng.integers(0, zoo.VOCAB, (2, 3 if k in (5, 17) else 1)))
    want = ort_driver.decode(src, steps, pad=pad)
    got = ort_driver.decode(out if runner == "body" else ort_driver.make_session(out, threads=2, native=True), steps, pad=pad)
    real = np.arange(6)[None, :] >= np.array(pad)[:, None]
    assert np.abs(got.logits[0] - want.logits[0])[real].max() <= 1e-4
    for k in range(1, len(steps)):
        assert np.abs(got.logits[k] - want.logits[k]).max() <= 1e-4, f"step {k}"


def test_fastcar_attention_matches_eager_reference(zoo_model, fc_compile, tmp_path):
    """Finite tau with the fastcar op: TAS, replay decisions, logits and final state equal the eager reference."""
    case = tpr.Case("llama", "dynamo20", "rope", max_replay=2, pad=(0, 2), video_start=3)
    tpr.check_against_reference(zoo_model, functools.partial(fc_compile, fused_attention="fastcar"), tmp_path, case)


def test_fastcar_shared_buffer_session_multi_token(zoo_model, fc_compile, tmp_path):
    """FastCarSession(max_length) on the fastcar-fused model (KV buffer written in place by the native kernel):
    greedy logits equal the unfused compiled model with a growing cache, batch 2, left padding, replay, and a
    3-token step after the prompt."""
    from fastcar_compile.runtime import FastCarSession

    src = zoo_model("llama", "dynamo20")
    fused, plain = tmp_path / "fused.onnx", tmp_path / "plain.onnx"
    fc_compile(str(src), output=str(fused), frame_tokens=L, threshold=0.0, fused_attention="fastcar")
    fc_compile(str(src), output=str(plain), frame_tokens=L, threshold=0.0, fused_attention=None)
    prompt = np.random.default_rng(5).integers(0, zoo.VOCAB, (2, 6))
    mask = (np.arange(6)[None, :] >= np.array([0, 2])[:, None]).astype(np.int64)

    def run(sess) -> tuple[np.ndarray, int]:
        out = sess.step(sess.new_state(2), prompt, attention_mask=mask)
        out = sess.step(out.state, prompt[:, :3] % 7)  # a multi-token step after the prompt, batch 2
        logits, replayed = [out.logits[:, -1]], 0
        for _ in range(6 * L):
            out = sess.step(out.state, out.logits[:, -1].argmax(-1)[:, None])
            logits.append(out.logits[:, -1])
            replayed += int(out.replay.sum())
        return np.stack(logits, 1), replayed

    want, replayed = run(FastCarSession(plain))
    fs = FastCarSession(fused, max_length=6 + 3 + 6 * L + 1)
    got, _ = run(fs)
    assert replayed > 0 and fs.native_library is not None
    assert np.abs(got - want).max() <= 1e-4


def test_bad_fused_attention_value_is_one_line(zoo_model, tmp_path):
    from fastcar_compile.core.errors import FastCarError
    from fastcar_compile.passes.context import CompileOptions

    with pytest.raises(FastCarError, match="--fused-attention must be one of gqa, fastcar or off, got 'flash'"):
        CompileOptions(frame_tokens=4, fused_attention="flash")


@pytest.mark.parametrize("kind", ["gqa", "fastcar"])
def test_scale_after_the_score_matmul(fc_compile, tmp_path, kind):
    """The bundled demo decoder scales q.K^T after the score MatMul (not q and k before it): both fusions must
    count that factor (they used scale 1 there before) and equal the uncompiled model at tau=+inf."""
    from pathlib import Path

    src = Path(__file__).resolve().parent.parent / "fastcar_compile" / "demo" / "assets" / "decoder.onnx"
    out = tmp_path / "fast.onnx"
    _, report = fc_compile(str(src), output=str(out), frame_tokens=64, threshold=float("inf"), fused_attention=kind)
    assert any(n.startswith("fused attention (") for n in report.notes)
    rng = np.random.default_rng(3)
    steps = [rng.integers(0, 500, (1, 5))] + [rng.integers(0, 500, (1, 1)) for _ in range(20)]
    want = ort_driver.decode(src, steps)
    got = ort_driver.decode(out, steps, frame_tokens=64)
    assert max(np.abs(a - b).max() for a, b in zip(got.logits, want.logits, strict=True)) <= 1e-4
