"""The long-video demo's pieces: per-layer replay maps, KV mode parsing, the long model's export (slow)."""

from __future__ import annotations

import numpy as np
import pytest

from fastcar_compile.core.errors import FastCarError
from fastcar_compile.demo.evaluate import ClipResult
from fastcar_compile.demo.kvsweep import parse_mode, parse_modes
from fastcar_compile.demo.longvideo import layer_replay
from fastcar_compile.demo.video import VideoRun


def test_layer_replay_places_each_step_on_its_frame_and_position():
    """Step k feeds generated token k, i.e. frame 1 + k // L, position k % L (hand-placed marks)."""
    L, T, layers = 4, 3, 2
    steps = (T - 1) * L - 1  # the last token is never fed
    rep = np.zeros((steps, layers), bool)
    rep[0, 0] = True  # frame 1, position 0, layer 0
    rep[5, 1] = True  # frame 2, position 1, layer 1
    run = VideoRun(np.zeros((T, L), np.int64), rep)
    r = ClipResult("pan_left", "x", np.zeros((T, 32, 32, 3), np.uint8), run, run)
    m = layer_replay([r, r], L)
    want = np.zeros((layers, T, L))
    want[0, 1, 0] = 1
    want[1, 2, 1] = 1
    np.testing.assert_array_equal(m, want)


def test_mode_grammar():
    w = parse_mode("window:4+60", 64, 3)
    assert (w.budget, w.sinks, w.window, w.eviction) == (65, 4, 60, "oldest")
    t = parse_mode("tempcache:0.95@4+60+192", 64, 3)
    assert (t.tempcache_sim, t.budget, t.sinks, t.window, t.frame_tokens, t.video_start) == (0.95, 192, 4, 60, 64, 3)
    assert parse_mode("lsh:8x4", 64, 3).lsh_bits == 8 and parse_mode("dense", 64, 3) is None
    assert [m for m, _ in parse_modes("tempcache:0.9", 64, 3)] == ["dense", "tempcache:0.9"]
    i8 = parse_mode("int8:4x8", 64, 3)
    assert (i8.int8_dirs, i8.int8_tables, i8.sinks, i8.window, i8.lsh_bits) == (4, 8, 4, 64, None)
    bare = parse_mode("int8", 64, 3)  # the compiler's --sparse-attention grammar: bare int8 = its default
    assert (bare.int8_dirs, bare.int8_tables) == (2, 4)
    pr = parse_mode("prune:0.05", 64, 3)
    assert (pr.prune_prompt, pr.video_start, pr.budget, pr.sinks) == (0.05, 3, None, 0)
    for bad in ("window:4", "tempcache:high", "lsh:8", "cache:1", "budget:1+2+x", "int8:3x4", "int8:x", "prune:hi",
                "prune:2"):
        with pytest.raises(FastCarError):
            parse_mode(bad, 64, 3)
    with pytest.raises(FastCarError, match="budget"):
        parse_mode("budget:4+60+10", 64, 3)


@pytest.mark.slow
def test_long_model_onnx_matches_pytorch():
    """The cached export of the shipped long-video weights equals eager transformers (prefill + decode)."""
    pytest.importorskip("onnxruntime")
    import importlib.util
    from pathlib import Path

    from fastcar_compile.demo.export import LONG_CONFIG, LONG_WEIGHTS, load_model
    from fastcar_compile.demo.longvideo import long_onnx

    spec = importlib.util.spec_from_file_location("export_demo", Path(__file__).parents[1] / "scripts" / "export_demo.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.check(long_onnx(progress=False), load_model(LONG_WEIGHTS, LONG_CONFIG)) < 1e-4


@pytest.mark.slow
def test_demo_long_tiny_end_to_end(tmp_path, capsys):
    """`demo --long` on 1 clip x 4 frames at tau = -inf: every layer replays every eligible step, so each
    layer's share over the generated tokens is (tokens fed) / (tokens generated); all files written."""
    import json

    from fastcar_compile.cli import main

    out = tmp_path / "long"
    assert main(["demo", "--long", "--demo-model", "small", "--clips", "1", "--frames", "4", "--out", str(out),
                 "--threshold=-inf"]) == 0
    for name in ("demo.gif", "strip.png", "replay_heatmap.png", "replay_layers.png", "psnr_frames.png",
                 "results.json", "fast.onnx"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    res = json.loads((out / "results.json").read_text())
    gen = 3 * 64  # 3 generated frames of L = 64 tokens
    assert len(res["replay_per_layer"]) == 4
    np.testing.assert_allclose(res["replay_per_layer"], (gen - 1) / gen)  # the last token is never fed
    for mode, psnr in res["psnr_per_frame"].items():
        assert len(psnr) == 3 and all(np.isfinite(p) and p > 0 for p in psnr), mode
    assert "replay per layer" in capsys.readouterr().out


def test_eval_kv_sweep_bad_mode_exits_2(tmp_path, capsys):
    from fastcar_compile.cli import main

    assert main(["eval", "--kv-modes", "cache:1", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "unknown KV mode" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()
