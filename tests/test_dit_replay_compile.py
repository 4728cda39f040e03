"""`fastcar-compile dit.onnx -o fast.onnx --threshold TAU`: FastCar's FFN replay compiled into the DiT step graph
(dit/replay.py), the replay cache as graph I/O, the tau recorded in the metadata and read back by the stream
runtime. References: the eager stream runtime's FastCar (dit/fastar.FastARDiT, its replay checked against
computing every row in test_dit_fastar.py) and the dense export in ONNX Runtime."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")

from fastcar_compile.cli import main  # noqa: E402
from fastcar_compile.dit import modes  # noqa: E402
from fastcar_compile.dit.config import MODES_KEY, PRESETS, replay_io  # noqa: E402
from fastcar_compile.dit.fastar import FastARDiT  # noqa: E402
from fastcar_compile.dit.model import build  # noqa: E402
from fastcar_compile.dit.stream import OrtDiT, StreamSettings, rollout  # noqa: E402

CFG = PRESETS["tiny"]


@pytest.fixture(scope="module")
def eager():
    return build(CFG, seed=0)  # the weights `export --dit tiny` drew


def _compile(exported: Path, folder: Path, tau: str) -> Path:
    out = folder / "fast.onnx"
    assert main([str(exported), "-o", str(out), "--threshold", tau]) == 0
    return out


@pytest.mark.parametrize("tau, window", [("0", None), ("0", 0), ("-1e30", None)])
def test_compiled_replay_equals_the_eager_mode(dit_tiny_export, tmp_path, eager, tau, window):
    """5 chunks: the compiled rollout == the eager FastCar rollout at the same tau within 1e-4, with the same
    number of replayed FFN rows (tau -1e30: every eligible row replays, so a step computes no FFN row)."""
    fast = OrtDiT(_compile(dit_tiny_export, tmp_path, tau))
    assert fast.tau == float(tau)  # read back from the metadata
    settings = StreamSettings(frames=10, seed=3, window_frames=window)
    ref = FastARDiT(eager, modes.settings(fastcar_tau=float(tau)))
    for a, b in zip(rollout(fast, settings), rollout(ref, settings), strict=True):
        assert a.resident == b.resident
        np.testing.assert_allclose(a.frames, b.frames, atol=1e-4, rtol=0)
    replayed, rows = sum(s.ffn_replayed for s in ref.stats), sum(s.ffn_rows for s in ref.stats)
    assert fast.replayed == [replayed, rows] and 0 < replayed < rows


def test_tau_no_score_exceeds_is_the_dense_export(dit_tiny_export, tmp_path):
    fast = OrtDiT(_compile(dit_tiny_export, tmp_path, "1e30"))
    settings = StreamSettings(frames=10, seed=4)
    for a, b in zip(rollout(fast, settings), rollout(OrtDiT(dit_tiny_export), settings), strict=True):
        np.testing.assert_allclose(a.frames, b.frames, atol=1e-4, rtol=0)
    assert fast.replayed[0] == 0 and fast.replayed[1] > 0


def test_replay_cache_is_graph_io_and_the_ffn_reads_gathered_rows(dit_tiny_export, tmp_path):
    """The graph's I/O holds the replay cache per block, the metadata the tau; each FFN's first MatMul reads
    rows gathered at the non-replayed positions (row skipping, not a mask over all rows)."""
    path = _compile(dit_tiny_export, tmp_path, "0.25")
    m = onnx.load(str(path))
    meta = {p.key: p.value for p in m.metadata_props}
    assert json.loads(meta[MODES_KEY]) == {"threshold": 0.25}
    ins, outs = {i.name for i in m.graph.input}, {o.name for o in m.graph.output}
    for i in range(CFG.layers):
        (a, b), (c, d), mask = replay_io(i)
        assert {a, b} <= ins and {c, d, mask} <= outs
    producer = {o: n for n in m.graph.node for o in n.output}
    gelus = [n for n in m.graph.node if n.op_type == "Gelu"]
    assert len(gelus) == CFG.layers
    for g in gelus:
        up = producer[producer[g.input[0]].input[0]]  # Add(bias) <- MatMul
        assert up.op_type == "MatMul"
        gather = producer[up.input[0]]
        assert gather.op_type == "Gather" and producer[producer[gather.input[1]].input[0]].op_type == "NonZero"


def test_dense_compile_records_no_mode(dit_tiny_export, tmp_path):
    fast = OrtDiT(_compile(dit_tiny_export, tmp_path, "inf"))
    assert fast.tau is None and fast.modes == {"threshold": None}


def test_stream_cli_reports_the_compiled_mode(dit_tiny_export, tmp_path, capsys):
    path = _compile(dit_tiny_export, tmp_path, "0")
    capsys.readouterr()
    assert main(["stream", str(path), "--frames", "4", "-o", str(tmp_path / "run")]) == 0
    assert "FastCar compiled in (tau 0)" in capsys.readouterr().out
    doc = json.loads((tmp_path / "run" / "stream.json").read_text())
    assert doc["compiled_modes"]["threshold"] == 0.0 and 0 < doc["compiled_modes"]["replay_ratio"] < 1
