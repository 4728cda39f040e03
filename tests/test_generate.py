"""`fastcar-compile generate`: many videos from one model, in this process and on a local Ray cluster the test
starts (2 CPUs, a small object store, shut down by the fixture). Each video equals the eager PyTorch rollout of
the same prompt and seed (the DiT) or the session's own generate (the decoder); a resumed run renders only what
is missing; an actor killed mid-run has its videos retried and every video is written exactly once."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxruntime")

from dit_modes_helpers import refusal  # noqa: E402

from fastcar_compile.cli import main  # noqa: E402
from fastcar_compile.dit.config import PRESETS  # noqa: E402
from fastcar_compile.dit.stream import StreamSettings, TorchDiT, rollout  # noqa: E402
from fastcar_compile.many_videos import generate_many, video_path  # noqa: E402

CFG = PRESETS["tiny"]


def prompts(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 3, CFG.text_dim)).astype(np.float32)


def video(out: Path, i: int) -> tuple[np.ndarray, dict]:
    with np.load(video_path(out, i)) as z:
        return z["latent"], json.loads(str(z["trace"]))


def eager(model, prompt: np.ndarray, frames: int, seed: int) -> np.ndarray:
    res = list(rollout(TorchDiT(model), StreamSettings(frames=frames, seed=seed), prompt))
    return np.concatenate([r.frames for r in res], axis=1)[:, :frames]


def test_in_process_videos_equal_eager_rollouts_and_resume(dit_tiny_export, dit_tiny_eager, tmp_path, capsys):
    p = tmp_path / "p.npy"
    np.save(p, prompts(3))
    out = tmp_path / "out"
    assert main(["generate", str(dit_tiny_export), "--prompts", str(p), "--frames", "4", "-o", str(out),
                 "--seed", "10"]) == 0
    assert "wrote 3 video(s)" in capsys.readouterr().out
    for i in range(3):
        lat, trace = video(out, i)
        np.testing.assert_allclose(lat, eager(dit_tiny_eager, prompts(3)[i], 4, 10 + i), atol=1e-4, rtol=0)
        assert trace["seed"] == 10 + i and len(trace["frame_ms"]) == 4 and trace["worker"]["model_loads"] == 1
    first = video_path(out, 0).stat().st_mtime_ns
    video_path(out, 1).unlink()
    s = generate_many(dit_tiny_export, prompts(3), 4, out, seed=10)
    assert (s["rendered"], s["skipped"]) == (1, 2)
    assert video_path(out, 0).stat().st_mtime_ns == first
    np.testing.assert_allclose(video(out, 1)[0], eager(dit_tiny_eager, prompts(3)[1], 4, 11), atol=1e-4, rtol=0)
    summary = json.loads((out / "generate.json").read_text())
    assert [r["index"] for r in summary["records"]] == [1]


def test_decoder_videos_equal_the_sessions_generate(tmp_path):
    from fastcar_compile.demo.export import ONNX
    from fastcar_compile.runtime import FastCarSession

    ids = np.random.default_rng(1).integers(0, 100, (2, 5))
    s = generate_many(ONNX, ids, 2, tmp_path / "o", frame_tokens=64)
    assert s["rendered"] == 2
    want = FastCarSession(ONNX, frame_tokens=64, threads=1).generate(ids, num_frames=2, progress=False).tokens
    for i in range(2):
        with np.load(video_path(tmp_path / "o", i)) as z:
            np.testing.assert_array_equal(z["tokens"], want[i])
            assert json.loads(str(z["trace"]))["frames_done"] == 2


def test_bad_input_is_one_line(dit_tiny_export, tmp_path, capsys, monkeypatch):
    p = tmp_path / "p.npy"
    np.save(p, np.zeros((2, 3), np.int64))
    argv = ["generate", str(dit_tiny_export), "--prompts", str(p), "--frames", "2", "-o", str(tmp_path / "o")]
    assert f"[videos, tokens, {CFG.text_dim}]" in refusal(argv, capsys)
    assert "--actors needs --ray" in refusal([*argv, "--actors", "2"], capsys)
    import sys

    monkeypatch.setitem(sys.modules, "ray", None)
    assert "pip install 'fastcar-compile[ray]'" in refusal([*argv, "--ray"], capsys)


# ---- on Ray ----

@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.data")
    import logging

    ray.init(num_cpus=2, object_store_memory=100 << 20, include_dashboard=False, log_to_driver=False,
             logging_level=logging.ERROR)
    yield ray
    ray.shutdown()


def _descendants(pid: int) -> list[int]:
    """Processes under `pid` (the Ray processes this test's cluster started)."""
    parents = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as fh:
                    parents[int(d)] = int(fh.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        out += kids
        todo += kids
    return out


def _renderer_actors() -> list[int]:
    found = []
    for p in _descendants(os.getpid()):
        try:
            with open(f"/proc/{p}/cmdline", "rb") as fh:
                if b"VideoRenderer" in fh.read():
                    found.append(p)
        except OSError:
            continue
    return found


def test_ray_actors_render_what_the_loop_renders(ray_cluster, dit_tiny_export, tmp_path):
    p = prompts(5, seed=2)
    loop = generate_many(dit_tiny_export, p, 4, tmp_path / "loop", seed=3)
    s = generate_many(dit_tiny_export, p, 4, tmp_path / "ray", seed=3, ray=True, actors=2)
    assert (loop["rendered"], s["rendered"]) == (5, 5)
    pids = set()
    for i in range(5):
        (a, _), (b, tb) = video(tmp_path / "loop", i), video(tmp_path / "ray", i)
        np.testing.assert_allclose(b, a, atol=1e-5, rtol=0)
        assert tb["worker"]["model_loads"] == 1  # each actor loaded the model once
        pids.add(tb["worker"]["pid"])
    assert os.getpid() not in pids and 1 <= len(pids) <= 2
    again = generate_many(dit_tiny_export, p, 4, tmp_path / "ray", seed=3, ray=True, actors=2)
    assert (again["rendered"], again["skipped"]) == (0, 5)


def test_a_killed_actors_videos_are_retried_once(ray_cluster, dit_tiny_export, dit_tiny_eager, tmp_path):
    n, frames = 10, 24
    p = prompts(n, seed=4)
    out = tmp_path / "ray"
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(generate_many(
        dit_tiny_export, p, frames, out, seed=0, ray=True, actors=2)))
    worker.start()
    killed = None
    deadline = time.monotonic() + 120
    while killed is None and worker.is_alive() and time.monotonic() < deadline:
        actors = _renderer_actors()
        if actors and list((out / "videos").glob("*.npz")):  # mid-run: a video written, more to come
            killed = actors[0]
            os.kill(killed, signal.SIGKILL)
        time.sleep(0.05)
    worker.join(300)
    assert killed is not None, "the run ended before an actor could be killed"
    assert not worker.is_alive() and result["videos"] == n
    assert sorted(r["index"] for r in result["records"]) == list(range(n))  # each video reported once
    # a retried video: rendered again and committed once ("exists": the killed actor's commit won), or found
    # already committed by the killed actor before it could report ("skipped")
    assert {r["status"] for r in result["records"]} <= {"written", "exists", "skipped"}
    files = sorted((out / "videos").iterdir())
    assert [f.name for f in files] == [f"{i:05d}.npz" for i in range(n)]  # nothing lost, no temp file left
    pids = set()
    for i in range(n):
        lat, trace = video(out, i)
        pids.add(trace["worker"]["pid"])
        np.testing.assert_allclose(lat, eager(dit_tiny_eager, p[i], frames, i), atol=1e-4, rtol=0)
    assert killed not in _renderer_actors()
    assert len(pids - {killed}) >= 1
