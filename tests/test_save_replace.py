"""Compiling over an earlier output: the .onnx rename is the only commit point, and afterwards the folder holds
exactly the files the new model reads (no stale data file from an earlier, larger compile)."""

from __future__ import annotations

import os
import types

import numpy as np
import onnx
import ort_driver
import pytest

import fastcar_compile as fc
from fastcar_compile.core.errors import FastCarError
from fastcar_compile.passes import save

L = 4


def _steps(seed: int = 0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 100, (2, 5))] + [rng.integers(0, 100, (2, 1)) for _ in range(L)]


def _data_files(path) -> set[str]:
    """External-data files `path` names, read with onnx (not the code under test)."""
    proto = onnx.load(str(path), load_external_data=False)
    return {e.value for t in proto.graph.initializer for e in t.external_data if e.key == "location"}


def _weights(path) -> dict[str, np.ndarray]:
    return {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}


def _compile(src, out, monkeypatch, external: bool):
    """Compile with the inline limit lowered (external data from a tiny model) or at its default (inline)."""
    monkeypatch.setattr(save, "INLINE_WEIGHTS_MAX", 0 if external else 16 << 20)
    fc.compile(src, out, frame_tokens=L, threshold=float("inf"))


def _check(src, out):
    """The folder holds the model and exactly the data it names; it decodes as the uncompiled model does."""
    assert sorted(os.listdir(out.parent)) == sorted({out.name} | _data_files(out))
    _decodes_as(src, out)


def _decodes_as(src, out):
    dense = ort_driver.decode(str(src), _steps(), pad=[0, 1])
    fast = ort_driver.decode(str(out), _steps(), pad=[0, 1], frame_tokens=L)
    for a, b in zip(dense.logits, fast.logits, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("order", [(True, False), (False, True), (True, True)],
                         ids=["large-then-small", "small-then-large", "large-twice"])
def test_recompile_leaves_only_the_new_models_files(zoo_model, tmp_path, monkeypatch, order):
    first, second = zoo_model("llama", "dynamo20"), zoo_model("qwen2", "dynamo20")
    out = tmp_path / "out" / "fast.onnx"
    _compile(first, out, monkeypatch, order[0])
    assert bool(_data_files(out)) == order[0]
    _check(first, out)
    _compile(second, out, monkeypatch, order[1])
    assert bool(_data_files(out)) == order[1]
    _check(second, out)


@pytest.mark.parametrize("crash", ["raise", "observe"])
def test_replacing_keeps_the_old_pair_until_the_model_rename(zoo_model, tmp_path, monkeypatch, crash):
    """Between the data rename and the .onnx rename (a kill there, or a concurrent reader) the old .onnx still
    reads its own weights; an error at the .onnx rename leaves the old pair as it was, nothing extra."""
    first, second = zoo_model("llama", "dynamo20"), zoo_model("qwen2", "dynamo20")
    out = tmp_path / "out" / "fast.onnx"
    _compile(first, out, monkeypatch, True)
    old_weights, old_files = _weights(out), sorted(os.listdir(out.parent))
    calls, seen = [], []

    def replace(a, b):
        calls.append((a, b))
        if len(calls) == 2:  # the second rename of the commit: the new data file is already in place
            seen.append(_weights(out))  # what a reader (or the folder after a kill) sees now
            if crash == "raise":
                raise OSError("simulated failure before the model rename")
        os.replace(a, b)

    monkeypatch.setattr(save, "os", types.SimpleNamespace(**{**{k: getattr(os, k) for k in dir(os)
                                                                if not k.startswith("__")}, "replace": replace}))
    if crash == "raise":
        with pytest.raises(FastCarError, match="simulated"):  # the CLI's one-line OS error
            _compile(second, out, monkeypatch, True)
    else:
        _compile(second, out, monkeypatch, True)
    assert len(calls) == 2 and seen and seen[0].keys() == old_weights.keys()
    for name, arr in old_weights.items():
        np.testing.assert_array_equal(seen[0][name], arr)
    if crash == "raise":
        assert sorted(os.listdir(out.parent)) == old_files
        _check(first, out)
    else:
        _check(second, out)


# ------------------------------------------------------------------ killed and concurrent saves, readers
BUNDLED = os.path.join(os.path.dirname(fc.__file__), "demo", "assets", "decoder.onnx")
FRAME = 64  # the bundled decoder's frame tokens


@pytest.fixture(scope="module")
def ext_sources(tmp_path_factory):
    """The bundled decoder twice (the second with one weight scaled: other logits), weights in external data, so
    every compiled output has a data file; and each compiled once into a folder of its own (the references)."""
    d = tmp_path_factory.mktemp("ext")
    paths = []
    for k, scale in enumerate((1.0, 1.5)):
        proto = onnx.load(BUNDLED)
        t = max(proto.graph.initializer, key=lambda t: t.ByteSize())
        t.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(t) * scale, t.name))
        (d / f"src{k}").mkdir()
        src = d / f"src{k}" / "model.onnx"
        onnx.save_model(proto, str(src), save_as_external_data=True, location="model.onnx.data", size_threshold=1024)
        ref = d / f"ref{k}" / "fast.onnx"
        fc.compile(src, ref, frame_tokens=FRAME, threshold=0.0)
        paths.append((src, ref))
    return paths


def _child(code: str, *args: str, wait: bool = True):
    import subprocess
    import sys

    cmd = [sys.executable, "-c", code, *args]
    if not wait:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


_COMPILE = "import sys, fastcar_compile as fc; fc.compile(sys.argv[1], sys.argv[2], frame_tokens=64, threshold=0.0)"
# killed (SIGKILL, no cleanup of any kind) between the data rename and the model rename of the commit
_KILLED_MID_COMMIT = """
import os, signal, sys
import fastcar_compile as fc
from fastcar_compile.passes import save
real, calls = os.replace, []
def replace(a, b):
    calls.append(b)
    real(a, b)
    if str(b).endswith('.data'):
        os.kill(os.getpid(), signal.SIGKILL)
save.os = type(os)('os_shim'); save.os.__dict__.update(os.__dict__); save.os.replace = replace
fc.compile(sys.argv[1], sys.argv[2], frame_tokens=64, threshold=0.0)
"""


def _same_model(ref, out):
    """`out` decodes as `ref` (the same source compiled into a folder of its own), by stock ONNX Runtime."""
    steps = [np.array([[5, 9, 13, 2]])] + [np.array([[k]]) for k in range(3)]
    for a, b in zip(ort_driver.decode(str(ref), steps, frame_tokens=FRAME).logits,
                    ort_driver.decode(str(out), steps, frame_tokens=FRAME).logits, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


def _only_the_model(out):
    assert sorted(os.listdir(out.parent)) == sorted({out.name} | _data_files(out))


def test_kill_9_mid_compile_leaves_nothing_after_the_next_run(ext_sources, tmp_path):
    """kill -9 while the compile stages its output (a `.fastcar-*` folder with the model and its data), and a
    replacing compile killed between its data rename and its model rename (an orphan data file): the next
    compile into that folder removes both, and leaves alone a staging folder a live run still holds."""
    import signal
    import time

    from fastcar_compile.core.locks import Owned

    (src0, ref0), (src1, ref1) = ext_sources
    out = tmp_path / "out" / "fast.onnx"
    out.parent.mkdir()
    proc = _child(_COMPILE, str(src0), str(out), wait=False)
    end = time.monotonic() + 300
    while not any(n.startswith(".fastcar-") for n in os.listdir(out.parent)):
        assert proc.poll() is None and time.monotonic() < end, "the compile ended before it staged anything"
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert any(n.startswith(".fastcar-") for n in os.listdir(out.parent))  # what the kill left

    fc.compile(src0, out, frame_tokens=FRAME, threshold=0.0)
    _only_the_model(out)
    r = _child(_KILLED_MID_COMMIT, str(src1), str(out))
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    orphans = [n for n in os.listdir(out.parent) if n.endswith(".data") and n not in _data_files(out)]
    assert orphans and any(n.startswith(".fastcar-") for n in os.listdir(out.parent))
    _same_model(ref0, out)  # the old pair still loads and decodes as before

    live = tmp_path / "out" / ".fastcar-live"  # a concurrent run's staging folder, its lock held
    live.mkdir()
    owner = Owned(live)
    try:
        fc.compile(src1, out, frame_tokens=FRAME, threshold=0.0)
        assert live.is_dir()
    finally:
        owner.release()
    assert sorted(os.listdir(out.parent)) == sorted({out.name, live.name} | _data_files(out))
    live.rmdir()
    _only_the_model(out)
    _same_model(ref1, out)


READER_IDS = [[5, 9, 13, 2]]
_READER = """
import sys, time, json
import numpy as np
from fastcar_compile.runtime import FastCarSession
out, done = sys.argv[1], sys.argv[2]
import os
ids = np.array(json.loads(sys.argv[3]))
loads, logits = 0, []
while not os.path.exists(done):
    s = FastCarSession(out, native=False)
    logits.append(s.step(s.new_state(1), ids).logits[0, -1].tolist())
    loads += 1
print(json.dumps(logits))
"""


def test_readers_never_see_a_half_replaced_model(ext_sources, tmp_path):
    """A process loading the output in a loop while another compiles over it again and again (the two sources
    in turn): every load succeeds and computes the logits of one of the two complete models, never of a mix
    (checked against stock ONNX Runtime on copies compiled apart)."""
    import json

    (src0, ref0), (src1, ref1) = ext_sources
    out = tmp_path / "out" / "fast.onnx"
    fc.compile(src0, out, frame_tokens=FRAME, threshold=0.0)
    done = tmp_path / "done"
    reader = _child(_READER, str(out), str(done), json.dumps(READER_IDS), wait=False)
    try:
        for k in range(4):
            r = _child(_COMPILE, str((src1, src0)[k % 2]), str(out))
            assert r.returncode == 0, r.stderr[-2000:]
    finally:
        done.touch()
    stdout, stderr = reader.communicate(timeout=600)
    assert reader.returncode == 0, stderr.decode()[-3000:]
    loads = json.loads(stdout.decode().strip().splitlines()[-1])
    assert len(loads) >= 4
    want = [ort_driver.decode(str(ref), [np.array(READER_IDS)], frame_tokens=FRAME).logits[0][0, -1]
            for ref in (ref0, ref1)]
    assert np.abs(want[0] - want[1]).max() > 1e-3  # the two models are told apart
    for k, got in enumerate(loads):
        assert min(np.abs(np.asarray(got) - w).max() for w in want) <= 1e-4, f"load {k} matches neither model"


_KILLED_WRITERS = """
import os, signal, sys
from pathlib import Path
from fastcar_compile.core.atomic import atomic_path
from fastcar_compile.core.fileio import staged_dir
folder, which = Path(sys.argv[1]), sys.argv[2]
if which == "atomic":
    with atomic_path(folder / "run.json") as tmp:
        tmp.write_text("half")
        os.kill(os.getpid(), signal.SIGKILL)
with staged_dir(folder / "pics") as tmp:
    (tmp / "a.png").write_bytes(b"half")
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_killed_writers_temp_entries_are_removed_by_the_next_write(tmp_path):
    """An atomic file write and a staged folder write (eval, report), each killed half-way with SIGKILL: the next
    write into the same folder removes what they left; an entry whose creator is alive is kept."""
    import signal

    from fastcar_compile.core.atomic import write_text
    from fastcar_compile.core.fileio import staged_dir
    from fastcar_compile.core.locks import Owned

    for which in ("atomic", "staged"):
        r = _child(_KILLED_WRITERS, str(tmp_path), which)
        assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    left = [p for p in [*tmp_path.iterdir(), *(tmp_path / "pics").iterdir()] if p.name.startswith(".")]
    assert len(left) == 2, left  # the temp file beside run.json, the temp folder inside pics/
    live = tmp_path / ".fastcar-live.json"
    live.write_text("a live run's")
    owner = Owned(live)
    try:
        write_text(tmp_path / "run.json", "{}")
        with staged_dir(tmp_path / "pics") as tmp:
            (tmp / "a.png").write_bytes(b"whole")
        assert sorted(p.name for p in tmp_path.iterdir()) == [live.name, "pics", "run.json"]
        assert [p.name for p in (tmp_path / "pics").iterdir()] == ["a.png"]
    finally:
        owner.release()


def test_a_file_system_without_flock_still_saves_and_sweeps_nothing(tmp_path, monkeypatch):
    """Where flock fails (ENOLCK: some network or FUSE file systems) saves go on unlocked, as before, and no temp
    entry is taken for a dead run's: whose it is cannot be told there."""
    import errno

    from fastcar_compile.core import locks

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(locks.fcntl, "flock", no_flock)
    out = tmp_path / "out" / "fast.onnx"
    (tmp_path / "out" / ".fastcar-other").mkdir(parents=True)
    fc.compile(BUNDLED, out, frame_tokens=FRAME, threshold=float("inf"))
    assert sorted(os.listdir(out.parent)) == sorted({".fastcar-other", out.name} | _data_files(out))
