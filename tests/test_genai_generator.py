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


def _genai_tokens(folder, prompt: np.ndarray, n: int, inputs: dict[str, np.ndarray] | None = None) -> np.ndarray:
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    # batch_size must be given: without it genai reads a [2, S] prompt as one row of 2S tokens
    params.set_search_options(max_length=prompt.shape[1] + n, do_sample=False, batch_size=prompt.shape[0])
    gen = og.Generator(model, params)
    for name, value in (inputs or {}).items():  # fed with every step of this generator (one video); genai
        gen.set_model_input(name, value)       # does not copy: `inputs` keeps the arrays alive meanwhile
    gen.append_tokens(prompt.astype(np.int32))
    while not gen.is_done():
        gen.generate_next_token()
    return np.array([gen.get_sequence(b) for b in range(prompt.shape[0])])[:, prompt.shape[1]:]


def _session_tokens(path, prompt: np.ndarray, n: int, tau: float | np.ndarray | None = None,
                    video_start: int = 0) -> tuple[np.ndarray, float]:
    sess = FastCarSession(path)
    state, ids, toks, replayed, decided = (sess.new_state(prompt.shape[0], video_start), prompt.astype(np.int64),
                                           [], 0, 0)
    for _ in range(n):
        out = sess.step(state, ids, threshold=tau)
        state, ids = out.state, out.logits[:, -1].argmax(-1)[:, None].astype(np.int64)
        toks.append(ids[:, 0])
        if out.replay is not None:
            replayed, decided = replayed + int(out.replay.sum()), decided + out.replay.size
    return np.stack(toks, 1), replayed / max(decided, 1)


@pytest.mark.parametrize("family", ["llama", pytest.param("phi3", marks=pytest.mark.slow),
                                    pytest.param("qwen3", marks=pytest.mark.slow)])
def test_genai_generator_runs_fastcar(genai_model, fc_compile, tmp_path, family):
    src = genai_model(family, "fp32")
    prompt = np.random.default_rng(7).integers(3, genai_zoo.GENAI_VOCAB, (1, 5))
    dense = _genai_tokens(src, prompt, N)
    never, finite = tmp_path / "never", tmp_path / "finite"
    # the prompt is all video: --video-start 0 compiles that in, so genai's generator needs no model input
    fc_compile(str(src / "model.onnx"), output=str(never / "fast.onnx"), frame_tokens=L, threshold=float("inf"),
               video_start=0)
    fc_compile(str(src / "model.onnx"), output=str(finite / "fast.onnx"), frame_tokens=L, threshold=0.0,
               video_start=0)
    assert (finite / "genai_config.json").is_file() and (finite / "tokenizer.json").is_file()
    np.testing.assert_array_equal(_genai_tokens(never, prompt, N), dense)
    want, ratio = _session_tokens(finite / "fast.onnx", prompt, N)
    assert 0 < ratio < 1, f"tau 0 must mix replay and compute (replay ratio {ratio:.2f})"
    got = _genai_tokens(finite, prompt, N)
    np.testing.assert_array_equal(got, want)
    assert (got != dense).any(), "replay changed nothing: genai did not carry the FastCar state"


def test_genai_generator_without_video_start_is_refused_and_takes_it_as_a_model_input(genai_model, fc_compile,
                                                                                       tmp_path):
    """A default compile (no --video-start): a generator that does not set video_start fails at its first step,
    naming it, instead of decoding with 0; one that sets it decodes as FastCarSession does with that value."""
    src = genai_model("llama", "fp32")
    prompt = np.random.default_rng(7).integers(3, genai_zoo.GENAI_VOCAB, (1, 5))
    out = tmp_path / "default" / "fast.onnx"
    fc_compile(str(src / "model.onnx"), output=str(out), frame_tokens=L, threshold=0.0)
    with pytest.raises(RuntimeError, match="video_start"):
        _genai_tokens(out.parent, prompt, N)
    start = np.array(3, np.int64)
    np.testing.assert_array_equal(_genai_tokens(out.parent, prompt, N, {"video_start": start}),
                                  _session_tokens(out, prompt, N, video_start=3)[0])


def test_genai_generator_takes_tau_and_video_start_per_video(genai_model, fc_compile, tmp_path):
    """Compiled with required_video_inputs, `fastcar_threshold` and `video_start` are plain graph inputs, which
    genai feeds from `generator.set_model_input` (once per generator = per video, then every step): each
    generator's tokens equal FastCarSession's with the same values, and the values change the tokens."""
    src = genai_model("llama", "fp32")
    prompt = np.random.default_rng(7).integers(3, genai_zoo.GENAI_VOCAB, (1, 5))
    dense = _genai_tokens(src, prompt, N)
    out = tmp_path / "perVideo" / "fast.onnx"
    fc_compile(str(src / "model.onnx"), output=str(out), frame_tokens=L, threshold=float("inf"),
               required_video_inputs=True)
    got = {}
    for tau, video_start in ((float("inf"), 0), (0.0, 0), (0.0, 3)):
        feeds = {"fastcar_threshold": np.array(tau, np.float32), "video_start": np.array(video_start, np.int64)}
        got[tau, video_start] = _genai_tokens(out.parent, prompt, N, feeds)
        want, ratio = _session_tokens(out, prompt, N, tau=tau, video_start=video_start)
        np.testing.assert_array_equal(got[tau, video_start], want)
        assert (ratio == 0) == (tau == float("inf"))
    np.testing.assert_array_equal(got[float("inf"), 0], dense)
    np.testing.assert_array_equal(_session_tokens(out, prompt, N)[0], dense)  # no tau given: the compiled one
    assert (got[0.0, 0] != dense).any() and (got[0.0, 3] != got[0.0, 0]).any()
    per_layer = tmp_path / "perLayer" / "fast.onnx"  # tau [layers]: only layer 0 may replay
    fc_compile(str(src / "model.onnx"), output=str(per_layer), frame_tokens=L, threshold=[float("inf")] * 2,
               per_layer_threshold=True, required_video_inputs=True)
    taus = np.array([0.0, np.inf], np.float32)
    one = _genai_tokens(per_layer.parent, prompt, N, {"fastcar_threshold": taus,
                                                      "video_start": np.array(0, np.int64)})
    np.testing.assert_array_equal(one, _session_tokens(per_layer, prompt, N, tau=taus)[0])
    assert (one != dense).any() and (one != got[0.0, 0]).any()


def test_genai_generator_equals_eager_reference(genai_model, fc_compile, tmp_path):
    """genai's own loop on a compiled folder (the native kernels it loads from genai_config.json, its shared KV
    buffers, the FastCar state in its recurrent-state slots), two videos at once, greedy over four frames: the
    tokens are those of the eager transformers model with FastCar hooked in (tests/reference.py) at a tau in a
    gap of layer 0's TAS, where the reference both replays and computes, and the tokens are not the dense ones."""
    from test_genai_graphs import VIDEO_START, _case
    from test_genai_graphs import L as REF_L

    src, tau, run = _case(genai_model, "llama", "fp32", "rope")
    replayed = np.concatenate([np.concatenate(run.replay[i][1:], axis=1) for i in run.replay], axis=1)
    assert replayed.any() and not replayed.all(), "the case must mix replay and compute"
    out = tmp_path / "video" / "fast.onnx"
    fc_compile(str(src), output=str(out), frame_tokens=REF_L, threshold=tau, max_replay=2,
               required_video_inputs=True)
    prompt = run.steps[0]
    feeds = {"fastcar_threshold": np.array(tau, np.float32), "video_start": np.array(VIDEO_START, np.int64)}
    got = _genai_tokens(out.parent, prompt, len(run.steps) - 1, feeds)
    np.testing.assert_array_equal(got, np.concatenate(run.steps[1:], axis=1))
    assert (got != _genai_tokens(src.parent, prompt, len(run.steps) - 1)).any(), "replay changed no token"
