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


def _trace(batch: int, video_start: int = 0) -> dict:
    return {"frame_tokens": L, "layers": [0, 1], "batch": batch, "video_start": video_start,
            "steps": [{"pos": video_start + i, "replay": [[int(i >= L and (i + r) % 2) for r in range(batch)],
                                                          [int(i >= L) for _ in range(batch)]]}
                      for i in range(3 * L)]}


def test_a_smaller_trace_fills_the_bundles_batch_with_a_note(programs, tmp_path, capsys):
    """Bundle compiled for batch 4, trace of 2 rows: simulated at batch 4 with the rows repeated (the same cycles
    as the simulator fed the tiled mask directly), and said; a trace with more rows than the bundle is refused."""
    import onnx

    fast4 = tmp_path / "b4.fcb"
    assert main([str(programs / "fast.onnx"), "--target", "fpga", "--batch", "4", "-o", str(fast4)]) == 0
    trace = _trace(2)
    (tmp_path / "run.json").write_text(json.dumps(trace))
    capsys.readouterr()
    assert main(["sim", str(fast4), "--replay-trace", str(tmp_path / "run.json"), "--json"]) == 0
    cap = capsys.readouterr()
    out = json.loads(cap.out)
    assert "repeated to fill 4" in cap.err and "batch 4" not in cap.err.split("note")[0]
    rows = np.array([s["replay"] for s in trace["steps"]], bool)  # [steps, layers, 2]
    ctx = np.array([s["pos"] + 1 for s in trace["steps"]])
    want = Simulator(encode.load(fast4)).run(rows[:, :, [0, 1, 0, 1]], ctx, policy="drs")
    assert out["drs"]["cycles_per_step"] == pytest.approx(want.cycles / len(ctx))
    assert main(["sim", str(fast4), "--replay-trace", str(tmp_path / "run.json"), "--batch", "2"]) == 0
    assert "repeated" not in capsys.readouterr().err
    (tmp_path / "run8.json").write_text(json.dumps(_trace(8)))
    assert main(["sim", str(fast4), "--replay-trace", str(tmp_path / "run8.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--batch 8" in err
    assert onnx.load(str(programs / "fast.onnx")) is not None


def test_video_start_note_only_when_the_bundle_recorded_one(programs, tmp_path, capsys):
    """A model compiled without --video-start takes it per run: its bundle simulates a trace's video start
    silently; a bundle given --video-start 5 notes the trace's 3."""
    plain = tmp_path / "plain.fcb"
    assert main([str(programs / "fast.onnx"), "--target", "fpga", "-o", str(plain)]) == 0
    (tmp_path / "run.json").write_text(json.dumps(_trace(1, video_start=3)))
    capsys.readouterr()
    assert main(["sim", str(plain), "--replay-trace", str(tmp_path / "run.json")]) == 0
    cap = capsys.readouterr()
    assert "note" not in cap.err and "video_start 3" in cap.out
    assert main(["sim", str(programs / "fast.fcb"), "--replay-trace", str(tmp_path / "run.json")]) == 0
    assert "--video-start 3" in capsys.readouterr().err


def test_a_model_with_external_data_compiles_to_bundles_from_any_folder(programs, tmp_path, monkeypatch):
    """fast.onnx over 16 MiB keeps its RoPE tables in fast.onnx.data: the FPGA compile reads them from beside the
    model, not from the current folder (it failed with onnx's traceback there), and gives the inline model's
    bundle."""
    import onnx

    ext = tmp_path / "ext"
    ext.mkdir()
    onnx.save_model(onnx.load(str(programs / "fast.onnx")), str(ext / "fast.onnx"), save_as_external_data=True,
                    all_tensors_to_one_file=True, location="fast.onnx.data", size_threshold=0)
    monkeypatch.chdir(tmp_path)
    assert main([str(ext / "fast.onnx"), "--target", "fpga", "-o", str(tmp_path / "e.fcb")]) == 0
    assert main([str(programs / "fast.onnx"), "--target", "fpga", "-o", str(tmp_path / "i.fcb")]) == 0
    a, b = encode.load(tmp_path / "e.fcb"), encode.load(tmp_path / "i.fcb")
    np.testing.assert_array_equal(a.bundles, b.bundles)
    assert a.meta["model"] == b.meta["model"]
