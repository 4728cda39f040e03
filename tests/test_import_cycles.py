"""Data flows one way: no import cycle among the project's modules (lazy imports inside functions count)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).parent.parent


def _modules() -> dict[str, Path]:
    """Module name -> file, with passes/, runtime/, fpga_backend/ under fastcar_compile.* (pyproject's package-dir)."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    mods: dict[str, Path] = {}
    for pkg, folder in sorted(package_dir.items(), key=lambda kv: -len(kv[0])):
        for f in (ROOT / folder).rglob("*.py"):
            parts = [p for p in f.relative_to(ROOT / folder).with_suffix("").parts if p != "__init__"]
            mods.setdefault(".".join([pkg, *parts]), f)
    return mods


def import_graph() -> nx.DiGraph:
    mods = _modules()
    g = nx.DiGraph()
    g.add_nodes_from(mods)
    for name, f in mods.items():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = name.split(".") if f.name == "__init__.py" else name.split(".")[:-1]
                    base = ".".join(parts[: len(parts) - (node.level - 1)] + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != name and not name.startswith(t + "."):  # a package's own parents are not cycles
                    g.add_edge(name, t)
    return g


def test_no_import_cycles():
    g = import_graph()
    assert len(g) > 40, "the module scan found too few modules; is package-dir read right?"
    cycles = [sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1]
    assert cycles == []


def test_the_scan_sees_lazy_and_relative_imports():
    """The edges the cycle check relies on are found: a lazy import inside a method, a relative import."""
    g = import_graph()
    assert g.has_edge("fastcar_compile.runtime.session", "fastcar_compile.runtime.decode")  # in generate()
    assert g.has_edge("fastcar_compile.fpga_backend.simulate", "fastcar_compile.fpga_backend.costmodel")  # from .
    assert g.has_edge("fastcar_compile.fpga_backend.drs", "fastcar_compile.fpga_backend.costmodel")
