"""`python -m benchmarks SUITE... [--size quick]`: run benchmark suites and write results/SUITE/{result.json,
table.md, plot.png} plus the index results/README.md (`--list` names the suites)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the measuring scripts import their shared pieces by file name

import harness  # noqa: E402
from suites import SUITES, Suite  # noqa: E402


def _read_json(folder: Path):
    found = sorted(folder.rglob("*.json"))
    if not found:
        raise SystemExit(f"error: the suite's script wrote no JSON into {folder}")
    return json.loads(found[0].read_text())


def plot(suite: Suite, rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    label, keys, ylabel = suite.plot
    names = [str(r.get(label, "")) for r in rows]
    fig, ax = plt.subplots(figsize=(9, max(3.0, 0.28 * len(rows) + 1.2)))
    y = np.arange(len(rows))
    height = 0.8 / len(keys)
    for k, key in enumerate(keys):
        values = [float(r[key]) if r.get(key) is not None else np.nan for r in rows]
        header = next((c.header for c in suite.columns if c.key == key), key)
        ax.barh(y + k * height, values, height, label=header)
    ax.set_yticks(y + height * (len(keys) - 1) / 2, names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(ylabel)
    ax.set_title(suite.title, fontsize=10)
    if len(keys) > 1:
        ax.legend(fontsize=8)
    harness.write_plot(fig, path)
    plt.close(fig)


def run(suite: Suite, size: str, out: Path, argv: list[str]) -> Path:
    prov = harness.provenance(size, argv)
    with tempfile.TemporaryDirectory(prefix=f"bench-{suite.name}-") as tmp:
        cmd = [sys.executable, str(HERE / suite.script), *suite.sizes[size], *suite.output(Path(tmp))]
        print(f"[{suite.name}] {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        if subprocess.run(cmd, cwd=HERE.parent, check=False).returncode != 0:
            raise SystemExit(f"error: suite {suite.name} failed (its script's message is above)")
        seconds = time.perf_counter() - t0
        raw = _read_json(Path(tmp))
        files = {name: (Path(tmp) / name).read_bytes() for name in suite.artifacts if (Path(tmp) / name).is_file()}
    folder = present(suite, raw, size, prov, seconds, out)
    from fastcar_compile.core.atomic import write_bytes

    for name, data in files.items():  # the script's own pictures, next to the table
        write_bytes(folder / name, data)
    return folder


def present(suite: Suite, raw, size: str, prov: dict, seconds: float, out: Path) -> Path:
    """The suite's table, notes and plot from its script's JSON, written with the run's provenance."""
    rows = suite.rows(raw)
    notes = list(suite.notes)
    if isinstance(raw, dict):  # the measured model and settings, as the script records them
        said = {k: raw[k] for k in ("shape", "title", "context", "ctx", "threads", "tokens", "frame_tokens") if k in raw}
        if said:
            notes.insert(0, "Settings: " + ", ".join(f"{k} {v}" for k, v in said.items()) + ".")
    result = harness.Result(suite.name, suite.title, size, prov["command"], suite.columns, rows, notes,
                            raw, seconds, prov, suite.sections(raw) if suite.sections else [])
    result.provenance["script"] = " ".join(["python", f"benchmarks/{suite.script}", *suite.sizes[size]])
    folder = harness.write(result, out)
    if suite.plot is not None:  # else the script draws its own plot.png (an artifact)
        plot(suite, rows, folder / "plot.png")
    print(f"[{suite.name}] wrote {folder}/{{result.json,table.md,plot.png}} ({seconds:.0f} s)", file=sys.stderr)
    return folder


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    ap.add_argument("suites", nargs="*", metavar="SUITE", help=f"one or more of: {', '.join(SUITES)}")
    ap.add_argument("--size", choices=["default", "quick", "full"], default="default",
                    help="default: the published size (up to ~15 minutes each on 2 cores); quick: a smoke run; "
                    "full: a longer run, for the suites that have one")
    ap.add_argument("--out", type=Path, default=harness.RESULTS, help="results folder (default: results/)")
    ap.add_argument("--list", action="store_true", help="name and describe the suites, then exit")
    ap.add_argument("--retable", action="store_true", help="rebuild table.md and plot.png of the named suites from "
                    "their result.json (after a change to how a suite presents its data; nothing is measured)")
    a = ap.parse_args(argv)
    if a.list or not a.suites:
        for s in SUITES.values():
            print(f"{s.name:11s} {s.title}")
        return 0
    unknown = [s for s in a.suites if s not in SUITES]
    if unknown:
        print(f"error: unknown suite {', '.join(unknown)}; choose from {', '.join(SUITES)}", file=sys.stderr)
        return 2
    lacking = [s for s in a.suites if not a.retable and a.size not in SUITES[s].sizes]
    if lacking:
        print(f"error: suite {lacking[0]} has no size {a.size!r}; it has {', '.join(SUITES[lacking[0]].sizes)}",
              file=sys.stderr)
        return 2
    for name in a.suites:
        if a.retable:
            d = json.loads((a.out / name / "result.json").read_text())
            present(SUITES[name], d["raw"], d["size"], d["provenance"], d["seconds"], a.out)
        else:
            run(SUITES[name], a.size, a.out, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
