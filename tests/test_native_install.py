"""The README's install command gives the native kernels with no extra step (built on first use into the
user cache), says so at start, and says why in one line where they cannot be built."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SNIPPET = """
import sys
import numpy as np
from fastcar_compile.runtime import FastCarSession
s = FastCarSession(sys.argv[1], threads=1)
r = s.generate(np.array([[5, 17, 42]]), num_frames=2, threshold=0.0)
print("LIB", s.native_library, "STEPS", len(r.stats.steps))
"""


@pytest.fixture(scope="module")
def fast_model(zoo_model, tmp_path_factory) -> Path:
    import fastcar_compile as fc

    out = tmp_path_factory.mktemp("native") / "fast.onnx"
    fc.compile(str(zoo_model("llama", "dynamo20")), str(out), frame_tokens=4)
    return out


def _run(model: Path, **env: str) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k not in ("FASTCAR_NATIVE", "FASTCAR_QUIET")}
    e.update(env)
    return subprocess.run([sys.executable, "-c", SNIPPET, str(model)], capture_output=True, text=True, env=e,
                          timeout=600)


def test_kernels_in_use_after_install(fast_model):
    """Wherever a compiler and the headers (or npm to fetch them) exist, a plain session uses the kernels."""
    from fastcar_compile.runtime.native import build

    if shutil.which(os.environ.get("CXX", "g++")) is None:
        pytest.skip("no C++ compiler on this machine")
    if build.find_headers(fetch=False) is None and shutil.which("npm") is None:
        pytest.skip("no ORT headers and no npm to fetch them")
    r = _run(fast_model)
    assert r.returncode == 0, r.stderr
    assert "native ai.fastcar kernels in use" in r.stderr
    lib = r.stdout.split("LIB ", 1)[1].split()[0]
    assert lib != "None" and Path(lib).is_file() and str(build.CACHE_ROOT) in lib


def test_no_compiler_says_why_in_one_line(fast_model, tmp_path):
    """No compiler: one line naming the cause, and generation still works on the function bodies."""
    r = _run(fast_model, XDG_CACHE_HOME=str(tmp_path), PATH=str(tmp_path), CXX="")
    assert r.returncode == 0, r.stderr
    off = [ln for ln in r.stderr.splitlines() if "native kernels OFF" in ln]
    assert len(off) == 1 and "no C++ compiler" in off[0]
    assert "building" not in r.stderr  # nothing was built, so it does not say it is building
    assert "Traceback" not in r.stderr
    assert "LIB None STEPS 7" in r.stdout


def test_env_off_is_reported(fast_model):
    r = _run(fast_model, FASTCAR_NATIVE="0")
    assert "native kernels OFF (FASTCAR_NATIVE=0)" in r.stderr and "LIB None" in r.stdout
