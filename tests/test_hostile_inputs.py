"""Hostile-but-fair inputs through the real CLI: exit code, no traceback, nothing left behind,
every input byte-identical and no file sharing an inode with another.

The cases are data (tests/hostile_cases.py). Each runs through `fastcar_compile.cli.main`, the function the
`fastcar-compile` console script calls; a representative set also runs through the installed console script
in a subprocess. `python tests/hostile_cases.py` prints the totals of the closing note.
"""

from __future__ import annotations

import errno
import os
import shutil
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


def _console(*argv: str, **kw) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("fastcar-compile")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "fastcar_compile"]
    return subprocess.run([*cmd, *argv], capture_output=True, text=True, timeout=300, **kw)


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc")
def test_output_through_a_link_to_stdout_is_refused(sandbox, tmp_path):
    """-o a symlink to /proc/self/fd/1 (here a pipe): refused, the link stays a link, nothing is written."""
    link = tmp_path / "out.onnx"
    os.symlink("/proc/self/fd/1", link)
    proc = _console(str(sandbox / "model.onnx"), "-o", str(link), "--frame-tokens", str(hc.L))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "FIFO" in proc.stderr and proc.stdout == ""
    assert os.readlink(link) == "/proc/self/fd/1" and sorted(p.name for p in tmp_path.iterdir()) == ["out.onnx"]


@pytest.fixture
def tmpfs(tmp_path):
    """A mount point for a small tmpfs (root with mount rights only); unmounted afterwards."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()

    def mount(size: int) -> Path:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True)
        if r.returncode:
            pytest.skip("cannot mount a tmpfs here (needs root with mount rights)")
        return mnt

    yield mount
    subprocess.run(["umount", str(mnt)], capture_output=True)


def test_full_disk_errors_name_the_path_and_leave_nothing(sandbox, tmpfs):
    """On a real full file system (an 8 KiB tmpfs): report's pictures and a compiled model do not fit; the one
    error line names where it was writing, and nothing is left on the file system."""
    mnt = tmpfs(8 << 10)
    for argv, where in ((["report", str(sandbox / "run.json"), "-o", str(mnt / "pics")], mnt / "pics"),
                        ([str(sandbox / "model.onnx"), "-o", str(mnt / "fast.onnx"), "--frame-tokens", str(hc.L)],
                         mnt / "fast.onnx")):
        o = hc.run_case(hc.Case("full", lambda d, a=argv: a), sandbox)
        assert o.rc == 2 and not o.traceback, o.stderr
        assert "no space left" in o.stderr and str(where) in o.stderr, o.stderr
        assert list(mnt.iterdir()) == []


def test_full_disk_during_the_genai_files_leaves_no_model(sandbox, tmp_path, tmpfs):
    """The tokenizer copy beside the output fills the disk: before, fast.onnx stayed there without its config;
    now the model, the config and the tokenizer copies are one unit and none of them appears."""
    src = tmp_path / "genai"
    shutil.copytree(sandbox / "genai_ok", src, symlinks=False)
    (src / "tokenizer.model").write_bytes(np.random.default_rng(0).bytes(4 << 20))  # does not compress
    probe = tmp_path / "probe" / "fast.onnx"
    assert hc.run_case(hc.Case("probe", lambda d: [str(src / "model.onnx"), "-o", str(probe), "--frame-tokens",
                                                    str(hc.L), "--no-genai"]), sandbox).rc == 0
    mnt = tmpfs(probe.stat().st_size + (2 << 20))  # room for the model, not for model + tokenizer
    o = hc.run_case(hc.Case("full", lambda d: [str(src / "model.onnx"), "-o", str(mnt / "fast.onnx"),
                                               "--frame-tokens", str(hc.L)]), sandbox)
    assert o.rc == 2 and not o.traceback and "no space left" in o.stderr, o.stderr
    assert list(mnt.iterdir()) == []


def test_genai_output_replaced_as_one_unit(sandbox, tmp_path, monkeypatch):
    """Recompiling into a genai output folder whose model rename fails: the earlier genai_config.json is put
    back, the earlier model stays, and no staged file is left."""
    out = tmp_path / "g" / "fast.onnx"
    argv = [str(sandbox / "genai_ok" / "model.onnx"), "-o", str(out), "--frame-tokens", str(hc.L)]
    from fastcar_compile.cli import main

    assert main(argv) == 0
    (out.parent / "genai_config.json").write_text('{"earlier": true}')  # marks the earlier output's config
    before = {p.name: p.read_bytes() for p in out.parent.iterdir()}
    real = os.replace

    def fail_model(src, dst, *a, **k):
        if str(dst) == str(out):
            raise OSError(errno.EIO, "input/output error", str(dst))
        return real(src, dst, *a, **k)

    monkeypatch.setattr(os, "replace", fail_model)
    assert main(argv + ["--threshold", "0"]) == 2
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in out.parent.iterdir()} == before


def _start_and_wait(argv: list[str], marker: str, timeout: float = 180) -> tuple[subprocess.Popen, list[str]]:
    """Start the console script with `argv`; return once `marker` appeared on its stderr (collected meanwhile)."""
    import threading

    exe = Path(sys.executable).with_name("fastcar-compile")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "fastcar_compile"]
    proc = subprocess.Popen([*cmd, *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    chunks: list[str] = []
    threading.Thread(target=lambda: chunks.extend(iter(lambda: proc.stderr.read1(4096).decode(errors="replace"),
                                                       "")), daemon=True).start()
    end = time.monotonic() + timeout
    while marker not in "".join(chunks):
        if proc.poll() is not None or time.monotonic() > end:
            proc.kill()
            pytest.fail(f"never saw {marker!r}: {''.join(chunks)[-2000:]}")
        time.sleep(0.02)
    return proc, chunks


@pytest.mark.parametrize("delay", [0.2, 1.5])
def test_ctrl_c_during_eval_exits_130_quietly(sandbox, tmp_path, delay):
    """SIGINT while `eval --model` generates (the runtime returns the tokens made so far to an API caller; eval's
    figures would be wrong, and comparing partial runs raised a ValueError): exit 130, the one line, no traceback,
    nothing written."""
    # enough work that the signal lands while eval generates (8 prompts x 4 frames took ~1 s on an idle machine)
    np.save(tmp_path / "p.npy", np.random.default_rng(0).integers(1, 50, (256, 4)))
    out = tmp_path / "eval"
    proc, chunks = _start_and_wait(["eval", "--model", str(sandbox / "fast.onnx"), "--prompts", str(tmp_path / "p.npy"),
                                    "--frames", "8", "--out", str(out)], "fastcar-compile: native")  # the session loaded
    time.sleep(delay)
    assert proc.poll() is None, "eval ended before the signal: the test measures nothing"
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=120)
    err = "".join(chunks)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err and "Error" not in err, err[-2000:]
    assert err.strip().splitlines()[-1] == "fastcar-compile: interrupted"
    assert not out.exists() or not any(out.iterdir())


def test_runtime_api_refuses_a_fifo_as_model_or_prompts(sandbox):
    """The runtime API (no CLI checks before it) names a FIFO as one instead of calling it missing."""
    from fastcar_compile.core.errors import FastCarError
    from fastcar_compile.runtime import FastCarSession
    from fastcar_compile.runtime.calibrate import calibrate_threshold

    fifo = sandbox / "special" / "fifo"
    with pytest.raises(FastCarError, match="named pipe"):
        FastCarSession(fifo)
    with pytest.raises(FastCarError, match="named pipe"):
        calibrate_threshold(sandbox / "fast.onnx", fifo, num_frames=2, target_replay=0.3)


def test_session_reads_genai_head_size_through_the_bounded_reader(tmp_path):
    """A genai graph's symbolic head size comes from genai_config.json beside it: a 100,000-deep file is named
    in one line (json.loads raised RecursionError), a config without the field gives no size."""
    import json

    from fastcar_compile.core.errors import FastCarError
    from fastcar_compile.runtime.session import FastCarSession

    session = FastCarSession.__new__(FastCarSession)  # only the path matters to this reader
    session.path = tmp_path / "model.onnx"
    cfg = tmp_path / "genai_config.json"
    cfg.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(FastCarError, match="nests"):
        session._genai_head_size()
    cfg.write_text(json.dumps(hc.GENAI_CONFIG))
    assert session._genai_head_size() == hc.GENAI_CONFIG["model"]["decoder"]["head_size"]
    cfg.write_text('{"model": {"type": "llama"}}')
    assert session._genai_head_size() is None
