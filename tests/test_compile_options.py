"""A calibrated compile keeps every option: its output equals a plain compile with the same options and the
calibrated tau (metadata, graph inputs/outputs and their defaults, ops, genai_config.json)."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import zoo

from fastcar_compile.cli import main

L = 4
# Non-default values of every option `fastcar-compile` compiles with, in groups that can be given together.
GROUPS = {
    "kv": ["--kv-budget", "16", "--kv-sinks", "2", "--kv-window", "8", "--kv-eviction", "oldest", "--tempcache",
           "0.9", "--sparse-attention", "lsh:4x2", "--prune-prompt", "0.1", "--kv-diagnostics", "64"],
    "kv-layer": ["--kv-layer", "0:budget=12,sinks=1,window=4,eviction=oldest", "--kv-layer", "1:off"],
    "gate": ["--tas-query", "raw", "--max-replay", "2", "--layers", "1", "--emit-diagnostics",
             "--required-video-inputs", "--rotary-positions", "4096", "--no-validate"],
    "per-layer": ["--per-layer-threshold"],
    "gqa": ["--fused-attention", "gqa", "--native-attention", "off"],
    "off": ["--fused-attention", "off", "--fusions", "off"],
    "unpacked": ["--pack-qkv", "off"],
}


def _ops(graph: onnx.GraphProto, out: collections.Counter) -> collections.Counter:
    for node in graph.node:
        out[f"{node.domain}.{node.op_type}"] += 1
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                _ops(attr.g, out)
    return out


def _signature(path: Path) -> dict:
    """What an option changes in a compiled model, for comparing two of them."""
    m = onnx.load(str(path), load_external_data=False)
    g = m.graph
    defaults = {i.name: onnx.numpy_helper.to_array(i).tolist() for i in g.initializer
                if i.name in {x.name for x in g.input} and not i.external_data}
    genai = path.parent / "genai_config.json"
    return {"metadata": {p.key: p.value for p in m.metadata_props},
            "inputs": [(x.name, str(x.type)) for x in g.input], "outputs": [(x.name, str(x.type)) for x in g.output],
            "defaults": defaults, "ops": _ops(g, collections.Counter()),
            "functions": sorted(f"{f.domain}.{f.name}" for f in m.functions),
            "genai": json.loads(genai.read_text()) if genai.exists() else None}


@pytest.fixture(scope="module")
def calib(tmp_path_factory):
    d = tmp_path_factory.mktemp("copts")
    np.save(d / "p.npy", np.random.default_rng(3).integers(0, zoo.VOCAB, (12, 4)))
    return d / "p.npy"


def _compare(src: Path, calib_data: Path, tmp_path: Path, args: list[str]) -> None:
    cal, plain = tmp_path / "cal" / "fast.onnx", tmp_path / "plain" / "fast.onnx"
    cal.parent.mkdir()
    plain.parent.mkdir()
    assert main([str(src), "-o", str(cal), "--frame-tokens", str(L), "--calibrate-replay", "0.5",
                 "--calib-data", str(calib_data), *args]) == 0
    meta = {p.key: p.value for p in onnx.load(str(cal), load_external_data=False).metadata_props}
    tau = json.loads(meta["fastcar.threshold"])
    tau = tau[0] if isinstance(tau, list) else tau
    assert main([str(src), "-o", str(plain), "--frame-tokens", str(L), f"--threshold={tau!r}", *args]) == 0
    assert _signature(cal) == _signature(plain)


@pytest.mark.parametrize("group", list(GROUPS))
def test_calibrated_compile_keeps_every_option(group, zoo_model, calib, tmp_path, capsys):
    _compare(zoo_model("llama", "dynamo20"), calib, tmp_path, GROUPS[group])


@pytest.mark.parametrize("args", [[], ["--no-genai"]], ids=["genai", "no-genai"])
def test_calibrated_compile_keeps_genai(args, genai_model, calib, tmp_path, capsys):
    _compare(genai_model("llama", "fp32") / "model.onnx", calib, tmp_path, args)
