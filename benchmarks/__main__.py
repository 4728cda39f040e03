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
        raise RunnerError(f"the suite's script wrote no JSON into {folder}")
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


class RunnerError(Exception):
    """A refusal of the runner: one line on stderr, exit 2."""


def _kind(path: Path) -> str | None:
    """What `path` is when it is something a file cannot be written over: 'a folder', 'a FIFO', ...; None when it
    is absent or a regular file."""
    import stat

    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return None
    if stat.S_ISREG(mode):
        return None
    return "a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "not a regular file"


def outputs(suite: Suite, out: Path) -> list[Path]:
    """Every file a run of `suite` writes under `out`."""
    folder = out / suite.name
    return [folder / n for n in ("result.json", "table.md", "plot.png", *suite.artifacts)] + [out / "README.md"]


def check_outputs(names: list[str], out: Path, retable: bool) -> None:
    """Refuse, before anything is measured or written, an output folder or file that cannot take the results,
    and (--retable) a result.json that is missing or not one this runner wrote."""
    import os

    if not out.exists():
        raise RunnerError(f"--out {out}: no such folder; create it first or pick an existing one")
    if not out.is_dir():
        raise RunnerError(f"--out {out}: is {_kind(out) or 'a file'}, not a folder")
    if not os.access(out, os.W_OK | os.X_OK):
        raise RunnerError(f"--out {out}: no permission to write there")
    for name in names:
        suite, folder = SUITES[name], out / name
        if folder.exists() and not folder.is_dir():
            raise RunnerError(f"{folder}: is {_kind(folder) or 'a file'}, where the suite's folder goes; move it away")
        for path in outputs(suite, out):
            if (kind := _kind(path)) is not None:
                raise RunnerError(f"{path}: is {kind}, where the runner writes a file; move it away")
        if retable:
            retable_data(name, out)


def retable_data(name: str, out: Path) -> dict:
    """OUT/SUITE/result.json for --retable, checked to be one this code can table (nothing written yet)."""
    path = out / name / "result.json"
    d = load_result(path)
    try:
        SUITES[name].rows(d["raw"])
        if SUITES[name].sections:
            SUITES[name].sections(d["raw"])
        harness.describe_machine(d["provenance"])
        "{command} {commit} {date}".format(**d["provenance"])
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        raise RunnerError(f"--retable: {path} does not hold a {name} run this code can table "
                          f"({type(exc).__name__}: {exc}); rerun the suite") from None
    return d


def load_result(path: Path) -> dict:
    """A result.json this runner wrote (for --retable), or a one-line refusal."""
    if not path.is_file():
        raise RunnerError(f"--retable: {path} is missing; run the suite first (without --retable)")
    try:
        d = json.loads(path.read_text())
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise RunnerError(f"--retable: {path} is not valid JSON ({type(exc).__name__}); rerun the suite") from None
    if not isinstance(d, dict) or not all(k in d for k in ("raw", "size", "provenance", "seconds")) \
            or not isinstance(d["provenance"], dict) or not isinstance(d["seconds"], (int, float)):
        raise RunnerError(f"--retable: {path} is not a result.json of this runner (raw, size, provenance, seconds); "
                          "rerun the suite")
    return d


def _run_script(cmd: list[str]) -> int:
    """The measuring script's exit code. It runs in its own session, so a Ctrl-C reaches the runner alone, which
    stops the script (SIGTERM: no traceback from it) and reports the interrupt in one line."""
    proc = subprocess.Popen(cmd, cwd=HERE.parent, start_new_session=True)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise


def run(suite: Suite, size: str, out: Path, argv: list[str]) -> Path:
    import shutil

    prov = harness.provenance(size, argv)
    tmp = Path(tempfile.mkdtemp(prefix=f"bench-{suite.name}-"))
    try:
        cmd = [sys.executable, str(HERE / suite.script), *suite.sizes[size], *suite.output(tmp)]
        print(f"[{suite.name}] {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        if _run_script(cmd) != 0:
            raise RunnerError(f"suite {suite.name} failed (its script's message is above)")
        seconds = time.perf_counter() - t0
        raw = _read_json(tmp)
        files = {name: (tmp / name).read_bytes() for name in suite.artifacts if (tmp / name).is_file()}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    try:
        return _write(suite, raw, size, prov, seconds, out, files)
    except OSError as exc:  # the measurement is done: never lose it to the output path
        kept = Path(tempfile.mkdtemp(prefix=f"bench-{suite.name}-kept-"))
        _write(suite, raw, size, prov, seconds, kept, files)
        raise RunnerError(f"could not write into {out / suite.name} ({exc.strerror or exc}); the measurement is "
                          f"kept in {kept / suite.name}: copy that folder there") from None


def _write(suite: Suite, raw, size: str, prov: dict, seconds: float, out: Path, files: dict[str, bytes]) -> Path:
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
    try:
        return _main(sys.argv[1:] if argv is None else argv)
    except RunnerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("python -m benchmarks: interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    ap.add_argument("suites", nargs="*", metavar="SUITE", help=f"one or more of: {', '.join(SUITES)}")
    ap.add_argument("--size", choices=["default", "quick", "full"], default="default",
                    help="default: the published size (speed suites up to ~15 minutes each on 2 cores, quality suites with "
                    "16 held-out clips longer); quick: a smoke run; "
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
    check_outputs(a.suites, a.out, a.retable)
    for name in a.suites:
        if a.retable:
            d = retable_data(name, a.out)
            present(SUITES[name], d["raw"], d["size"], d["provenance"], d["seconds"], a.out)
        else:
            run(SUITES[name], a.size, a.out, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
