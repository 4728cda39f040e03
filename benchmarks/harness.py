"""What every suite's result records and how it is written: results/SUITE/{result.json, table.md, plot.png} and
the index results/README.md.

The timing itself is shared through `_common.py` (interleaved variants, ratios measured in one run, lower
quartiles, glibc's huge-page malloc); this module adds the provenance a figure needs: the command, the commit, the
machine and the versions of the stack it ran on.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

from fastcar_compile.core.atomic import write_text

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
PACKAGES = ("numpy", "onnx", "onnx-ir", "onnxruntime", "onnxruntime-genai", "torch", "transformers")


@dataclass
class Column:
    key: str
    header: str
    fmt: str = "{}"

    def cell(self, row: dict) -> str:
        value = row.get(self.key)
        if value is None:
            return ""
        try:
            return self.fmt.format(value)
        except (TypeError, ValueError):
            return str(value)


@dataclass
class Result:
    """One suite run: the table rows (dicts) with their columns, the notes under the table and the provenance."""

    suite: str
    title: str
    size: str
    command: str
    columns: list[Column]
    rows: list[dict]
    notes: list[str] = field(default_factory=list)
    raw: dict | list | None = None  # the measuring script's own JSON
    seconds: float = 0.0
    provenance: dict = field(default_factory=dict)
    sections: list[str] = field(default_factory=list)  # more markdown (further tables) after the notes


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False).stdout.strip()

    head = git("rev-parse", "--short=12", "HEAD")
    if not head:
        return "unknown"
    # code that differs from the commit (text and results do not change a figure)
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!docs", ":!results", ":!README.md")
    return head + ("+changes" if dirty else "")


def machine() -> dict:
    """The machine and stack a result ran on (load averages say whether other jobs shared it)."""
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    from _common import hugepage_malloc_record

    return {"cpu": _cpu_model(), "logical_cpus": os.cpu_count(), "usable_cpus": len(os.sched_getaffinity(0))
            if hasattr(os, "sched_getaffinity") else os.cpu_count(), "os": platform.platform(),
            "python": platform.python_version(), "versions": versions, "loadavg_start": load,
            "malloc": hugepage_malloc_record()}


def provenance(size: str, argv: list[str]) -> dict:
    return {"commit": _commit(), "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "size": size, "command": " ".join(["python -m benchmarks", *argv]), "machine": machine()}


def table_md(result: Result) -> str:
    head = "| " + " | ".join(c.header for c in result.columns) + " |"
    rule = "|" + "|".join("---:" if c.fmt != "{}" else "---" for c in result.columns) + "|"
    body = ["| " + " | ".join(c.cell(r) for c in result.columns) + " |" for r in result.rows]
    return "\n".join([head, rule, *body])


def describe_machine(p: dict) -> str:
    m = p["machine"]
    load = m.get("loadavg_start")
    v = m["versions"]
    stack = ", ".join(f"{k} {v[k]}" for k in ("onnxruntime", "onnx", "torch", "onnxruntime-genai") if v.get(k))
    return (f"{m['cpu']}, {m['usable_cpus']} usable of {m['logical_cpus']} logical CPUs"
            + (f", load average {load[0]} at start (other jobs share the machine when it exceeds the CPUs)"
               if load else "") + f"; Python {m['python']}, {stack}")


def write(result: Result, out: Path = RESULTS) -> Path:
    """results/SUITE/{result.json, table.md, plot.png} (each written atomically), then the index."""
    folder = out / result.suite
    folder.mkdir(parents=True, exist_ok=True)
    p = result.provenance
    data = {**{k: v for k, v in asdict(result).items() if k not in ("columns",)},
            "columns": [asdict(c) for c in result.columns]}
    lines = [f"# {result.title}", "", table_md(result), ""]  # composed before anything is written
    lines += [f"- {n}" for n in result.notes]
    lines += [x for sec in result.sections for x in ("", sec)]
    lines += ["", f"Command: `{p['command']}` (size `{result.size}`, {result.seconds:.0f} s), commit {p['commit']}, "
              f"{p['date']}.", "", f"Machine: {describe_machine(p)}.", ""]
    write_text(folder / "result.json", json.dumps(data, indent=1, default=str) + "\n")
    write_text(folder / "table.md", "\n".join(lines))
    write_index(out)
    return folder


def write_plot(fig, path: Path) -> None:
    """A matplotlib figure saved atomically (temp file, rename)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp.png")
    fig.savefig(tmp, dpi=110, bbox_inches="tight")
    os.replace(tmp, path)


def write_index(out: Path = RESULTS) -> None:
    """results/README.md: one line per suite with its title, size, commit and date, linking its table."""
    rows = []
    for path in sorted(out.glob("*/result.json")):
        d = json.loads(path.read_text())
        p = d["provenance"]
        rows.append(f"| [{d['suite']}]({d['suite']}/table.md) | {d['title']} | `{d['size']}` | {p['commit']} | "
                    f"{p['date']} |")
    text = ["# Results", "",
            "Each folder holds one suite's latest run: `result.json` (every figure, the command, the commit, the "
            "machine and the package versions), `table.md` and `plot.png`. Regenerate one with "
            "`python -m benchmarks SUITE` (`--size quick` for a smoke run; `python -m benchmarks --list` lists "
            "the suites). Times are ratios measured in one run, variants interleaved, lower quartiles of the "
            "step times; a table says which machine it ran on and how loaded it was.", "",
            "| suite | what | size | commit | date |", "|---|---|---|---|---|", *rows, ""]
    write_text(out / "README.md", "\n".join(text))
