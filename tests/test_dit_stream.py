"""The chunk-causal video DiT: export vs eager PyTorch (a step over a non-empty cache), the ONNX streaming
rollout vs the eager rollout with the rolling window active, the cache's sinks + window vs an independent
bookkeeping, the weightless export of a large config, and the `export --dit` / `stream` command lines."""

from __future__ import annotations

import json
from collections import deque
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")

from dit_modes_helpers import refusal  # noqa: E402

from fastcar_compile.cli import main  # noqa: E402
from fastcar_compile.core.contract import DiTConfig  # noqa: E402
from fastcar_compile.dit.cache import FrameCache  # noqa: E402
from fastcar_compile.dit.config import PRESETS  # noqa: E402
from fastcar_compile.dit.model import build  # noqa: E402
from fastcar_compile.dit.stream import OrtDiT, StreamSettings, TorchDiT, rollout  # noqa: E402

CFG = PRESETS["tiny"]


@pytest.fixture(scope="module")
def exported(dit_tiny_export: Path) -> Path:
    return dit_tiny_export  # exported once per test session (conftest)


def test_export_cli_writes_both_graphs(exported, capsys):
    assert exported.is_file() and exported.with_name("dit.text.onnx").is_file()
    assert not list(exported.parent.glob(".export-*"))


def test_step_with_cache_matches_eager(exported, dit_tiny_eager):
    """One denoising step of a CFG pair over 3 cached frames, at mixed per-frame noise levels."""
    g = torch.Generator().manual_seed(11)
    n = CFG.layers
    text = torch.randn(2, 5, CFG.text_dim, generator=g)
    latent = torch.randn(2, CFG.in_channels, CFG.chunk_frames, CFG.latent_h, CFG.latent_w, generator=g)
    timestep = torch.tensor([[750.0, 500.0], [750.0, 500.0]])
    past = [torch.randn(2, CFG.heads, 3 * CFG.tokens_per_frame, CFG.head_dim, generator=g) for _ in range(2 * n)]
    with torch.no_grad():
        cross = dit_tiny_eager.text_kv(text)
        want = [t.numpy() for t in dit_tiny_eager(latent, timestep, torch.tensor([3]), *past, *cross)]
    m = OrtDiT(exported)
    got_cross = m.text_kv(text.numpy())
    for a, b in zip(got_cross, cross, strict=True):
        np.testing.assert_allclose(a, b.numpy(), atol=1e-4, rtol=0)
    got = m.step(latent.numpy(), timestep.numpy(), 3, [p.numpy() for p in past], got_cross)
    assert len(got) == 1 + 2 * n and got[1].shape == (2, CFG.heads, CFG.chunk_frames * CFG.tokens_per_frame,
                                                      CFG.head_dim)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)
    # the cache matters: the same step without it differs
    empty = [p[:, :, :0].numpy() for p in past]
    assert np.abs(m.step(latent.numpy(), timestep.numpy(), 3, empty, got_cross)[0] - want[0]).max() > 1e-3


def test_onnx_rollout_matches_eager_rollout(exported, dit_tiny_eager):
    """5 chunks of 2 frames with 1 sink + a 4-frame window: eviction happens from the 3rd chunk on."""
    settings = StreamSettings(frames=10, seed=5, cfg_scale=3.0)
    onnx_chunks = list(rollout(OrtDiT(exported), settings))
    eager_chunks = list(rollout(TorchDiT(dit_tiny_eager), settings))
    assert len(onnx_chunks) == 5
    assert onnx_chunks[-1].resident == [0, 6, 7, 8, 9]  # frames 1..5 evicted
    for a, b in zip(onnx_chunks, eager_chunks, strict=True):
        assert a.resident == b.resident
        np.testing.assert_allclose(a.frames, b.frames, atol=1e-4, rtol=0)
    assert np.abs(onnx_chunks[-1].frames).max() > 0.1  # a video, not zeros


def _reference_resident(frames_written: int, chunk: int, sinks: int, window: int) -> list[int]:
    """Independent bookkeeping: a sink list that fills first, then a bounded deque of recent frames."""
    sink_list: list[int] = []
    recent: deque[int] = deque(maxlen=window or None)
    for f in range(frames_written):
        (sink_list if len(sink_list) < sinks else recent).append(f)
    return sink_list + list(recent)


@pytest.mark.parametrize("chunk,sinks,window", [(2, 1, 4), (3, 3, 18), (3, 0, 6), (2, 2, 0), (4, 1, 3), (1, 2, 1)])
def test_cache_sinks_and_window(chunk, sinks, window):
    layers, tokens, heads, d = 2, 3, 2, 4
    cache = FrameCache(layers, tokens, sinks, window)
    for start in range(0, 40, chunk):
        # K/V of frame f in layer l hold 100 f + 10 l (+5 for V): where each came from is readable in the past
        kv = []
        for layer in range(layers):
            for off in (0, 5):
                a = np.concatenate([np.full((1, heads, tokens, d), 100 * f + 10 * layer + off, np.float32)
                                    for f in range(start, start + chunk)], axis=2)
                kv.append(a)
        cache.write(start, kv)
        want = _reference_resident(start + chunk, chunk, sinks, window)
        assert cache.resident == want
        past = cache.past(1, heads, d)
        for i, arr in enumerate(past):
            layer, off = divmod(i, 2)
            expect = np.repeat(100 * np.array(want, np.float32) + 10 * layer + 5 * off, tokens)
            np.testing.assert_array_equal(arr[0, 0, :, 0], expect)


@pytest.mark.parametrize("compose", [True, False])
def test_weightless_export_of_a_large_shape(tmp_path, compose):
    """From the meta device: no weight in memory, initializers in a sparse zero file; ORT still runs it
    (one traced block chained per layer, or the whole model traced)."""
    from fastcar_compile.dit.export import export_dit

    cfg = DiTConfig(layers=2, hidden=512, heads=4, ffn=1024, text_dim=64, in_channels=4, latent_h=4, latent_w=4,
                    freq_dim=32, text_len=4, chunk_frames=1, sink_frames=1, window_frames=2)
    model = build(cfg, device="meta")
    assert all(p.device.type == "meta" for p in model.parameters())
    step, text = export_dit(model, tmp_path / "big.onnx", weights="zeros", compose=compose)
    data = tmp_path / "big.onnx.data"
    assert data.stat().st_size >= 4 * 2 * 8 * 512 * 512  # the blocks' attention weights at least
    assert data.stat().st_blocks * 512 < data.stat().st_size / 4  # a hole, not written zeros
    m = OrtDiT(step)
    cross = m.text_kv(np.ones((1, 3, 64), np.float32))
    out = m.step(np.ones((1, 4, 1, 4, 4), np.float32), np.full((1, 1), 500.0, np.float32), 0,
                 [np.zeros((1, 4, 0, 128), np.float32)] * 4, cross)
    assert out[0].shape == (1, 4, 1, 4, 4) and np.isfinite(out[0]).all()


def test_stream_cli(exported, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["stream", str(exported), "--frames", "7", "-o", str(out), "--seed", "3"]) == 0
    doc = json.loads((out / "stream.json").read_text())
    assert len(doc["frame_ms"]) == len(doc["rss_mib"]) == 7
    assert doc["settings"]["window_frames"] == CFG.window_frames and doc["settings"]["cfg_scale"] == 3.0
    from PIL import Image

    with Image.open(out / "video.gif") as gif:
        assert gif.n_frames == 7
    assert (out / "stream.png").stat().st_size > 1000
    assert sorted(p.name for p in out.iterdir()) == ["stream.json", "stream.png", "video.gif"]
    capsys.readouterr()
    text = tmp_path / "p.npy"
    np.save(text, np.ones((4, CFG.text_dim), np.float32))
    assert main(["stream", str(exported), "--frames", "3", "-o", str(tmp_path / "r2"), "--text", str(text),
                 "--cfg", "1", "--window", "0"]) == 0


@pytest.mark.parametrize("argv,words", [
    (["stream", "{model}", "--frames", "0", "-o", "{tmp}/o"], "--frames"),
    (["stream", "{tmp}/missing.onnx", "--frames", "2", "-o", "{tmp}/o"], "does not exist"),
    (["stream", "{text_graph}", "--frames", "2", "-o", "{tmp}/o"], "not a DiT step graph"),
    (["stream", "{model}", "--frames", "2", "-o", "{tmp}/o", "--text", "{tmp}/bad.npy"], "--text"),
    (["stream", "{model}", "--frames", "2", "-o", "{tmp}/o", "--cfg", "nan"], "--cfg"),
    (["stream", "{model}", "--frames", "\u0663", "-o", "{tmp}/o"], "ASCII"),
    (["stream", "{model}", "--frames", "2", "-o", "{tmp}/o", "--window", "\u00b2"], "ASCII"),
    (["stream", "{model}", "--frames", "2", "-o", "{model}"], "is a file"),
    (["export", "--dit", "no-such-preset", "-o", "{tmp}/x.onnx"], "no such preset"),
    (["export", "--dit", "tiny", "-o", "{tmp}/x.pt"], ".onnx"),
    (["export", "--dit", "{tmp}/badcfg.json", "-o", "{tmp}/x.onnx"], "heads"),
])
def test_bad_input_is_one_line(exported, tmp_path, capsys, argv, words):
    np.save(tmp_path / "bad.npy", np.ones((4, CFG.text_dim + 1), np.float32))
    (tmp_path / "badcfg.json").write_text(json.dumps({"layers": 1, "hidden": 30, "heads": 4, "ffn": 8,
                                                      "text_dim": 4}))
    sub = {"model": str(exported), "tmp": str(tmp_path), "text_graph": str(exported.with_name("dit.text.onnx"))}
    capsys.readouterr()
    assert words in refusal([a.format(**sub) for a in argv], capsys)
    assert not (tmp_path / "o").exists() and not (tmp_path / "x.onnx").exists()


@pytest.mark.slow
def test_wan_shaped_export_without_weights(tmp_path, capsys):
    """`export --dit wan2.1-1.3b`: the 30-layer graph with 1560-token frames, its 5 GB of initializers a
    sparse hole; the checker accepts the model with its external data."""
    import onnx

    from fastcar_compile.core.contract import step_io

    out = tmp_path / "wan.onnx"
    assert main(["export", "--dit", "wan2.1-1.3b", "-o", str(out)]) == 0
    assert "without weights" in capsys.readouterr().out
    data = [tmp_path / "wan.onnx.data", tmp_path / "wan.text.onnx.data"]
    assert sum(d.stat().st_size for d in data) >= 4 * PRESETS["wan2.1-1.3b"].params  # every weight has a place
    assert sum(d.stat().st_blocks for d in data) * 512 < 1 << 20  # and none is written
    onnx.checker.check_model(str(out))
    proto = onnx.load(str(out), load_external_data=False)
    assert [i.name for i in proto.graph.input] == step_io(30)[0]
    assert all(t.data_location == onnx.TensorProto.EXTERNAL for t in proto.graph.initializer)


def test_export_from_a_checkpoint_folder(tmp_path, capsys):
    """config.json + model.safetensors: the export carries those weights (not the seeded random ones)."""
    import dataclasses

    from safetensors.torch import save_file

    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(dataclasses.asdict(CFG)))
    trained = build(CFG, seed=7)
    save_file({k: v.contiguous() for k, v in trained.state_dict().items()}, str(folder / "model.safetensors"))
    out = tmp_path / "dit.onnx"
    assert main(["export", "--dit", str(folder), "-o", str(out)]) == 0
    assert "matches the eager model" in capsys.readouterr().out
    settings = StreamSettings(frames=4, seed=1)
    got = [c.frames for c in rollout(OrtDiT(out), settings)]
    want = [c.frames for c in rollout(TorchDiT(trained), settings)]
    np.testing.assert_allclose(np.concatenate(got, 1), np.concatenate(want, 1), atol=1e-4, rtol=0)
    (folder / "model.safetensors").write_bytes(b"broken")
    assert main(["export", "--dit", str(folder), "-o", str(tmp_path / "b.onnx")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cannot read the weights" in err
