"""Compiled genai graphs run in onnxruntime-genai's own decode loop (`og.Generator`), genai unpatched.

Compiling a model that sits beside genai_config.json writes one beside the output and names the FastCar
state the way genai recycles it (passes/genai_state.py). References: genai's generator on the dense
model (tau = +inf), and FastCarSession on the same compiled file (finite tau); the finite-tau tokens must
also differ from dense ones, which they cannot unless genai carried the replay state between steps.
"""

from __future__ import annotations

import numpy as np
import pytest

og = pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (pip install '.[genai]')")
genai_zoo = pytest.importorskip("genai_zoo", reason="the genai graphs need torch and transformers")
from fastcar_compile.runtime import FastCarSession  # noqa: E402

L, N = 4, 24


def _genai_tokens(folder, prompt: np.ndarray, n: int) -> np.ndarray:
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=prompt.shape[1] + n, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(prompt.astype(np.int32))
    while not gen.is_done():
        gen.generate_next_token()
    return np.array([gen.get_sequence(b) for b in range(prompt.shape[0])])[:, prompt.shape[1]:]


def _session_tokens(path, prompt: np.ndarray, n: int) -> tuple[np.ndarray, float]:
    sess = FastCarSession(path)
    state, ids, toks, replayed, decided = sess.new_state(prompt.shape[0]), prompt.astype(np.int64), [], 0, 0
    for _ in range(n):
        out = sess.step(state, ids)
        state, ids = out.state, out.logits[:, -1].argmax(-1)[:, None].astype(np.int64)
        toks.append(ids[:, 0])
        if out.replay is not None:
            replayed, decided = replayed + int(out.replay.sum()), decided + out.replay.size
    return np.stack(toks, 1), replayed / max(decided, 1)


@pytest.mark.parametrize("family", ["llama", pytest.param("phi3", marks=pytest.mark.slow)])
def test_genai_generator_runs_fastcar(genai_model, fc_compile, tmp_path, family):
    src = genai_model(family, "fp32")
    prompt = np.random.default_rng(7).integers(3, genai_zoo.GENAI_VOCAB, (1, 5))
    dense = _genai_tokens(src, prompt, N)
    never, finite = tmp_path / "never", tmp_path / "finite"
    fc_compile(str(src / "model.onnx"), output=str(never / "fast.onnx"), frame_tokens=L, threshold=float("inf"))
    fc_compile(str(src / "model.onnx"), output=str(finite / "fast.onnx"), frame_tokens=L, threshold=0.0)
    assert (finite / "genai_config.json").is_file() and (finite / "tokenizer.json").is_file()
    np.testing.assert_array_equal(_genai_tokens(never, prompt, N), dense)
    want, ratio = _session_tokens(finite / "fast.onnx", prompt, N)
    assert 0 < ratio < 1, f"tau 0 must mix replay and compute (replay ratio {ratio:.2f})"
    got = _genai_tokens(finite, prompt, N)
    np.testing.assert_array_equal(got, want)
    assert (got != dense).any(), "replay changed nothing: genai did not carry the FastCar state"
