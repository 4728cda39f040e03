"""The pictures' text says what the run did: the frame axis of replay.png says frame 0 never replays only when
nothing was given one frame back (a prompt ending in a given frame lets it replay), and tau prints with 4
significant digits, not 16."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import zoo

from fastcar_compile.runtime.stats import RunStats, format_tau

L = 8


@pytest.fixture(scope="module")
def fast(zoo_model, tmp_path_factory):
    import fastcar_compile as fc
    from fastcar_compile.runtime import FastCarSession

    path = tmp_path_factory.mktemp("labels") / "fast.onnx"
    fc.compile(str(zoo_model("llama", "dynamo20")), str(path), frame_tokens=L, threshold=0.0)
    return FastCarSession(path, threads=1)


@pytest.mark.parametrize("given", [0, 3, L])
def test_frame_axis_label_matches_frame_0_replay(fast, given):
    """tau = -1e9 replays every eligible step: generated frame 0 replays exactly at its tokens whose aligned
    token (one frame back) was given video, counted from the trace; the label says the same."""
    prompt = np.random.default_rng(1).integers(0, zoo.VOCAB, (1, 3 + given))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stats = fast.generate(prompt, 2, threshold=-1e9, given_video_tokens=given).stats
    frame0 = stats.per_token_replay()[0]
    assert frame0.tolist() == [1.0 if t >= L - given else 0.0 for t in range(L)]  # aligned token given?
    label = stats.frame_axis_label()
    if given == 0:
        assert "frame 0 never replays" in label
    elif given == L:
        assert "never" not in label and "frame 0 replays against the given frame" in label
    else:
        assert f"the first {L - given} tokens of frame 0 never replay" in label


def test_tau_has_four_digits():
    assert format_tau(35.646812345678) == "35.65"
    assert format_tau([0.000123456, float("inf")]) == "[0.0001235, inf]"
    s = RunStats(model="m", fastcar=True, frame_tokens=4, layers=[0], batch=1, video_start=0, num_frames=2,
                 threshold=35.646812345678).finalize()
    assert s.tau_text == "35.65" and "35.646" not in s.summary()
