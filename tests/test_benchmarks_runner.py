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
