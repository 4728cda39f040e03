"""No silent `video_start`: a default compile makes it an input every run feeds, so a plain ONNX Runtime session that
leaves it out is refused instead of running with 0 (with which a text prompt's MLP outputs would be replayed into
frame 0); `--video-start N` compiles N in for prompts whose video always starts there (docs/DESIGN.md)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from ort_driver import decode, initial_state

from fastcar_compile.cli import main

BUNDLED = Path(__file__).resolve().parents[1] / "fastcar_compile" / "demo" / "assets" / "decoder.onnx"
L = 64


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """The bundled decoder compiled by the CLI: by default, and with --video-start 3."""
    d = tmp_path_factory.mktemp("vs")
    for name, extra in (("default", []), ("baked", ["--video-start", "3"])):
        assert main([str(BUNDLED), "-o", str(d / f"{name}.onnx"), "--frame-tokens", str(L), "--threshold=-inf",
                     *extra]) == 0  # every eligible token replays
    return d


def _prompt_feeds(sess: ort.InferenceSession, ids: np.ndarray) -> dict[str, np.ndarray]:
    n = ids.shape[1]
    return {"input_ids": ids, "attention_mask": np.ones((1, n), np.int64),
            "position_ids": np.arange(n, dtype=np.int64)[None], **initial_state(sess, 1)}


def test_a_plain_session_without_video_start_is_refused(compiled):
    """A text prompt (3 tokens) then frame 0: the run that leaves video_start out fails and names it."""
    proto = onnx.load(str(compiled / "default.onnx"), load_external_data=False)
    assert "video_start" in [i.name for i in proto.graph.input]
    assert "video_start" not in [t.name for t in proto.graph.initializer]
    sess = ort.InferenceSession(str(compiled / "default.onnx"), providers=["CPUExecutionProvider"])
    ids = np.random.default_rng(0).integers(0, 64, (1, 3 + L)).astype(np.int64)
    with pytest.raises(Exception, match="video_start"):
        sess.run(None, _prompt_feeds(sess, ids))


def test_video_start_compiled_in_is_the_value_a_run_would_feed(compiled):
    """--video-start 3: an initializer (not an input), and a plain session that feeds nothing decodes a 3-token text
    prompt and a generated frame 0 exactly as the default compile fed video_start 3, and unlike one fed 0: there
    the last tokens of frame 0 replay MLP outputs the text prompt wrote (the trap a silent 0 was)."""
    proto = onnx.load(str(compiled / "baked.onnx"), load_external_data=False)
    assert "video_start" not in [i.name for i in proto.graph.input]
    init = {t.name: onnx.numpy_helper.to_array(t) for t in proto.graph.initializer}
    assert int(init["video_start"]) == 3
    rng = np.random.default_rng(1)
    steps = [rng.integers(0, 64, (1, 3)).astype(np.int64)] + \
        [rng.integers(0, 64, (1, 1)).astype(np.int64) for _ in range(L + 4)]
    baked = decode(compiled / "baked.onnx", steps)
    fed = decode(compiled / "default.onnx", steps, video_start=3)
    zero = decode(compiled / "default.onnx", steps, video_start=0)
    for a, b in zip(baked.logits, fed.logits, strict=True):
        np.testing.assert_array_equal(a, b)
    differs = [k for k, (a, b) in enumerate(zip(baked.logits, zero.logits, strict=True)) if not np.array_equal(a, b)]
    # step k feeds the token at KV index k + 2: those at L, L + 1, L + 2 are aligned with the three text tokens
    assert differs == [L - 2, L - 1, L]


def test_video_start_and_required_inputs_conflict(compiled, capsys):
    rc = main([str(BUNDLED), "-o", str(compiled / "x.onnx"), "--frame-tokens", str(L), "--video-start", "3",
               "--required-video-inputs"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "--video-start" in err and "--required-video-inputs" in err
    assert not (compiled / "x.onnx").exists()


@pytest.mark.parametrize("value", ["-1", "4294967296", "x"])
def test_video_start_out_of_range_is_one_line(compiled, capsys, value):
    with pytest.raises(SystemExit) if value == "x" else _no_exit():
        rc = main([str(BUNDLED), "-o", str(compiled / "y.onnx"), "--frame-tokens", str(L), f"--video-start={value}"])
        assert rc == 2
    err = capsys.readouterr().err
    assert "--video-start" in err and "Traceback" not in err
    assert not (compiled / "y.onnx").exists()


def _no_exit():
    import contextlib

    return contextlib.nullcontext()


def test_fastcar_session_feeds_video_start_from_the_prompt(compiled):
    """FastCarSession runs the default compile (it sets video_start from the prompt): at tau=+inf its tokens are
    the dense decoder's."""
    from fastcar_compile.runtime import FastCarSession

    prompts = np.random.default_rng(2).integers(0, 64, (2, 3 + L))
    fast = FastCarSession(compiled / "default.onnx", threads=1).generate(prompts, num_frames=1, threshold=np.inf,
                                                                        given_video_tokens=L, progress=False)
    dense = FastCarSession(BUNDLED, frame_tokens=L, threads=1).generate(prompts, num_frames=1, progress=False)
    np.testing.assert_array_equal(fast.tokens, dense.tokens)
