"""Every compiled decoder graph names each node and each value once.

ONNX's checker verifies that values are assigned once but not that node names are distinct; the rewrite passes
build with passes/build.py's Builder, whose counters start from 0 per layer and per pass, so a shared Builder and
layer 0's would give the same names unless each is told the graph. Checked on the written file (main graph and
every subgraph, one scope: ONNX values are visible in nested graphs).
"""

from __future__ import annotations

from collections import Counter

import onnx
import pytest

from fastcar_compile.cli import main

FRAME_TOKENS = 4
OPTIONS = {"default": [], "gqa": ["--fused-attention", "gqa"], "fastcar": ["--fused-attention", "fastcar"],
           "kv": ["--kv-budget", "16", "--kv-sinks", "2", "--kv-window", "8"],
           "kvtemp": ["--kv-budget", "12", "--kv-sinks", "1", "--kv-window", "4", "--tempcache", "0.5"],
           "perlayer": ["--per-layer-threshold", "--threshold", "0.3,0.6"], "nofusions": ["--fusions", "off"],
           "diagnostics": ["--emit-diagnostics", "--fused-attention", "gqa"]}
EXPORTS = [("llama", "dynamo20"), ("qwen2", "dynamo20"), ("gpt2", "dynamo20"), ("phi3", "ortfusions20"),
           ("mistral", "torchscript17"), ("neox", "torchscript17")]
KV_EXPORTS = {("llama", "dynamo20"), ("qwen2", "dynamo20")}  # those the compressed-KV op takes
CASES = [(f, e, o) for f, e in EXPORTS for o in OPTIONS if not o.startswith("kv") or (f, e) in KV_EXPORTS]


def _names(graph: onnx.GraphProto, nodes: Counter, values: Counter) -> None:
    """Node names and assigned value names (graph inputs, initializers, node outputs) of a graph and its subgraphs."""
    values.update(v.name for v in graph.input)
    values.update(t.name for t in graph.initializer)
    for node in graph.node:
        nodes[node.name] += 1
        values.update(o for o in node.output if o)
        for attr in node.attribute:
            for sub in [attr.g] if attr.HasField("g") else list(attr.graphs):
                _names(sub, nodes, values)


def _duplicates(path) -> tuple[dict, dict]:
    nodes, values = Counter(), Counter()
    model = onnx.load(str(path), load_external_data=False)
    _names(model.graph, nodes, values)
    for fn in model.functions:  # a function body is its own scope
        fn_nodes, fn_values = Counter(), Counter(fn.input)
        for node in fn.node:
            fn_nodes[node.name] += 1
            fn_values.update(o for o in node.output if o)
        assert all(c == 1 for n, c in fn_nodes.items() if n), (fn.name, fn_nodes)
        assert all(c == 1 for c in fn_values.values()), (fn.name, fn_values)
    return ({n: c for n, c in nodes.items() if c > 1 or not n}, {v: c for v, c in values.items() if c > 1})


@pytest.mark.parametrize(("family", "exporter", "option"), CASES)
def test_compiled_graph_names_are_unique(zoo_model, tmp_path, family, exporter, option):
    src = zoo_model(family, exporter)
    out = tmp_path / "fast.onnx"
    assert main([str(src), "-o", str(out), "--frame-tokens", str(FRAME_TOKENS), *OPTIONS[option]]) == 0
    nodes, values = _duplicates(out)
    assert not nodes, f"node names repeated (or empty): {nodes}"
    assert not values, f"value names repeated: {values}"


@pytest.mark.parametrize("option", ["default", "diagnostics", "perlayer"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_compiled_genai_graph_names_are_unique(genai_model, tmp_path, family, option):
    src = genai_model(family, "fp32") / "model.onnx"
    out = tmp_path / "fast.onnx"
    assert main([str(src), "-o", str(out), "--frame-tokens", str(FRAME_TOKENS), *OPTIONS[option]]) == 0
    nodes, values = _duplicates(out)
    assert not nodes, f"node names repeated (or empty): {nodes}"
    assert not values, f"value names repeated: {values}"
