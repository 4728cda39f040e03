"""`fastcar-compile demo --dit`: the trained DiT's stream demo, its outputs and its refusals."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from fastcar_compile.cli import main  # noqa: E402
from fastcar_compile.cli.demo_dit import MODEL_DIR, parse_prompt  # noqa: E402
from fastcar_compile.demo.dit_train import DIT_PIXEL_CONFIG, save_weights  # noqa: E402
from fastcar_compile.dit.model import build  # noqa: E402

SMALL = dataclasses.replace(DIT_PIXEL_CONFIG, layers=1, hidden=24, heads=2, ffn=32, patch=(1, 8, 8), freq_dim=16,
                            window_frames=2)


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dit_small")
    save_weights(build(SMALL, seed=3), folder)
    return folder


def test_demo_streams_labelled_videos(weights, tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--dit", "--weights", str(weights), "--frames", "7", "--out", str(out),
                 "--prompt", "camera=pan_left", "--prompt", "camera=static,objects=objects_3", "--cfg", "1.5"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["demo.gif", "results.json", "strip.png"]
    doc = json.loads((out / "results.json").read_text())
    assert [v["prompt"]["camera"] for v in doc["videos"]] == ["pan_left", "static"]
    assert doc["videos"][1]["prompt"]["speed"] == "none" and doc["videos"][1]["prompt"]["objects"] == "objects_3"
    assert all(v["frames"] == 7 and len(ms) == 7 for v, ms in zip(doc["videos"], doc["frame_ms"], strict=True))
    assert doc["settings"]["cfg_scale"] == 1.5 and doc["config"]["layers"] == 1
    from PIL import Image

    with Image.open(out / "demo.gif") as gif:
        assert gif.n_frames == 7
        assert gif.size[0] == 2 * 32 * 4 + 4  # two 4x panels side by side
    assert "frames/s" in capsys.readouterr().out


def test_demo_prints_density_recall_and_fps_per_mode(weights, tmp_path, capsys):
    """Each FAST-AR mode streams the first prompt: its densities and recalls are those of an eager FAST-AR run
    with a dense attention on the side (fastcar_compile.dit.fastar, driven here directly), printed as percentages
    with its frames per second; the dense mode keeps every pair."""
    from fastcar_compile.cli.demo_dit import DEMO_MODES
    from fastcar_compile.demo.dit_train import text_embeds
    from fastcar_compile.dit import modes
    from fastcar_compile.dit.fastar import FastARDiT, totals
    from fastcar_compile.dit.stream import StreamSettings, rollout

    out = tmp_path / "demo"
    assert main(["demo", "--dit", "--weights", str(weights), "--frames", "4", "--out", str(out),
                 "--prompt", "camera=pan_left", "--mode-frames", "6"]) == 0
    text = capsys.readouterr().out
    doc = json.loads((out / "results.json").read_text())
    assert [r["mode"] for r in doc["modes"]] == list(DEMO_MODES) and doc["mode_frames"] == 6
    from fastcar_compile.cli.demo_dit import load_trained

    model = load_trained(weights)
    settings = StreamSettings(frames=6, seed=0, cfg_scale=2.0)
    for row, (name, kw) in zip(doc["modes"], DEMO_MODES.items(), strict=True):
        rt = FastARDiT(model, dataclasses.replace(modes.settings(**kw), diagnostics=True))
        for _ in rollout(rt, settings, text_embeds(parse_prompt("camera=pan_left"))):
            pass
        want = totals(rt.stats)
        for key in ("self_density", "self_recall", "cross_density", "cross_recall"):
            assert row[key] == pytest.approx(want[key]) if want[key] is not None else row[key] is None
        assert row["fps"] > 0
        line = next(ln for ln in text.splitlines() if ln.strip().startswith(name))
        assert f"self density {100 * want['self_density']:.1f}%" in " ".join(line.split()) and "frames/s" in line
    dense = doc["modes"][0]
    assert dense["self_density"] == pytest.approx(1.0) and dense["self_recall"] == pytest.approx(1.0)
    by_mode = {r["mode"]: r for r in doc["modes"]}
    assert by_mode["AnnSA-LSH"]["self_density"] < 1.0 and by_mode["AnnCA"]["cross_density"] < 1.0  # the modes act


def test_prompt_fills_and_checks_labels():
    p = parse_prompt("camera=zoom_out, scene=texture")
    assert p["camera"] == "zoom_out" and p["scene"] == "texture" and p["speed"] == "slow" and len(p) == 6


@pytest.mark.parametrize("argv,words", [
    (["--weights", "{tmp}/none"], "not found in"),
    (["--weights", "{tiny}"], "not a pixel-space DiT"),
    (["--weights", "{w}", "--prompt", "camera=sideways"], "'camera=sideways' is not FIELD=VALUE"),
    (["--weights", "{w}", "--prompt", "colour=red"], "is not FIELD=VALUE"),
    (["--weights", "{w}", "--frames", "0"], "--frames"),
    (["--weights", "{w}", "--cfg", "nan"], "--cfg"),
    (["--weights", "{w}", "--cfg", "0"], "--cfg must be > 0"),
    (["--weights", "{w}", "--threads", "0"], "--threads"),
    (["--weights", "{w}", "--mode-frames", "-1"], "--mode-frames"),
    (["--weights", "{w}", "--out", "{w}/config.json"], "is a file"),
])
def test_bad_input_is_one_line(weights, tmp_path, capsys, argv, words):
    from fastcar_compile.dit.config import PRESETS

    tiny = tmp_path / "tiny"
    save_weights(build(PRESETS["tiny"]), tiny)
    sub = {"tmp": str(tmp_path), "w": str(weights), "tiny": str(tiny)}
    capsys.readouterr()
    rc = main(["demo", "--dit", "--out", str(tmp_path / "o"), *[a.format(**sub) for a in argv]])
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_shipped_weights_are_small_fp16_and_load():
    files = [MODEL_DIR / "model.safetensors", MODEL_DIR / "config.json"]
    if not all(f.is_file() for f in files):
        pytest.skip("training/dit_model is not in this checkout")
    assert files[0].stat().st_size <= 10 * 2**20
    from safetensors.numpy import load_file

    assert {a.dtype for a in load_file(str(files[0])).values()} == {np.dtype(np.float16)}
    from fastcar_compile.cli.demo_dit import load_trained

    m = load_trained(MODEL_DIR)
    assert m.cfg.in_channels == 3 and m.cfg.latent_h == 32
