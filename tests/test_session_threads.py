"""One FastCarSession used from several threads at once, with the native kernels (their in-place buffers and IO
bindings): every thread's tokens equal the ones the same calls give one after the other on stock ONNX Runtime
(native=False: the model's function bodies, no binding), and the process survives.

The threaded runs happen in a child process (this file run as a script), so a heap corruption or a segfault
fails the test instead of killing pytest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

import fastcar_compile as fc

BUNDLED = os.path.join(os.path.dirname(fc.__file__), "demo", "assets", "decoder.onnx")
L = 64
THREADS, CALLS = 4, 6
VIDEO_START, TAU = (0, 2), (0.0, 0.5)  # of the two videos stepped in lockstep


def _prompt(i: int) -> list[list[int]]:
    return [[3 + i, 17 * i % 50 + 5, 9, 40 + i]]


def _generate_in_threads(path: str, max_length: int | None) -> dict:
    """THREADS threads x CALLS generate calls on one native session; tokens per thread and call."""
    from fastcar_compile.runtime import FastCarSession

    sess = FastCarSession(path, native=True, max_length=max_length)
    out: dict[int, list] = {i: [] for i in range(THREADS)}
    errors: list[str] = []
    go = threading.Barrier(THREADS)
    replayed = []

    def work(i: int) -> None:
        try:
            go.wait()
            for _ in range(CALLS):
                res = sess.generate(_prompt(i), 2, threshold=0.0)
                out[i].append(res.tokens.tolist())
                replayed.append(res.stats.replay_ratio)
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"tokens": out, "errors": errors, "replay": max(replayed, default=0.0)}


def _two_videos_in_lockstep(path: str) -> dict:
    """Two threads each step their own video (other video_start, other tau), meeting at a barrier before every
    step, so the steps of the two videos run on the same session at the same time."""
    from fastcar_compile.runtime import FastCarSession

    sess = FastCarSession(path, native=True)
    go = threading.Barrier(2)
    out: dict[int, list[int]] = {0: [], 1: []}
    errors: list[str] = []

    def work(i: int) -> None:
        try:
            ids = np.array(_prompt(i))
            st = sess.new_state(1, video_start=VIDEO_START[i])
            for _ in range(2 * L):
                go.wait()
                o = sess.step(st, ids, threshold=TAU[i])
                st = o.state
                ids = np.array([[int(np.argmax(o.logits[0, -1]))]])
                out[i].append(int(ids[0, 0]))
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            errors.append(f"{type(exc).__name__}: {exc}")
            go.abort()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"tokens": out, "errors": errors}


@pytest.fixture(scope="module")
def model(tmp_path_factory, native_lib):
    path = tmp_path_factory.mktemp("threads") / "fast.onnx"
    fc.compile(BUNDLED, path, frame_tokens=L, threshold=0.0)
    return path


def _child(*args: str) -> dict:
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, FASTCAR_QUIET="1"))
    assert proc.returncode == 0, f"child died with {proc.returncode}: {proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _sequential(path, max_length=None) -> dict[int, list]:
    """The same generate calls, one after the other, on stock ONNX Runtime (function bodies, no binding)."""
    from fastcar_compile.runtime import FastCarSession

    sess = FastCarSession(path, native=False)
    return {i: sess.generate(_prompt(i), 2, threshold=0.0).tokens.tolist() for i in range(THREADS)}


@pytest.mark.parametrize("max_length", [None, 160], ids=["growing-kv", "shared-kv-buffer"])
def test_threads_share_one_session(model, max_length):
    got = _child(str(model), "generate", str(max_length or 0))
    assert not got["errors"], got["errors"][:3]
    assert got["replay"] > 0  # the native in-place MLP cache was exercised
    want = _sequential(model)
    for i in range(THREADS):
        calls = got["tokens"][str(i)]
        assert len(calls) == CALLS
        for k, tokens in enumerate(calls):
            assert tokens == want[i], f"thread {i}, call {k}"


def test_two_videos_stepped_in_lockstep_from_two_threads(model):
    got = _child(str(model), "lockstep")
    assert not got["errors"], got["errors"][:3]
    from fastcar_compile.runtime import FastCarSession

    sess = FastCarSession(model, native=False)
    for i in range(2):  # one video after the other, greedy, stock ORT
        st, ids, want = sess.new_state(1, video_start=VIDEO_START[i]), np.array(_prompt(i)), []
        for _ in range(2 * L):
            o = sess.step(st, ids, threshold=TAU[i])
            st, ids = o.state, np.array([[int(np.argmax(o.logits[0, -1]))]])
            want.append(int(ids[0, 0]))
        assert got["tokens"][str(i)] == want, f"video {i}"


if __name__ == "__main__":
    import warnings

    warnings.simplefilter("ignore")
    path, mode = sys.argv[1], sys.argv[2]
    result = _generate_in_threads(path, int(sys.argv[3]) or None) if mode == "generate" else \
        _two_videos_in_lockstep(path)
    print(json.dumps(result))
