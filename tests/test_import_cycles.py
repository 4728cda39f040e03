"""Data flows one way: no import cycle among the project's modules (lazy imports inside functions count)."""

from __future__ import annotations

import networkx as nx
from import_scan import imported, modules


def import_graph() -> nx.DiGraph:
    mods = modules()
    g = nx.DiGraph()
    g.add_nodes_from(mods)
    for name, f in mods.items():
        for t, _ in imported(name, f, mods):
            if not name.startswith(t + "."):  # a package's own parents are not cycles
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
