"""Memory over a long video: resident memory grows with the KV cache and nothing else.

Leaks this catches: keeping old states alive (growth ~ steps x state size, gigabytes here), or copying the
FastCar caches into Python each step. The bound allows ONNX Runtime's transient per-step copies of the KV
cache (Concat output, GQA expansion, arena slack): measured ~9x the KV size on the tiny llama model.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from fastcar_compile.runtime import FastCarSession

KV_FACTOR = 14.0
SLACK = 48 * 2**20


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def _growth(path, frames: int, L: int) -> tuple[float, float, FastCarSession]:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    s = FastCarSession(path, session_options=so, frame_tokens=L)
    rec: list[int] = []
    res = s.generate([[1, 2, 3]], frames, callback=lambda f, t: rec.append(_rss()), progress=False)
    assert res.stats.frames_done == frames
    kv = s.state_nbytes(1)["kv_per_token"] * L * (frames - 1)
    return float(rec[-1] - rec[0]), float(kv), s


def _check(path, frames: int, L: int) -> None:
    grown, kv, s = _growth(path, frames, L)
    print(s.describe_memory(1, frames * L), f"RSS grew {grown / 2**20:.1f} MiB for {kv / 2**20:.1f} MiB of KV")
    assert grown <= KV_FACTOR * kv + SLACK, (grown, kv)


def _fast(zoo_model, tmp_path, L: int):
    fc = pytest.importorskip("fastcar_compile")
    out = tmp_path / "fast.onnx"
    fc.compile(str(zoo_model("llama", "dynamo20")), str(out), frame_tokens=L, threshold=0.0)
    return out


def test_memory_grows_only_with_kv_short(zoo_model, tmp_path):
    _check(zoo_model("llama", "dynamo20"), 16, 64)
    _check(_fast(zoo_model, tmp_path, 64), 16, 64)  # FastCar state is fixed-size: no extra growth


@pytest.mark.slow
def test_memory_64_frames_of_256_tokens(zoo_model, tmp_path):
    _check(zoo_model("llama", "dynamo20"), 64, 256)
    _check(_fast(zoo_model, tmp_path, 256), 64, 256)


def test_state_size_reported_up_front(zoo_model):
    s = FastCarSession(zoo_model("llama", "dynamo20"), frame_tokens=8, threads=1)
    st = s.new_state(3)
    assert st.nbytes() == 0  # empty KV, no FastCar state on a dense model
    assert s.state_nbytes(3)["kv_per_token"] == 3 * 2 * 2 * 2 * 16 * np.dtype(np.float32).itemsize
