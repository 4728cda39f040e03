"""Acceptance tests of the compiler pass: tau = +inf is the original model, clear CLI errors.

Judged against the original export run by ONNX Runtime and against the eager reference's TAS
(tests/reference.py), never against the pass's own output.
"""

from __future__ import annotations

import hashlib
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import ort_driver
import pytest
import zoo
from onnx import TensorProto, helper
from reference import FastCarReference

L = 4
PAD = [0, 1]
DEFAULT_COMBOS = [
    ("llama", "dynamo20"),
    ("qwen2", "torchscript17"),
    ("phi3", "ortfusions20"),
    ("gpt2", "dynamo18"),
    ("llama", "dynamo23"),
    ("qwen2", "dynamo24"),
]
ALL_COMBOS = [(f, e) for f in zoo.FAMILIES for e in zoo.EXPORTERS]
SLOW_COMBOS = [c for c in ALL_COMBOS if c not in DEFAULT_COMBOS]


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def decode_steps(seed: int = 3) -> list[np.ndarray]:
    """Prompt of 4 (one frame), 13 single-token steps (3+ frames), then a 2-token step with a past."""
    rng = np.random.default_rng(seed)
    steps = [rng.integers(0, zoo.VOCAB, (2, L))]
    steps += [rng.integers(0, zoo.VOCAB, (2, 1)) for _ in range(3 * L + 1)]
    steps.append(rng.integers(0, zoo.VOCAB, (2, 2)))
    return steps


def real_mask(steps: list[np.ndarray], pad: list[int], k: int, aligned: bool) -> np.ndarray:
    """[B, S] True where step k's token is a real token (and, if aligned, its key p - L is a real token too)."""
    start = sum(s.shape[1] for s in steps[:k])
    p = start + np.arange(steps[k].shape[1])[None, :]
    pad_ = np.asarray(pad)[:, None]
    ok = p >= pad_
    return ok & (p - L >= pad_) if aligned else ok


def check_inf_equivalence(zoo_model, fc_compile, tmp_path: Path, family: str, exporter: str,
                          pad: list[int] = PAD) -> None:
    src = zoo_model(family, exporter)
    before = sha256(src)
    out = tmp_path / "fast.onnx"
    _, report = fc_compile(
        str(src), output=str(out), frame_tokens=L, threshold=math.inf, emit_diagnostics=True
    )
    assert sha256(src) == before, "the input model was modified"
    info = zoo.model_info(family)
    assert report.rewritten == list(range(info.num_layers)), report.format()

    sess = ort_driver.make_session(out)
    names = {i.name for i in sess.get_inputs()}
    assert {f"past_mlp_cache.{i}" for i in range(info.num_layers)} <= names, (
        "no FastCar state: nothing rewritten"
    )

    steps = decode_steps()
    base = ort_driver.decode(src, steps, pad=pad)
    fast = ort_driver.decode(sess, steps, pad=pad)
    worst = 0.0
    for k, (b, f) in enumerate(zip(base.logits, fast.logits, strict=True)):
        m = real_mask(steps, pad, k, aligned=False)
        worst = max(worst, float(np.abs(b - f)[m].max()))
    assert worst <= 1e-5, f"max |logits fast - original| = {worst:.3g}"

    # TAS: the pass computes it at every token even when nothing may replay; it must be the reference's.
    with FastCarReference(zoo.build_model(family), frame_tokens=L, threshold=math.inf) as ref:
        want = ref.run(steps, pad=pad)
    for i in range(info.num_layers):
        assert len(fast.replay_mask[i]) == len(steps) and len(fast.tas[i]) == len(steps)
        for k in range(len(steps)):
            assert not fast.replay_mask[i][k].any(), f"layer {i} step {k}: replay at tau=+inf"
            m = real_mask(steps, pad, k, aligned=True)
            if m.any():
                diff = np.abs(fast.tas[i][k].astype(np.float64) - want.tas[i][k])[m].max()
                assert diff <= 1e-4, f"layer {i} step {k}: TAS differs from the reference by {diff:.3g}"


@pytest.mark.parametrize("family,exporter", DEFAULT_COMBOS, ids=[f"{f}-{e}" for f, e in DEFAULT_COMBOS])
def test_inf_threshold_is_the_original_model(zoo_model, fc_compile, tmp_path, family, exporter):
    check_inf_equivalence(zoo_model, fc_compile, tmp_path, family, exporter)


@pytest.mark.slow
@pytest.mark.parametrize("family,exporter", SLOW_COMBOS, ids=[f"{f}-{e}" for f, e in SLOW_COMBOS])
def test_inf_threshold_is_the_original_model_all(zoo_model, fc_compile, tmp_path, family, exporter):
    check_inf_equivalence(zoo_model, fc_compile, tmp_path, family, exporter)


# ----------------------------------------------------------------------------------------------- CLI errors
def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "fastcar_compile", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=300,
    )


def assert_clean_error(res: subprocess.CompletedProcess, *words: str) -> None:
    assert res.returncode == 2, f"exit {res.returncode}\nstdout: {res.stdout}\nstderr: {res.stderr}"
    assert "Traceback" not in res.stderr, res.stderr
    low = res.stderr.lower()
    assert any(w.lower() in low for w in words), f"message should name one of {words}: {res.stderr!r}"


def _save(model: onnx.ModelProto, path: Path) -> Path:
    model.ir_version = 10
    onnx.save(model, str(path))
    return path


def matmul_only_model(path: Path, with_kv: bool) -> Path:
    """A tiny MatMul model; with_kv adds present.0.key|value outputs that no attention produces."""
    w = helper.make_tensor("w", TensorProto.FLOAT, [8, 8], np.eye(8, dtype=np.float32).ravel().tolist())
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", 8])
    y = helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "s", 8])
    nodes = [helper.make_node("MatMul", ["x", "w"], ["logits"])]
    inputs, outputs = [x], [y]
    if with_kv:
        for kind in ("key", "value"):
            inputs.append(
                helper.make_tensor_value_info(
                    f"past_key_values.0.{kind}", TensorProto.FLOAT, ["b", 2, "p", 4]
                )
            )
            outputs.append(
                helper.make_tensor_value_info(f"present.0.{kind}", TensorProto.FLOAT, ["b", 2, "p", 4])
            )
            nodes.append(helper.make_node("Identity", [f"past_key_values.0.{kind}"], [f"present.0.{kind}"]))
    graph = helper.make_graph(nodes, "tiny", inputs, outputs, [w])
    return _save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)


@pytest.fixture(scope="module")
def real_model(zoo_model) -> Path:
    return zoo_model("llama", "dynamo20")


@pytest.fixture
def workdir(tmp_path: Path, real_model: Path) -> Path:
    (tmp_path / "model.onnx").write_bytes(real_model.read_bytes())
    return tmp_path


def _no_output_left(workdir: Path, keep: set[str]) -> None:
    left = {p.name for p in workdir.iterdir()} - keep
    assert not left, f"a failed compile left files behind: {sorted(left)}"


@pytest.mark.parametrize(
    "content,words",
    [
        (b"this is not an onnx model\n", ("onnx",)),
        (None, ("onnx", "truncated", "read")),  # None: the first half of a real model
    ],
    ids=["not-onnx", "truncated"],
)
def test_cli_rejects_unreadable_file(workdir, content, words):
    bad = workdir / "bad.onnx"
    data = (workdir / "model.onnx").read_bytes()
    bad.write_bytes(content if content is not None else data[: len(data) // 2])
    res = run_cli("bad.onnx", "-o", "fast.onnx", "--frame-tokens", "4", cwd=workdir)
    assert_clean_error(res, *words)
    _no_output_left(workdir, {"model.onnx", "bad.onnx"})


def test_cli_no_decoder_layer(workdir):
    matmul_only_model(workdir / "tiny.onnx", with_kv=True)
    res = run_cli("tiny.onnx", "-o", "fast.onnx", "--frame-tokens", "4", cwd=workdir)
    assert_clean_error(res, "layer")
    _no_output_left(workdir, {"model.onnx", "tiny.onnx"})


def test_cli_no_kv_cache_outputs(workdir):
    matmul_only_model(workdir / "tiny.onnx", with_kv=False)
    res = run_cli("tiny.onnx", "-o", "fast.onnx", "--frame-tokens", "4", cwd=workdir)
    assert_clean_error(res, "kv", "present")
    _no_output_left(workdir, {"model.onnx", "tiny.onnx"})


@pytest.mark.parametrize(
    "extra,words",
    [
        ([], ("frame-tokens", "frame_tokens")),
        (["--frame-tokens", "0"], ("frame-tokens", "frame_tokens")),
        (["--frame-tokens", "-3"], ("frame-tokens", "frame_tokens")),
        (["--frame-tokens", "4", "--layers", "x"], ("layers",)),
        (["--frame-tokens", "4", "--layers", "5"], ("layers", "layer")),
        (["--frame-tokens", "4", "--threshold", "nan"], ("threshold", "nan")),
    ],
    ids=[
        "frame-tokens-missing",
        "frame-tokens-0",
        "frame-tokens-negative",
        "layers-x",
        "layers-5",
        "threshold-nan",
    ],
)
def test_cli_bad_options(workdir, extra, words):
    before = sha256(workdir / "model.onnx")
    res = run_cli("model.onnx", "-o", "fast.onnx", *extra, cwd=workdir)
    assert_clean_error(res, *words)
    _no_output_left(workdir, {"model.onnx"})
    assert sha256(workdir / "model.onnx") == before


def test_cli_output_equal_to_input(workdir):
    before = sha256(workdir / "model.onnx")
    res = run_cli("model.onnx", "-o", "./model.onnx", "--frame-tokens", "4", cwd=workdir)
    assert_clean_error(res, "output", "input")
    assert sha256(workdir / "model.onnx") == before
    _no_output_left(workdir, {"model.onnx"})


def test_cli_compiles_and_leaves_input_byte_identical(workdir):
    before = sha256(workdir / "model.onnx")
    res = run_cli("model.onnx", "-o", "fast.onnx", "--frame-tokens", "4", "--threshold", "-1", cwd=workdir)
    assert res.returncode == 0, res.stderr
    assert sha256(workdir / "model.onnx") == before
    meta = {p.key: p.value for p in onnx.load(str(workdir / "fast.onnx")).metadata_props}
    assert meta["fastcar.frame_tokens"] == "4" and float(meta["fastcar.threshold"]) == -1.0
    _no_output_left(workdir, {"model.onnx", "fast.onnx"})


def test_float16_model_keeps_its_dtype(zoo_model, fc_compile, tmp_path):
    """A float16 export: MLP cache in float16, TAS in float32, and tau = +inf is still the original model."""
    src = zoo_model("llama", "dynamo20", "float16")
    out = tmp_path / "fast.onnx"
    fc_compile(str(src), output=str(out), frame_tokens=L, threshold=math.inf, emit_diagnostics=True)
    sess = ort_driver.make_session(out)
    ins = {i.name: i.type for i in sess.get_inputs()}
    outs = {o.name: o.type for o in sess.get_outputs()}
    for i in range(2):
        assert ins[f"past_mlp_cache.{i}"] == outs[f"present_mlp_cache.{i}"] == "tensor(float16)"
        assert ins[f"past_mlp_age.{i}"] == "tensor(int64)"
        assert outs[f"tas.{i}"] == "tensor(float)"
    steps = decode_steps()
    base = ort_driver.decode(src, steps, pad=PAD)
    fast = ort_driver.decode(sess, steps, pad=PAD)
    # ORT may fuse the MLP's ops differently once they sit in a branch: allow float16 rounding (2 ulp of the
    # largest logit).
    worst_ulps = 0.0
    for k, (b, f) in enumerate(zip(base.logits, fast.logits, strict=True)):
        assert f.dtype == np.float16
        m = real_mask(steps, PAD, k, aligned=False)
        ulp = float(np.spacing(np.abs(b[m]).max()))  # float16 spacing at the step's largest logit
        worst_ulps = max(
            worst_ulps, float((np.abs(f[m].astype(np.float32) - b[m].astype(np.float32)) / ulp).max())
        )
    assert worst_ulps <= 2.0, f"float16 logits differ by {worst_ulps:.1f} ulp"
    # TAS of a float16 model against the float32 reference: equal up to float16 rounding of q and k.
    with FastCarReference(zoo.build_model("llama"), frame_tokens=L, threshold=math.inf) as ref:
        want = ref.run(steps, pad=PAD)
    worst = 0.0
    for i in range(2):
        for k in range(len(steps)):
            m = real_mask(steps, PAD, k, aligned=True)
            if m.any():
                worst = max(worst, float(np.abs(fast.tas[i][k] - want.tas[i][k])[m].max()))
    assert worst <= 2e-2, f"float16 TAS differs from the float32 reference by {worst:.3g}"
