"""End to end on a real exported decoder: fast.onnx -> bundles; functional mode vs ONNX Runtime; CLI."""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import replace

import numpy as np
import pytest

from fastcar_compile.cli import main as cli
from fastcar_compile.fpga_backend import build_program, compile_to_bundles, load_board
from fastcar_compile.fpga_backend.functional import FunctionalSim, weights_from_onnx
from fastcar_compile.fpga_backend.modelspec import load_onnx_shapes_only, spec_from_onnx
from fastcar_compile.fpga_backend.partition import partition_spec, weight_sources
from fastcar_compile.fpga_backend.schedule import emit_program

FRAME = 3
BATCH = 3
STEPS = 10


def _ort_run(fast, ids, threshold):
    from fastcar_compile.runtime.session import FastCarSession

    sess = FastCarSession(fast, native=False, threads=1)
    state = sess.new_state(ids.shape[0])
    logits, replay, tas = [], [], []
    for pos in range(ids.shape[1]):
        out = sess.step(state, ids[:, pos : pos + 1], threshold=threshold)
        state = out.state
        logits.append(out.logits[:, -1].astype(np.float64))
        replay.append(out.replay)
        tas.append(out.tas[:, :, -1] if out.tas is not None else None)
    return logits, replay, tas


@pytest.fixture(scope="module")
def fast_model(zoo_model, tmp_path_factory):
    import fastcar_compile as fc

    path = zoo_model("llama", "dynamo20")
    out = tmp_path_factory.mktemp("fpga") / "fast.onnx"
    fc.compile(str(path), str(out), frame_tokens=FRAME, emit_diagnostics=True)
    return out


def test_functional_mode_matches_onnx_runtime(fast_model):
    ids = np.random.default_rng(5).integers(0, 128, size=(BATCH, STEPS))
    # pass 1 (no replay): TAS values, to put tau in a wide gap so float32 vs float64 cannot flip a decision
    _, _, tas = _ort_run(fast_model, ids, threshold=1e9)
    vals = np.sort(np.concatenate([t.ravel() for t in tas[FRAME:]]))
    mid = len(vals) // 2
    gaps = np.diff(vals[mid - len(vals) // 4 : mid + len(vals) // 4])
    i = int(np.argmax(gaps)) + mid - len(vals) // 4
    tau = float((vals[i] + vals[i + 1]) / 2)
    ref_logits, ref_replay, _ = _ort_run(fast_model, ids, threshold=tau)
    prog = build_program(fast_model, load_board("kv260").replace(weight_buffer_kib=4), batch=BATCH, context=STEPS)
    spec, _ = spec_from_onnx(fast_model)
    assert prog.meta["model"]["layers"] == spec.layers
    # the program's TAS instructions carry tau: rebuild them with the calibrated one
    spec_tau = replace(spec, threshold=tau)
    part = partition_spec(spec_tau, prog.board, sources=weight_sources(load_onnx_shapes_only(fast_model), spec_tau))
    prog = emit_program(part, BATCH, STEPS)
    w, emb = weights_from_onnx(prog, fast_model)
    assert emb is not None
    sims = {p: FunctionalSim(prog, w, max_context=STEPS, policy=p) for p in ("static", "drs")}
    replays = []
    for pos in range(STEPS):
        for sim in sims.values():
            got = sim.step(emb[ids[:, pos]], pos)
            np.testing.assert_allclose(got["logits"], ref_logits[pos], rtol=2e-4, atol=2e-4)
            if ref_replay[pos] is not None:
                np.testing.assert_array_equal(got["replay"], ref_replay[pos])
        replays.append(got["replay"])
    r = np.array(replays)
    assert r.any() and not r.all(), "tau should give a mix of replayed and computed MLPs"


def test_cli_compile_sim_disasm_asm(fast_model, tmp_path):
    fcb = tmp_path / "m.fcb"
    assert cli([str(fast_model), "--target", "fpga", "--board", "u280", "--batch", "8", "-o", str(fcb)]) == 0
    rep = compile_to_bundles(fast_model, tmp_path / "again.fcb", board="u280", batch=8)
    assert (tmp_path / "again.fcb").read_bytes() == fcb.read_bytes() and rep.batch == 8
    # a real trace: the runtime generates 4 frames for 8 rows and records run.json (docs/DESIGN.md)
    from fastcar_compile.runtime.session import FastCarSession

    trace = tmp_path / "run.json"
    prompt = np.random.default_rng(0).integers(0, 128, (8, 5))
    FastCarSession(fast_model, native=False, threads=1).generate(prompt, 4, trace=str(trace), threshold=0.0)
    steps = json.loads(trace.read_text())["steps"]
    assert len(steps) > 5
    png = tmp_path / "tl.png"
    out = tmp_path / "sim.json"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli(["sim", str(fcb), "--replay-trace", str(trace), "--timeline", str(png), "--json"]) == 0
    res = json.loads(buf.getvalue())
    out.write_text(buf.getvalue())
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    want_ratio = np.mean([s["replay"] for s in steps])
    assert res["drs"]["replay_ratio"] == pytest.approx(want_ratio)
    assert res["drs"]["cycles_per_step"] <= res["static"]["cycles_per_step"]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli(["sim", str(fcb), "--replay-ratio", "0.8", "--mask", "clustered", "--batch", "4"]) == 0
    assert "DRS speedup over static" in buf.getvalue()
    text = tmp_path / "m.s"
    assert cli(["disasm", str(fcb), "-o", str(text)]) == 0
    assert cli(["asm", str(text), "-o", str(tmp_path / "back.fcb")]) == 0
    assert (tmp_path / "back.fcb").read_bytes() == fcb.read_bytes()
    # user errors: exit 2 with a message, no traceback
    bad = tmp_path / "bad.fcb"
    bad.write_bytes(fcb.read_bytes()[:-1] + b"\x00")
    assert cli(["sim", str(bad)]) == 2
    assert cli(["sim", str(fcb), "--batch", "9"]) == 2
    trace.write_text(json.dumps({"layers": [99], "batch": 8, "steps": steps}))  # a layer the model lacks
    assert cli(["sim", str(fcb), "--replay-trace", str(trace)]) == 2
