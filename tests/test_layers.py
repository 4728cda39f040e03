"""Folders are layers: a folder imports only folders of its own layer or below, and the folder graph has no cycle.

Module-level cycles (test_import_cycles.py) can be absent while the folders still loop into each other (passes
importing the front door that imports passes, one module apart); this check works on folders, with every import
in a file counted, those inside functions too. The layer order is declared here once; docs/DESIGN.md shows it
(`python tests/test_layers.py` prints the block it must contain).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import networkx as nx
from import_scan import ROOT, imported, modules

# Lowest first: each folder may import its own layer and the layers below it, never one above.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("ground: contract, errors, options, limits, file I/O, locks", ("fastcar_compile/core",)),
    ("the NumPy FAST-AR reference; the native kernels' build", ("fastcar_compile/fastar", "runtime/native")),
    ("the compiler's passes, the ONNX Runtime runtime, the FPGA backend",
     ("passes", "runtime", "fpga_backend", "fpga_backend/boards")),
    ("the Python API (compile, inspect, export); the PyTorch front end; the video DiT (model, export, stream runtime)",
     ("fastcar_compile", "fastcar_compile/torch", "fastcar_compile/dit")),
    ("the bundled demo models, their data and evaluation", ("fastcar_compile/demo",)),
    ("the command line: one module per command (imported by no library code)", ("fastcar_compile/cli",)),
)
# Never imported by library code: run as scripts, or pytest's.
OUTSIDE = ("benchmarks", "scripts", "tests")


def layer_of() -> dict[str, int]:
    return {folder: i for i, (_, folders) in enumerate(LAYERS) for folder in folders}


def folder(f: Path) -> str:
    return f.parent.relative_to(ROOT).as_posix()


def folder_edges() -> dict[tuple[str, str], list[str]]:
    """(importing folder, imported folder) -> where: 'file:line imports module' for each import behind the edge."""
    mods = modules()
    edges: dict[tuple[str, str], list[str]] = {}
    for name, f in mods.items():
        for target, node in imported(name, f, mods):
            src, dst = folder(f), folder(mods[target])
            if src != dst:
                edges.setdefault((src, dst), []).append(f"{f.relative_to(ROOT)}:{node.lineno} imports {target}")
    return edges


def render() -> str:
    """The layer block of docs/DESIGN.md, highest layer first."""
    return "\n".join(f"{i}. {'  '.join(f + '/' for f in folders)}\n   {text}"
                     for i, (text, folders) in reversed(list(enumerate(LAYERS))))


def test_every_folder_has_a_layer():
    have = {folder(f) for f in modules().values()}
    assert len(have) > 8, "the module scan found too few folders; is package-dir read right?"
    declared = set(layer_of())
    assert sorted(have - declared) == [], "folders holding Python code but no layer: add them to LAYERS"
    assert sorted(declared - have) == [], "LAYERS names folders without Python code"


def test_no_folder_cycle():
    g = nx.DiGraph(list(folder_edges()))
    cycles = [sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1]
    assert cycles == []


def test_each_folder_imports_only_its_layer_or_below():
    layer = layer_of()
    up = {f"{src} -> {dst}": where[:3] for (src, dst), where in folder_edges().items()
          if src in layer and dst in layer and layer[dst] > layer[src]}
    assert up == {}


def test_the_package_root_loads_only_the_ground_layer():
    """Importing any fastcar_compile.* module runs fastcar_compile/__init__.py first: at module level it may pull in
    only the ground layer (the API is imported when first used), or every folder would load the front door."""
    mods = modules()
    init = mods["fastcar_compile"]
    top = {n.lineno for n in ast.parse(init.read_text()).body if isinstance(n, (ast.Import, ast.ImportFrom))}
    loaded = {t for t, node in imported("fastcar_compile", init, mods) if node.lineno in top}
    assert loaded and {folder(mods[t]) for t in loaded} == {"fastcar_compile/core"}


def test_library_never_imports_scripts_benchmarks_or_tests():
    bad = [f"{f.relative_to(ROOT)}:{node.lineno}" for f in modules().values()
           for node in ast.walk(ast.parse(f.read_text()))
           if isinstance(node, ast.Import) and any(a.name.split(".")[0] in OUTSIDE for a in node.names)
           or isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] in OUTSIDE]
    assert bad == []


def test_design_doc_shows_the_layers():
    text = (ROOT / "docs" / "DESIGN.md").read_text()
    assert render() in text, "docs/DESIGN.md's layer block differs from LAYERS: paste `python tests/test_layers.py`"


def test_the_scan_sees_imports_inside_functions_and_relative_ones(tmp_path):
    """A file under passes/ whose only first-party imports are a lazy one and a relative one: both are edges."""
    f = tmp_path / "probe.py"
    f.write_text("from ..core import errors\n\n\ndef later():\n    from fastcar_compile.demo import data\n")
    got = {t for t, _ in imported("fastcar_compile.passes.probe", f, modules())}
    assert got == {"fastcar_compile.core", "fastcar_compile.core.errors", "fastcar_compile.demo",
                   "fastcar_compile.demo.data"}


if __name__ == "__main__":
    sys.stdout.write(render() + "\n")
