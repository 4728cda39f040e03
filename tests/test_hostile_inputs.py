"""Hostile-but-fair inputs through the real CLI (issue 9): exit code, no traceback, nothing left behind,
every input byte-identical and no file sharing an inode with another.

The cases are data (tests/hostile_cases.py). Each runs through `fastcar_compile.cli.main`, the function the
`fastcar-compile` console script calls; a representative set also runs through the installed console script
in a subprocess. `python tests/hostile_cases.py` prints the totals of the closing note.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import hostile_cases as hc
import numpy as np
import onnx
import pytest

CASES = hc.cases()
SUBPROCESS = [c for c in CASES if c.subprocess]


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory) -> Path:
    root = hc.build_sandbox(tmp_path_factory.mktemp("hostile") / "sandbox")
    before = hc.snapshot(root)
    yield root
    assert hc.snapshot(root) == before  # nothing of the inputs changed over the whole module


def test_there_are_enough_cases():
    assert len(CASES) >= 60 and len(SUBPROCESS) >= 8


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_case_in_process(case, sandbox):
    o = hc.run_case(case, sandbox)
    assert not hc.problems(case, o), (hc.problems(case, o), o.stderr[-2000:])
    if case.exit == 2:
        assert o.stderr.strip(), "a rejection must say why"


@pytest.mark.parametrize("case", SUBPROCESS, ids=[c.name for c in SUBPROCESS])
def test_case_through_the_console_script(case, sandbox):
    o = hc.run_case(case, sandbox, in_subprocess=True)
    assert not hc.problems(case, o), (hc.problems(case, o), o.stderr[-2000:])
    if case.exit == 2:  # one line (argparse usage aside), prefixed by the program name
        assert [ln for ln in o.stderr.splitlines() if ln.startswith("fastcar-compile: error:")], o.stderr


def test_external_data_compile_leaves_two_loadable_independent_models(sandbox, tmp_path):
    """The output's data is a copy: both models load with onnx.load (which refuses hard-linked data) and
    a later in-place write to one data file leaves the other as it was."""
    src = sandbox / "ext" / "model.onnx"
    out = tmp_path / "fast.onnx"
    from fastcar_compile.cli import main

    assert main([str(src), "-o", str(out), "--frame-tokens", str(hc.L)]) == 0
    a, b = onnx.load(str(src)), onnx.load(str(out))  # both load, external data included
    data_in, data_out = sandbox / "ext" / "model.onnx.data", tmp_path / "fast.onnx.data"
    assert os.stat(data_in).st_ino != os.stat(data_out).st_ino and os.stat(data_in).st_nlink == 1
    ref = {t.name: onnx.numpy_helper.to_array(t) for t in a.graph.initializer}
    for t in b.graph.initializer:
        if t.name in ref:
            np.testing.assert_array_equal(onnx.numpy_helper.to_array(t), ref[t.name])
    before = data_in.read_bytes()
    with open(data_out, "r+b") as f:  # an in-place edit of the output's weights
        f.write(b"\xff" * 64)
    assert data_in.read_bytes() == before


def _wait_for_library(pid: int, name: str, timeout: float = 30) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if name in Path(f"/proc/{pid}/maps").read_text():
                return True
        except OSError:
            return False
        time.sleep(0.005)
    return False


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc to see the child's imports")
def test_ctrl_c_while_importing_exits_130_quietly(sandbox):
    """SIGINT once the child is loading onnx (the heavy imports of the first second): exit 130, no traceback."""
    exe = Path(sys.executable).with_name("fastcar-compile")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "fastcar_compile"]
    proc = subprocess.Popen([*cmd, str(sandbox / "model.onnx"), "--inspect"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    if not _wait_for_library(proc.pid, "onnx"):
        proc.kill()
        pytest.fail("the child never loaded onnx")
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (proc.returncode, err)
    assert "Traceback" not in err and err.strip() == "fastcar-compile: interrupted"


def test_ctrl_c_inside_a_subcommand_import(monkeypatch, capsys):
    import importlib

    from fastcar_compile import cli

    def interrupted(name, *a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(importlib, "import_module", interrupted)
    assert cli.main(["sim", "x.fcb"]) == 130
    assert "Traceback" not in capsys.readouterr().err
