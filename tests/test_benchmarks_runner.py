"""`python -m benchmarks`: a suite's result folder holds result.json (figures + provenance), table.md and plot.png,
the index lists every suite folder, and bad arguments end in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def test_result_folder_and_index(tmp_path):
    import importlib

    import harness
    from suites import SUITES

    sys.path.insert(0, str(ROOT))
    runner = importlib.import_module("benchmarks.__main__")
    raw = [{"config": "dense", "replay": 0.0, "ms_per_step": 46.4, "x_dense": 1.0, "bound": "bandwidth", "paper": ""},
           {"config": "FastCar 87%", "replay": 0.875, "ms_per_step": 20.7, "x_dense": 2.24, "bound": "bandwidth",
            "paper": "1.76"}]
    prov = harness.provenance("quick", ["fpga", "--size", "quick"])
    folder = runner.present(SUITES["fpga"], raw, "quick", prov, 12.0, tmp_path)
    assert sorted(p.name for p in folder.iterdir()) == ["plot.png", "result.json", "table.md"]
    data = json.loads((folder / "result.json").read_text())
    assert data["raw"] == raw and data["size"] == "quick" and [r["config"] for r in data["rows"]] == ["dense", "FastCar 87%"]
    p = data["provenance"]
    assert p["command"] == "python -m benchmarks fpga --size quick" and p["commit"]
    assert p["machine"]["versions"]["onnxruntime"] and p["machine"]["logical_cpus"] >= 1
    table = (folder / "table.md").read_text()
    assert "| FastCar 87% | 88% | 20.7 | 2.24 | bandwidth | 1.76 |" in table and p["commit"] in table
    assert (folder / "plot.png").read_bytes()[:4] == b"\x89PNG"
    index = (tmp_path / "README.md").read_text()
    assert "[fpga](fpga/table.md)" in index and "`quick`" in index


def test_list_and_bad_suite():
    listed = _run("--list")
    assert listed.returncode == 0 and {ln.split()[0] for ln in listed.stdout.splitlines()} >= {"walk", "genai", "fpga"}
    bad = _run("no-such-suite")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "unknown suite no-such-suite" in bad.stderr
    assert "Traceback" not in bad.stderr


@pytest.mark.parametrize("size", ["default", "quick"])
def test_every_suite_script_exists_for_every_size(size):
    from suites import SUITES

    for suite in SUITES.values():
        assert (ROOT / "benchmarks" / suite.script).is_file(), suite.name
        assert size in suite.sizes, suite.name


def test_benchmarks_holds_suites_and_what_they_import():
    """benchmarks/ holds the runner, the suites' scripts and the modules they import; every other measurement is a
    study in benchmarks/experiments/."""
    import re

    from suites import SUITES

    top = {p.name for p in (ROOT / "benchmarks").glob("*.py")}
    scripts = {s.script for s in SUITES.values()}
    imported = {f"{m}.py" for s in scripts
                for m in re.findall(r"^\s*(?:from|import) (\w+)", (ROOT / "benchmarks" / s).read_text(), re.M)}
    runner = {"__init__.py", "__main__.py", "harness.py", "suites.py"}
    assert top - scripts - imported - runner == set()


def test_every_study_is_described():
    """docs/benchmarks.md's study table names every script of benchmarks/experiments/, and nothing else."""
    import re

    text = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"^\| `(\w+\.py)` \|", text[text.index("## Studies"):], re.M))
    assert listed == {p.name for p in (ROOT / "benchmarks" / "experiments").glob("*.py")}


def test_results_hold_default_runs_of_existing_suites():
    """results/ publishes each suite's default size (a smoke run is not a figure) and no folder of a suite that is
    gone; the index lists every folder."""
    from suites import SUITES

    folders = {p.parent.name: json.loads(p.read_text()) for p in (ROOT / "results").glob("*/result.json")}
    assert set(folders) <= set(SUITES)
    assert {name: d["size"] for name, d in folders.items() if d["size"] != "default"} == {}
    index = (ROOT / "results" / "README.md").read_text()
    assert [name for name in folders if f"[{name}]({name}/table.md)" not in index] == []


def test_a_size_a_suite_lacks_is_one_line():
    r = _run("dit-fastar", "--size", "full")
    assert r.returncode == 2
    assert r.stderr.strip() == "error: suite dit-fastar has no size 'full'; it has default, quick"


# ------------------------------------------------------------------------------ bad output paths, Ctrl-C
def _fpga_result(out: Path) -> Path:
    """A real fpga result folder under `out` (the runner's own writer), for --retable and for byte checks."""
    import importlib

    import harness
    from suites import SUITES

    sys.path.insert(0, str(ROOT))
    runner = importlib.import_module("benchmarks.__main__")
    raw = [{"config": "dense", "replay": 0.0, "ms_per_step": 46.4, "x_dense": 1.0, "bound": "bandwidth", "paper": ""}]
    return runner.present(SUITES["fpga"], raw, "quick", harness.provenance("quick", ["fpga"]), 1.0, out)


def _tree(root: Path) -> dict[str, bytes | str]:
    import stat

    out: dict[str, bytes | str] = {}
    for p in sorted(root.rglob("*")):
        mode = p.lstat().st_mode
        out[str(p.relative_to(root))] = p.read_bytes() if stat.S_ISREG(mode) else oct(mode)
    return out


def _bad_out(kind: str, tmp: Path) -> tuple[list[str], str]:
    """(runner argv, a word the one-line refusal must hold) for an output path that cannot take the results."""
    import os

    if kind == "out is a file":
        (tmp / "f").write_text("x")
        return ["fpga", "--size", "quick", "--out", str(tmp / "f")], "not a folder"
    if kind == "out is a FIFO":
        os.mkfifo(tmp / "p")
        return ["fpga", "--size", "quick", "--out", str(tmp / "p")], "FIFO"
    if kind == "out is missing":
        return ["fpga", "--size", "quick", "--out", str(tmp / "nope")], "no such folder"
    if kind == "table.md is a folder":
        _fpga_result(tmp)
        (tmp / "fpga" / "table.md").unlink()
        (tmp / "fpga" / "table.md").mkdir()
        return ["fpga", "--size", "quick", "--out", str(tmp)], "table.md"
    if kind == "the index is a folder":
        _fpga_result(tmp)
        (tmp / "README.md").unlink()
        (tmp / "README.md").mkdir()
        return ["fpga", "--size", "quick", "--out", str(tmp)], "README.md"
    if kind == "retable, result.json missing":
        return ["fpga", "--retable", "--out", str(tmp)], "missing"
    if kind == "retable, result.json not JSON":
        _fpga_result(tmp)
        (tmp / "fpga" / "result.json").write_text("{broken")
        return ["fpga", "--retable", "--out", str(tmp)], "not valid JSON"
    if kind == "retable, result.json of another shape":
        _fpga_result(tmp)
        (tmp / "fpga" / "result.json").write_text(json.dumps({"raw": {"x": 1}, "size": "quick", "seconds": 1,
                                                              "provenance": {}}))
        return ["fpga", "--retable", "--out", str(tmp)], "rerun the suite"
    if kind == "retable, a table path that is a folder":
        _fpga_result(tmp)
        (tmp / "fpga" / "plot.png").unlink()
        (tmp / "fpga" / "plot.png").mkdir()
        return ["fpga", "--retable", "--out", str(tmp)], "plot.png"
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["out is a file", "out is a FIFO", "out is missing", "table.md is a folder",
                                  "the index is a folder", "retable, result.json missing",
                                  "retable, result.json not JSON", "retable, result.json of another shape",
                                  "retable, a table path that is a folder"])
def test_a_bad_output_is_refused_before_measuring_and_touches_nothing(kind, tmp_path):
    """Refused in one line, exit 2, before the suite's script starts (the fpga quick run would print its
    '[fpga] ...' command line first) and with every byte under the folder as it was."""
    argv, word = _bad_out(kind, tmp_path)
    before = _tree(tmp_path)
    r = _run(*argv)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and word in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert "[fpga]" not in r.stderr
    assert _tree(tmp_path) == before


def test_a_measurement_is_kept_when_its_folder_cannot_be_written(tmp_path, monkeypatch):
    """The output folder turns read-only while the suite measures: the run ends in one line naming a folder that
    holds the finished result (its result.json the measuring script's JSON)."""
    import importlib
    import os

    sys.path.insert(0, str(ROOT))
    runner = importlib.import_module("benchmarks.__main__")
    from suites import SUITES

    suite = SUITES["fpga"]

    def fake_script(cmd):  # the measurement: the script's JSON where the runner asked for it
        out = Path(cmd[cmd.index("--out-dir") + 1])
        (out / "fpga.json").write_text(json.dumps([{"config": "dense", "replay": 0.0, "ms_per_step": 1.0,
                                                    "x_dense": 1.0, "bound": "compute", "paper": ""}]))
        os.chmod(tmp_path, 0o500)  # the output folder can no longer be written
        return 0

    monkeypatch.setattr(runner, "_run_script", fake_script)
    if os.geteuid() == 0:  # root writes anywhere: make the write itself fail instead
        real = runner.present

        def present(s, raw, size, prov, seconds, out):
            if out == tmp_path:
                raise PermissionError(13, "Permission denied", str(out / "fpga"))
            return real(s, raw, size, prov, seconds, out)

        monkeypatch.setattr(runner, "present", present)
    try:
        with pytest.raises(runner.RunnerError) as e:
            runner.run(suite, "quick", tmp_path, ["fpga"])
    finally:
        os.chmod(tmp_path, 0o700)
    kept = Path(str(e.value).split("kept in ")[1].split(":")[0])
    assert json.loads((kept / "result.json").read_text())["raw"][0]["config"] == "dense"
    assert (kept / "table.md").is_file()
    import shutil

    shutil.rmtree(kept.parent)


def test_ctrl_c_ends_with_130_and_one_line(tmp_path):
    """SIGINT while a suite's script runs: exit 130, one line, no traceback (neither the runner's nor the
    script's), and nothing written into --out."""
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-m", "benchmarks", "dit-stream", "--size", "quick", "--out",
                             str(tmp_path)], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    line = proc.stderr.readline()  # '[dit-stream] ...': the script has started
    assert line.startswith("[dit-stream]") and time.time() < deadline
    time.sleep(2)
    proc.send_signal(signal.SIGINT)
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 130
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert err.strip().splitlines()[-1] == "python -m benchmarks: interrupted" and err.count("interrupted") == 1
    assert list(tmp_path.iterdir()) == []
