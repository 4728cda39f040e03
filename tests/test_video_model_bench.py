"""The pieces `python -m benchmarks video-model` stands on: the per-layer FAST-AR density / recall a video run
reports (the op's --kv-diagnostics, against NumPy brute force over the captured attention), the recorded
replay decisions and positions the FPGA simulation is fed with, tau calibration, and the side-by-side GIF /
strip with an extra column (pixels against the tokenizer's own decoding)."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

C, S, W = 100, 4, 80  # budget, sinks, window: the cache evicts (oldest first) once the context passes C


def _rope(x: np.ndarray, pos: np.ndarray, theta: float) -> np.ndarray:
    """transformers' LLaMA rotary embedding (rotate-half), written out here as the reference."""
    d = x.shape[-1]
    ang = pos[:, None] * (1.0 / theta ** (np.arange(0, d, 2) / d))[None]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
    rot = np.concatenate([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos[:, None] + rot * sin[:, None]


@pytest.fixture(scope="module")
def window_run(tmp_path_factory):
    """The bundled 1-layer demo model compiled with a bounded cache (sinks + oldest eviction) and diagnostics,
    one greedy video of 2 generated frames through `generate_video`."""
    import fastcar_compile
    from fastcar_compile.demo import data
    from fastcar_compile.demo import model as dm
    from fastcar_compile.demo.evaluate import load_tokenizer
    from fastcar_compile.demo.export import ONNX
    from fastcar_compile.demo.video import generate_video, open_session

    path = tmp_path_factory.mktemp("vmb") / "kv.onnx"
    fastcar_compile.compile(str(ONNX), output=str(path), frame_tokens=64, threshold=float("inf"), kv_budget=C,
                            kv_sinks=S, kv_window=W, kv_eviction="oldest", kv_diagnostics=512)
    tok = load_tokenizer()
    clip = data.make_clip("eval", 0, frames=3)
    pre = dm.prompt(clip.motion)
    run = generate_video(open_session(path), pre, tok.encode(clip.frames)[0], 2)
    return pre, run


def test_density_and_recall_per_layer_match_numpy_brute_force(window_run):
    """Density = kept keys / (p + 1), recall = dense softmax mass on the kept keys (the first S and the last
    C - S), over every query of the video (prompt included), from the model's own q/k captured in PyTorch."""
    from fastcar_compile.demo.export import load_model
    from fastcar_compile.demo.trace import capture

    pre, run = window_run
    ids = np.concatenate([pre, run.tokens.reshape(-1)[:-1]])  # the last token is never fed
    model = load_model()
    lt = capture(model, ids)[0]
    theta = float(model.config.rope_parameters["rope_theta"])
    pos = np.arange(len(ids), dtype=np.float64)
    q, k = _rope(lt.q.astype(np.float64), pos, theta), _rope(lt.k.astype(np.float64), pos, theta)
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    executed = dense = 0
    recall = []
    for p in range(len(ids)):
        kept = np.zeros(p + 1, bool)
        kept[:S] = True
        kept[max(0, p + 1 - (C - S)):] = True
        for h in range(hq):
            logits = k[: p + 1, h // (hq // hkv)] @ q[p, h] / np.sqrt(d)
            w = np.exp(logits - logits.max())
            recall.append(w[kept].sum() / w.sum())
            executed += kept.sum()
            dense += p + 1
    assert executed < dense  # the cache did evict: density below 1
    got = run.kv["0"]
    assert got["density"] == pytest.approx(executed / dense, rel=1e-9)
    assert got["recall"] == pytest.approx(np.mean(recall), abs=1e-4)


def test_recorded_positions_and_rows(window_run):
    """Each decode step's KV index (the FPGA simulation's context is pos + 1) follows the prompt and frame 0;
    the per-row decisions average to the per-step replay."""
    pre, run = window_run
    steps = run.tokens.size - 64 - 1
    np.testing.assert_array_equal(run.positions, len(pre) + 64 + np.arange(steps))
    assert run.replay_rows.shape[:2] == run.replay.shape and run.replay_rows.dtype == bool


def test_quantile_taus_give_the_target_replay_per_layer_and_overall():
    from video_model import configs, quantile_taus

    rng = np.random.default_rng(0)
    tas = rng.normal(size=(2000, 4)) * np.array([1.0, 2.0, 3.0, 0.5]) + np.array([15.0, 0.0, 3.0, -1.0])
    for target in (0.2, 0.5, 0.8):
        g, per = quantile_taus(tas, target)
        assert (tas > g).mean() == pytest.approx(target, abs=2e-3)
        for i, t in enumerate(per):
            assert (tas[:, i] > t).mean() == pytest.approx(target, abs=2e-3)
    cfgs = configs(tas, [0.8])
    assert (tas[:, 0] > cfgs["one tau, 80%"][0]).mean() == 1.0  # one tau: the high-TAS layer replays always
    assert cfgs["one tau 80%, layer 0 off"][0] == np.inf and cfgs["tau=+inf (0%)"] == [np.inf] * 4


def test_gif_and_strip_show_each_extra_video(tmp_path):
    from fastcar_compile.demo.evaluate import ClipResult, load_tokenizer
    from fastcar_compile.demo.video import VideoRun
    from fastcar_compile.demo.visuals import SCALE, columns, write_gif, write_strip

    tok = load_tokenizer()
    rng = np.random.default_rng(1)
    T, L = 3, tok.tokens_per_frame
    runs = [VideoRun(rng.integers(0, 512, (T, L)), np.ones(((T - 1) * L, 1), bool)) for _ in range(3)]
    gt = tok.decode(runs[0].tokens)
    r = ClipResult("pan_left", "x", gt, runs[0], runs[1], extra={"FAST-AR": runs[2]})
    assert columns(r) == ("ground truth", "dense", "FastCar", "FAST-AR", "replay map")
    gif = Image.open(io.BytesIO(write_gif([r], tok, tmp_path / "a.gif").read_bytes()))
    W = tok.frame
    assert gif.size[0] == SCALE * (5 * W + 4)
    gif.seek(1)
    frame = np.asarray(gif.convert("RGB"))
    top = frame.shape[0] - SCALE * W - 4  # below the header, above the 4-pixel gap under each clip
    x0 = SCALE * 3 * (W + 1)  # the fourth column: the extra video
    panel = frame[top: top + SCALE * W: SCALE, x0: x0 + SCALE * W: SCALE].astype(int)
    want = tok.decode(runs[2].tokens)[1].astype(int)
    assert np.abs(panel - want).mean() < 12  # GIF palette quantisation only
    other = tok.decode(runs[1].tokens)[1].astype(int)
    assert np.abs(panel - other).mean() > np.abs(panel - want).mean() + 10
    strip = Image.open(io.BytesIO(write_strip([r], tok, tmp_path / "s.png").read_bytes()))
    assert strip.size[1] > 5 * 3 * W  # five rows of frames


def test_closing_table_and_sections_from_a_run(tmp_path):
    """The suite's table from a run's JSON: each target's status follows from the raw figures (recomputed here),
    the further tables (curve, FAST-AR per layer, FPGA) follow it, and the runner leaves plot.png to the script."""
    import importlib
    import json

    import harness
    from suites import SUITES

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root))
    runner = importlib.import_module("benchmarks.__main__")
    raw = json.loads((root / "results" / "video-model" / "result.json").read_text())["raw"]
    d = raw["dense"]
    raw["dense"] = {**d, "psnr_dense_vs_truth": d["psnr_repeat_last_vs_truth"] + 2.5,  # the gain target now met
                    "dense_minus_repeat_db": 2.5}
    folder = runner.present(SUITES["video-model"], raw, "quick", harness.provenance("quick", ["video-model"]), 1.0,
                            tmp_path)
    assert not (folder / "plot.png").exists()  # the script's own picture, copied by `run`, not a bar chart
    rows = {r["quantity"]: r for r in json.loads((folder / "result.json").read_text())["rows"]}
    (gain,) = [r for q, r in rows.items() if q.startswith("dense vs repeat-last-frame (PSNR vs truth")]
    assert gain["status"] == "met" and f"over {len(raw['clips'])} held-out clips" in gain["quantity"]
    gap = abs(d["copy_rate_dense"] - d["copy_rate_truth"])
    assert rows["copy rate dense / truth"]["status"] == ("met" if gap <= 0.10 else "MISSED")
    for c in raw["curve"]:
        lossy = "" if c["config"].startswith("tau=+inf") else " (lossy)"  # only tau=+inf never replays
        row = rows[f"FastCar {c['config']}{lossy}"]
        bound = 0.5 if "50%" in c["config"] else 1.0 if "80%" in c["config"] else None
        drop = -c["fast_minus_dense_db"]
        assert row["status"] == ("" if bound is None else "met" if drop <= bound else "MISSED"), c["config"]
    table = (folder / "table.md").read_text()
    for f in raw["fastar"]:
        assert f"| {f['mode']} | " + " | ".join(f"{p['density']:.0%} / {p['recall']:.0%}" for p in f["per_layer"]) in table
    assert table.index("## tau / quality") < table.index("## FAST-AR") < table.index("## FPGA") < table.index("Command:")
