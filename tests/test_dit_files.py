"""The DiT path treats its files as the decoder path does: outputs checked against every input before any work,
weights that are a dangling link, a folder or a FIFO refused (never replaced by random weights, which only a
preset or --random-weights gives), a step graph's metadata bounded as it is read, sizes checked against memory
before anything is allocated, and a stream that overflows to NaN refused instead of written as a blank video.
Every case through the real CLI: exit 2, one line, inputs byte-identical, nothing left behind."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

pytest.importorskip("torch")

from fastcar_compile.cli import main  # noqa: E402


def _tree(root: Path) -> dict:
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_symlink():
            out[str(p.relative_to(root))] = f"-> {os.readlink(p)}"
        elif p.is_file():
            out[str(p.relative_to(root))] = p.read_bytes()
        else:
            out[str(p.relative_to(root))] = oct(p.lstat().st_mode)
    return out


def _refused(argv: list[str], root: Path, capsys, word: str) -> str:
    """Run `argv`: exit 2 with one line holding `word`, every file under `root` as it was."""
    before = _tree(root)
    capsys.readouterr()
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and word in err and "Traceback" not in err, err
    assert _tree(root) == before
    return err


@pytest.fixture(scope="module")
def graphs(dit_tiny_export, tmp_path_factory):
    """The tiny step graph and copies whose metadata is broken one way each (the prompt graph beside each)."""
    d = tmp_path_factory.mktemp("ditfiles")
    src = dit_tiny_export
    shutil.copyfile(src, d / "dit.onnx")
    shutil.copyfile(src.with_name("dit.text.onnx"), d / "dit.text.onnx")
    base = onnx.load(str(src))
    meta = {p.key: p.value for p in base.metadata_props}
    cfg = json.loads(meta["fastcar.dit_config"])
    broken = {
        "huge_latent": {"fastcar.dit_config": json.dumps(dict(cfg, latent_h=1 << 20, latent_w=1 << 20))},
        "huge_window": {"fastcar.dit_config": json.dumps(dict(cfg, latent_h=8192, latent_w=8192, patch=[1, 1, 1],
                                                              window_frames=100_000))},
        "bad_modes": {"fastcar.dit_modes": json.dumps({"annsa": {"kind": "lsh", "lsh_bits": 60, "ann_tables": 2,
                                                                 "ann_seed": 0, "annsa_local": 1}})},
        "modes_uncompiled": {"fastcar.dit_modes": json.dumps({"threshold": 0.5})},
        "hidden_other": {"fastcar.dit_config": json.dumps(dict(cfg, hidden=64, heads=2))},
        "modes_not_json": {"fastcar.dit_modes": "{not json"},
        "text_outside": {"fastcar.dit_text_graph": "../dit.text.onnx"},
    }
    for name, change in broken.items():
        m = onnx.load(str(src))
        props = {p.key: p.value for p in m.metadata_props}
        props.update(change)
        del m.metadata_props[:]
        for k, v in props.items():
            m.metadata_props.add(key=k, value=v)
        (d / name).mkdir()
        onnx.save(m, str(d / name / "dit.onnx"))
        shutil.copyfile(src.with_name("dit.text.onnx"), d / name / "dit.text.onnx")
    np.save(d / "calib.npy", np.zeros((4, cfg["text_dim"]), np.float32))
    return d


@pytest.mark.parametrize("name, word", [("huge_latent", "beyond"), ("huge_window", "shape"), ("bad_modes", "lsh_bits"),
                                        ("modes_not_json", "not valid JSON"), ("text_outside", "not a file name"),
                                        ("modes_uncompiled", "compiled form"), ("hidden_other", "shape")])
def test_a_step_graph_with_broken_metadata_is_refused_before_allocating(graphs, tmp_path, capsys, name, word):
    _refused(["stream", str(graphs / name / "dit.onnx"), "--frames", "2", "-o", str(tmp_path / "o")], graphs,
             capsys, word)
    assert not (tmp_path / "o").exists()


def test_calibration_data_the_compile_would_overwrite_is_refused_before_calibrating(graphs, capsys):
    """--calib-data named as the output, or as the prompt graph the compile writes beside it: refused before the
    calibration streams anything, the file as it was."""
    work = graphs / "cal"
    work.mkdir(exist_ok=True)
    shutil.copyfile(graphs / "calib.npy", work / "out.text.onnx")
    shutil.copyfile(graphs / "calib.npy", work / "out.onnx")
    for target in ("out.onnx", "out.text.onnx"):
        _refused([str(graphs / "dit.onnx"), "-o", str(work / "out.onnx"), "--calibrate-replay", "0.5",
                  "--calib-data", str(work / target)], graphs, capsys, "--calib-data")
    _refused([str(graphs / "dit.onnx"), "-o", str(graphs / "t.npy"), "--calibrate-replay", "0.5", "--calib-data",
              str(graphs / "t.npy")], graphs, capsys, ".npy")


@pytest.fixture
def folders(tmp_path):
    """DiT folders: config.json beside model.safetensors as a dangling link, a folder, a FIFO; one with no
    weights; one whose weights have other shapes than its config."""
    import dataclasses

    from fastcar_compile.demo.dit_train import save_weights
    from fastcar_compile.dit.config import PRESETS
    from fastcar_compile.dit.model import build

    cfg = dataclasses.asdict(PRESETS["tiny"])
    for name in ("dangling", "folder", "fifo", "none", "shapes"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
    os.symlink("nowhere.safetensors", tmp_path / "dangling" / "model.safetensors")
    (tmp_path / "folder" / "model.safetensors").mkdir()
    os.mkfifo(tmp_path / "fifo" / "model.safetensors")
    other = dataclasses.replace(PRESETS["tiny"], hidden=64, heads=2, ffn=96)
    save_weights(build(other, seed=1), tmp_path / "shapes_src")
    shutil.copyfile(tmp_path / "shapes_src" / "model.safetensors", tmp_path / "shapes" / "model.safetensors")
    return tmp_path


@pytest.mark.parametrize("name, word", [("dangling", "dangling link"), ("folder", "is a folder"),
                                        ("fifo", "named pipe"), ("none", "--random-weights"),
                                        ("shapes", "shapes do not match")])
def test_weights_that_are_not_a_file_are_refused_never_random(folders, capsys, name, word):
    """export --dit and stream (eager) on each folder: one line, nothing written; no random weights in their place."""
    _refused(["export", "--dit", str(folders / name), "-o", str(folders / "x.onnx")], folders, capsys, word)
    _refused(["stream", str(folders / name), "--frames", "2", "-o", str(folders / "o")], folders, capsys, word)


def test_random_weights_only_when_asked(folders, tmp_path, capsys):
    """A folder without weights streams with --random-weights (and a preset always): both accepted."""
    assert main(["stream", str(folders / "none"), "--frames", "2", "-o", str(tmp_path / "a"), "--random-weights",
                 "--threads", "1"]) == 0
    assert main(["stream", "tiny", "--frames", "2", "-o", str(tmp_path / "b"), "--threads", "1"]) == 0
    a, b = (json.loads((tmp_path / x / "stream.json").read_text()) for x in "ab")
    assert a["frames"] == b["frames"] == 2


def test_config_sizes_are_bounded_and_checked_against_memory(tmp_path, capsys):
    import dataclasses

    from fastcar_compile.dit.config import PRESETS

    cfg = dataclasses.asdict(PRESETS["tiny"])
    cases = {"hidden": (dict(cfg, hidden=10**9), "beyond"), "layers": (dict(cfg, layers=5000), "beyond"),
             "text_dim": (dict(cfg, text_dim=10**7), "beyond")}
    for name, (c, word) in cases.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(c))
        _refused(["stream", str(tmp_path / f"{name}.json"), "--frames", "2", "-o", str(tmp_path / "o"),
                  "--random-weights"], tmp_path, capsys, word)
    big = dict(cfg, latent_h=4096, latent_w=4096, patch=[1, 1, 1])
    (tmp_path / "big.json").write_text(json.dumps(big))
    _refused(["stream", str(tmp_path / "big.json"), "--frames", "8", "--window", "100000", "--sink", "100000",
              "-o", str(tmp_path / "o"), "--random-weights"], tmp_path, capsys, "GiB")


@pytest.mark.filterwarnings("error")  # a NumPy overflow warning would be a second line on the terminal
def test_a_stream_that_overflows_is_refused_not_written_blank(tmp_path, capsys):
    """CFG 1e308 makes the guided velocity infinite: before, the stream wrote a video of NaN frames, exit 0."""
    _refused(["stream", "tiny", "--frames", "4", "--cfg", "1e308", "-o", str(tmp_path / "o"), "--threads", "1"],
             tmp_path, capsys, "NaN or infinity")
    assert not (tmp_path / "o").exists()


def test_demo_weights_of_other_shapes_is_one_line(folders, capsys):
    import dataclasses

    from fastcar_compile.demo.dit_train import DIT_PIXEL_CONFIG, save_weights
    from fastcar_compile.dit.model import build

    small = dataclasses.replace(DIT_PIXEL_CONFIG, layers=1, hidden=24, heads=2, ffn=32, patch=(1, 8, 8), freq_dim=16)
    other = dataclasses.replace(small, hidden=32)
    save_weights(build(other, seed=2), folders / "demo_w")
    (folders / "demo_w" / "config.json").write_text(json.dumps(dataclasses.asdict(small)))
    _refused(["demo", "--dit", "--weights", str(folders / "demo_w"), "--frames", "2", "--out",
              str(folders / "demo_out")], folders, capsys, "shapes do not match")
