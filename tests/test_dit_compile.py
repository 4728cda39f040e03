"""`fastcar-compile dit.onnx -o fast.onnx` on a chunk-causal DiT step graph: discovery of its blocks (and a block
that does not match saying why), the compiled graph's rollout through the stream runtime against the eager
PyTorch rollout, the in-place cache (buffers bound, never concatenated) against independent bookkeeping, and
the one-line refusals of what a DiT cannot be compiled with yet."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")

from test_dit_stream import _reference_resident  # noqa: E402  (the independent residency bookkeeping)

from fastcar_compile.cli import main  # noqa: E402
from fastcar_compile.core.contract import PAST_LENGTH  # noqa: E402
from fastcar_compile.dit.cache import RingCache  # noqa: E402
from fastcar_compile.dit.config import PRESETS  # noqa: E402
from fastcar_compile.dit.stream import OrtDiT, StreamSettings, TorchDiT, rollout  # noqa: E402

CFG = PRESETS["tiny"]


@pytest.fixture(scope="module")
def exported(dit_tiny_export: Path) -> Path:
    return dit_tiny_export  # exported once per test session (conftest)


@pytest.fixture(scope="module")
def compiled(exported, tmp_path_factory) -> Path:
    """Compiled into another folder with --threshold inf (dense)."""
    out = tmp_path_factory.mktemp("fast") / "fast.onnx"
    assert main([str(exported), "-o", str(out), "--threshold", "inf"]) == 0
    return out


def test_inspect_explains_each_block(exported, capsys):
    capsys.readouterr()
    assert main([str(exported), "--inspect", "--verbose"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{CFG.layers}/{CFG.layers} DiT blocks matched")
    lines = [ln for ln in out[:out.index("plan:")].splitlines() if ln.strip().startswith("layer")]
    assert len(lines) == CFG.layers
    for line in lines:
        assert "matched" in line and "NOT" not in line
        for words in (f"self-attention over the cache {CFG.heads}x{CFG.head_dim}", "q/k RMSNorm",
                      "3D RoPE over frame/h/w", f"cross-attention to the prompt ({CFG.heads} heads)",
                      f"FFN {CFG.hidden} -> {CFG.ffn} -> {CFG.hidden} (GELU tanh)", "AdaLN"):
            assert words in line, (words, line)
    assert "Concat" in out and "Softmax" in out  # --verbose: the nodes each anchor found
    plan = out[out.index("plan:"):]  # and the plan: what the compile builds per block
    assert plan.count("attention op: FusedMatMul over the cache buffer") == CFG.layers
    assert plan.count("replay: none") == CFG.layers


def _broken(exported: Path, tmp: Path, how: str) -> Path:
    """The export with one block changed so that one anchor no longer matches."""
    proto = onnx.load(str(exported))
    nodes = list(proto.graph.node)
    if how == "no q norm":  # block 1's query skips its RMSNorm: the norm's output is replaced by its input
        norm_out = next(n for n in nodes if n.name.startswith("blocks.1/") and n.op_type == "Mul"
                        and any(i.endswith("norm_q.weight") for i in n.input))
        x = next(n for n in nodes if norm_out.input[0] in n.output).input[0]  # x of x * rsqrt(...)
        for n in nodes:
            n.input[:] = [x if i == norm_out.output[0] else i for i in n.input]
    elif how == "relu ffn":  # block 0's FFN activation is a ReLU
        gelu = next(n for n in nodes if n.name.startswith("blocks.0/") and n.op_type == "Gelu")
        gelu.op_type = "Relu"
        del gelu.attribute[:]
    path = tmp / f"{how.replace(' ', '_')}.onnx"
    onnx.save(proto, str(path))
    (tmp / "dit.text.onnx").write_bytes(exported.with_name("dit.text.onnx").read_bytes())
    return path


@pytest.mark.parametrize("how,layer,anchor,words", [
    ("no q norm", 1, "q/k norm", "the query before the rotary"),
    ("relu ffn", 0, "ffn", "no MatMul -> GELU -> MatMul"),
])
def test_a_block_that_does_not_match_says_why(exported, tmp_path, capsys, how, layer, anchor, words):
    path = _broken(exported, tmp_path, how)
    capsys.readouterr()
    assert main([str(path), "--inspect"]) == 0  # the other block still matches
    out = capsys.readouterr().out
    assert out.startswith(f"{CFG.layers - 1}/{CFG.layers} DiT blocks matched")
    line = next(ln for ln in out.splitlines() if ln.strip().startswith(f"layer   {layer}:"))
    assert "NOT MATCHED" in line and f"missing anchor '{anchor}'" in line and words in line
    # the compiler refuses the graph in one line naming the block (every block's cache input changes)
    assert main([str(path), "-o", str(tmp_path / "o.onnx")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"DiT block {layer} did not match" in err and anchor in err
    assert not (tmp_path / "o.onnx").exists()


@pytest.mark.parametrize("window,sinks,cfg_scale,resident", [
    (None, None, 3.0, [0, 10, 11, 12, 13]), (0, None, 3.0, list(range(14))), (3, 0, 1.0, [11, 12, 13])])
def test_compiled_rollout_matches_eager(compiled, dit_tiny_eager, window, sinks, cfg_scale, resident):
    """7 chunks of 2 frames: with the model's 1 sink + 4-frame window the ring wraps (frames 1..9 evicted);
    without a window the buffers grow past their first 8 frames; no sink, a 3-frame window and one row (no
    CFG). tau = +inf: equal to the export's model."""
    settings = StreamSettings(frames=14, seed=4, cfg_scale=cfg_scale, sink_frames=sinks, window_frames=window)
    model = OrtDiT(compiled)
    assert model.in_place
    got = list(rollout(model, settings))
    want = list(rollout(TorchDiT(dit_tiny_eager), settings))
    assert len(got) == 7
    for a, b in zip(got, want, strict=True):
        assert a.resident == b.resident
        np.testing.assert_allclose(a.frames, b.frames, atol=1e-4, rtol=0)
    assert got[-1].resident == resident
    assert np.abs(got[-1].frames).max() > 0.1


def test_cache_is_read_in_place(compiled):
    """The compiled graph reads past.N.* only through matrix products (no concat, transpose or copy of the
    cache), and the runtime binds the very buffers the ring writes into."""
    proto = onnx.load(str(compiled))
    past = {i.name for i in proto.graph.input if i.name.startswith("past.")}
    readers = [n.op_type for n in proto.graph.node for i in n.input if i in past and n.op_type != "Shape"]
    assert sorted(set(readers)) == ["FusedMatMul", "MatMul"] and len(readers) == len(past)
    assert PAST_LENGTH in [i.name for i in proto.graph.input]
    model = OrtDiT(compiled)
    gen = rollout(model, StreamSettings(frames=6, seed=1))
    next(gen)
    bound = dict(model.binding.inputs)
    next(gen)
    for name in past:
        assert model.binding.inputs[name] is bound[name]  # the same array for every step and chunk


@pytest.mark.parametrize("chunk,sinks,window", [(2, 1, 4), (3, 3, 18), (3, 0, 6), (2, 2, 0), (4, 1, 3), (1, 0, 0)])
def test_ring_holds_the_resident_frames(chunk, sinks, window):
    """After each write the valid prefix of the buffers holds exactly the resident frames' K/V (in some order)."""
    layers, tokens, heads, d = 2, 3, 2, 4
    ring = RingCache(layers, tokens, sinks, window, grow_from=2)
    for start in range(0, 40, chunk):
        kv = [np.concatenate([np.full((1, heads, tokens, d), 100 * f + 10 * layer + off, np.float32)
                              for f in range(start, start + chunk)], axis=2)
              for layer in range(layers) for off in (0, 5)]
        ring.write(start, kv)
        want = _reference_resident(start + chunk, chunk, sinks, window)
        assert ring.resident == want
        for i, buf in enumerate(ring.buffers):
            layer, off = divmod(i, 2)
            held = buf[0, 0, :ring.length, 0]
            assert sorted(held.tolist()) == sorted(np.repeat(100 * np.array(want) + 10 * layer + 5 * off,
                                                             tokens).tolist())


def test_stream_cli_on_the_compiled_graph(compiled, tmp_path):
    out = tmp_path / "run"
    assert main(["stream", str(compiled), "--frames", "5", "-o", str(out)]) == 0
    doc = json.loads((out / "stream.json").read_text())
    # 3 chunks of 2 frames written, 1 sink + a 4-frame window
    assert len(doc["frame_ms"]) == 5 and doc["resident_frames"] == _reference_resident(6, 2, 1, 4)


def test_default_threshold_compiles_dense_and_says_so(exported, tmp_path, capsys):
    capsys.readouterr()
    assert main([str(exported), "-o", str(tmp_path / "d.onnx")]) == 0
    out = capsys.readouterr().out
    assert "replay" in out and "compiled dense" in out and "2 DiT blocks rewritten" in out
    assert (tmp_path / "d.text.onnx").is_file()


def test_python_api_routes_dit_graphs(exported, tmp_path, dit_tiny_eager):
    import fastcar_compile as fc

    report = fc.inspect(exported)
    assert report.unit == "DiT blocks" and report.matched == [0, 1]
    _, report = fc.compile(exported, tmp_path / "api.onnx", frame_tokens=CFG.tokens_per_frame, threshold=float("inf"))
    assert report.rewritten == [0, 1]
    settings = StreamSettings(frames=4, seed=2)
    got = np.concatenate([c.frames for c in rollout(OrtDiT(tmp_path / "api.onnx"), settings)], 1)
    want = np.concatenate([c.frames for c in rollout(TorchDiT(dit_tiny_eager), settings)], 1)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("extra,words", [
    (["--threshold", "0.5", "--tas-query", "raw"], "--tas-query is not supported with FastCar FFN replay"),
    (["--threshold", "0.5,1", "--per-layer-threshold"], "--per-layer-threshold is not supported"),
    (["--threshold", "0.5", "--max-replay", "2"], "--max-replay is not supported"),
    (["--calibrate-replay", "1.5"], "--calibrate-replay must be a replay ratio in [0, 1]"),
    (["--calibrate-quality", "0.05", "--calib-data", "x.npy", "--frame-tokens", "16"], "by quality is not supported"),
    (["--kv-budget", "64"], "compressed KV cache"),
    (["--tempcache", "0.9", "--kv-budget", "64"], "compressed KV cache"),
    (["--layers", "0"], "--layers does not apply to a DiT"),
    (["--frame-tokens", "99"], "16 tokens per latent frame"),
    (["--fused-attention", "gqa"], "does not apply to a DiT"),
])
def test_refusals_are_one_line(exported, tmp_path, capsys, extra, words):
    capsys.readouterr()
    try:
        rc = main([str(exported), "-o", str(tmp_path / "x.onnx"), *extra])
    except SystemExit as e:
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err and "Traceback" not in err
    assert not (tmp_path / "x.onnx").exists() and not (tmp_path / "x.text.onnx").exists()


@pytest.mark.parametrize("which,words", [("compiled", "already compiled"), ("prompt", "DiT prompt graph")])
def test_compiling_a_compiled_or_prompt_graph_is_refused(compiled, tmp_path, capsys, which, words):
    model = compiled if which == "compiled" else compiled.with_name("fast.text.onnx")
    capsys.readouterr()
    assert main([str(model), "-o", str(tmp_path / "again.onnx")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err


@pytest.mark.slow
def test_wan_shaped_graph_compiles_without_weights(tmp_path, capsys):
    """`export --dit wan2.1-1.3b` then the compiler: all 30 blocks found and rewritten, the weights' sparse
    data copied as holes (nothing read)."""
    out = tmp_path / "wan.onnx"
    assert main(["export", "--dit", "wan2.1-1.3b", "-o", str(out)]) == 0
    fast = tmp_path / "fast" / "wan.onnx"
    capsys.readouterr()
    assert main([str(out), "-o", str(fast)]) == 0
    text = capsys.readouterr().out
    assert "30/30 DiT blocks matched" in text and "30 DiT blocks rewritten" in text
    proto = onnx.load(str(fast), load_external_data=False)
    assert PAST_LENGTH in [i.name for i in proto.graph.input]
    data = list(fast.parent.glob("*.data"))
    assert len(data) == 2 and sum(d.stat().st_blocks for d in data) * 512 < 1 << 20
