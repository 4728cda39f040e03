"""The FPGA flow's first hour: a dense baseline program (no FastCar instructions) and `sim --baseline`,
the video_start a run used recorded in the bundle, a representative timeline step with every layer."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fastcar_compile.cli import main
from fastcar_compile.cli.sim import representative_step
from fastcar_compile.fpga_backend import encode, isa
from fastcar_compile.fpga_backend.simulate import Simulator

L = 8


@pytest.fixture(scope="module")
def programs(zoo_model, tmp_path_factory):
    import fastcar_compile as fc

    d = tmp_path_factory.mktemp("fpga10")
    dense = zoo_model("llama", "dynamo20")
    fc.compile(str(dense), str(d / "fast.onnx"), frame_tokens=L, threshold=0.0)
    assert main([str(d / "fast.onnx"), "--target", "fpga", "-o", str(d / "fast.fcb"), "--video-start", "5"]) == 0
    assert main([str(dense), "--target", "fpga", "--dense", "-o", str(d / "dense.fcb"), "--frame-tokens",
                 str(L)]) == 0
    return d


def _ops(program) -> dict[str, int]:
    b = program.bundles
    ops = b["opcode"].ravel()
    return {"TAS": int((ops == isa.Op.TAS).sum()), "XCHG": int((ops == isa.Op.XCHG).sum()),
            "skip": int(((b["flags"].ravel() & isa.Flag.SKIP_ON_REPLAY) != 0).sum())}


def test_dense_program_has_no_fastcar_instructions(programs):
    fast, dense = encode.load(programs / "fast.fcb"), encode.load(programs / "dense.fcb")
    assert _ops(dense) == {"TAS": 0, "XCHG": 0, "skip": 0}
    got = _ops(fast)
    assert got["TAS"] == 2 and got["XCHG"] == 2 and got["skip"] > 0  # two layers
    assert Simulator(dense).replayable_layers == [] and dense.meta["model"]["replay_layers"] == []


def test_video_start_recorded_and_sim_baseline(programs, tmp_path, capsys):
    fast = encode.load(programs / "fast.fcb")
    assert fast.meta["model"]["video_start"] == 5
    tas = fast.bundles[fast.bundles["opcode"] == isa.Op.TAS]
    assert (tas["off_k"] == 5).all()
    trace = {"frame_tokens": L, "layers": [0, 1], "batch": 1, "video_start": 3,
             "steps": [{"pos": 3 + i, "replay": [[int(i >= L and i % 2)], [int(i >= L)]]} for i in range(3 * L)]}
    (tmp_path / "run.json").write_text(json.dumps(trace))
    capsys.readouterr()
    assert main(["sim", str(programs / "fast.fcb"), "--replay-trace", str(tmp_path / "run.json"), "--baseline",
                 str(programs / "dense.fcb"), "--json"]) == 0
    cap = capsys.readouterr()
    out = json.loads(cap.out)
    assert "video_start 3" in cap.err and out["video_start"] == 3
    # independent: the dense program alone on the same contexts, nothing replayed
    ctx = np.array([s["pos"] + 1 for s in trace["steps"]])
    base = Simulator(encode.load(programs / "dense.fcb")).run(np.zeros((len(ctx), 2, 1), bool), ctx, policy="static")
    assert out["dense_cycles"] == pytest.approx(base.cycles)
    steps = out["drs"]["steps"]
    assert out["drs_x_dense"] == pytest.approx(base.cycles / (out["drs"]["cycles_per_step"] * steps))
    assert out["drs_x_dense"] > 1.0  # replay saves weight traffic at batch 1
    assert main(["sim", str(programs / "fast.fcb"), "--baseline", str(programs / "fast.fcb")]) == 2
    assert "--dense" in capsys.readouterr().err


def test_representative_timeline_step_and_all_layers(programs, tmp_path):
    rng = np.random.default_rng(0)
    replay = rng.random((40, 2, 2)) < 0.6
    replay[:L] = False  # frame 0
    s = representative_step(replay)
    share = replay.reshape(40, -1).mean(axis=1)
    nz = share[share > 0]
    assert s >= L and abs(share[s] - nz.mean()) == np.abs(nz - nz.mean()).min()
    assert representative_step(np.zeros((5, 2, 1), bool)) in range(5)
    res = Simulator(encode.load(programs / "fast.fcb")).run(replay[:, :, :1], 2 * L, timeline=True, timeline_step=s)
    tl = res.timeline
    busy = tl["t"] > 0
    assert set(tl["layer"][busy & (tl["part"] != 2)].tolist()) == {0, 1}
    assert main(["sim", str(programs / "fast.fcb"), "--replay-ratio", "0.5", "--timeline",
                 str(tmp_path / "tl.png")]) == 0
    assert (tmp_path / "tl.png").stat().st_size > 0
